// The elementwise parts of a layer in float32 or bfloat16, each one pass over its rows where
// PyTorch's CPU ops make several (and allocate a temporary per op):
//
// * RMSNorm: PyTorch's CPU rms_norm is a composite of six ops (square, mean, add, rsqrt, two
//   products); here one pass to sum the squares and one to scale.  The sum is taken in
//   another order than PyTorch's reduction, so the last bit can differ.
// * RoPE: x * cos + rotate_half(x) * sin is a negation, a concatenation, two products and a
//   sum in PyTorch; here the same products and sum per element (the build has
//   -ffp-contract=off, so no product is fused into the sum): the same bits as
//   models/kernels.apply_rope, which the chunk caches' re-positioning also computes.
// * Re-positioning (reposition): every reused span of a layer in one call, its keys plus the
//   chunk shift rotated into the fused cache and its values plus theirs copied beside them.
// * SiLU gate times up: the same expression as PyTorch's SiLU kernel (x / (1 + exp(-x)) with
//   the same vectorized exp), then the product, without the gate's temporary: the same bits
//   where a row's width is a multiple of the vector width (8 floats on AVX2, 16 on AVX-512;
//   every model's here), else a row's tail may differ in the last bit (PyTorch computes only
//   the flattened tensor's tail with the scalar exp).
//
// bfloat16 is computed in float32 and rounded to bfloat16 wherever PyTorch's bfloat16 ops
// round (after each product and sum; the norm in float32, then rounded, then times the
// weight).  Rows are independent: a row's result does not depend on which other rows share
// the call.
#include "kernels.h"
#include <algorithm>
#include <cmath>
#include <vector>
#include "simd.h"

using Vec = at::vec::Vectorized<float>;
using BF16 = at::BFloat16;
constexpr int64_t L = Vec::size();  // 16 on AVX-512, 8 on AVX2

// Loads and stores of m <= L elements as float32 lanes; round(): to the element type and back.
template <typename T> struct Io;
template <> struct Io<float> {
  static Vec load(const float* p, int64_t m) { return m == L ? Vec::loadu(p) : Vec::loadu(p, m); }
  static void store(float* p, const Vec& v, int64_t m) { if (m == L) v.store(p); else v.store(p, m); }
  static Vec round(const Vec& v) { return v; }
};
#if defined(CPU_CAPABILITY_AVX512)
template <> struct Io<BF16> {
  static __mmask16 mask(int64_t m) { return (__mmask16)((1u << m) - 1); }
  static Vec load(const BF16* p, int64_t m) {
    __m256i a = m == L ? _mm256_loadu_si256((const __m256i*)p) : _mm256_maskz_loadu_epi16(mask(m), p);
    __m512 o;
    at::vec::cvtbf16_fp32(a, o);
    return Vec(o);
  }
  static void store(BF16* p, const Vec& v, int64_t m) {
    __m256i b = at::vec::cvtfp32_bf16(__m512(v));
    if (m == L) _mm256_storeu_si256((__m256i*)p, b); else _mm256_mask_storeu_epi16(p, mask(m), b);
  }
  static Vec round(const Vec& v) {
    __m512 o;
    at::vec::cvtbf16_fp32(at::vec::cvtfp32_bf16(__m512(v)), o);
    return Vec(o);
  }
};
#else  // AVX2: no masked 16-bit loads and stores, so a short tail goes through a buffer
template <> struct Io<BF16> {
  static Vec load(const BF16* p, int64_t m) {
    __m128i a;
    if (m == L) {
      a = _mm_loadu_si128((const __m128i*)p);
    } else {
      BF16 t[L] = {};
      std::copy(p, p + m, t);
      a = _mm_loadu_si128((const __m128i*)t);
    }
    __m256 o;
    at::vec::cvtbf16_fp32(a, o);
    return Vec(o);
  }
  static void store(BF16* p, const Vec& v, int64_t m) {
    __m128i b = at::vec::cvtfp32_bf16(__m256(v));
    if (m == L) {
      _mm_storeu_si128((__m128i*)p, b);
    } else {
      BF16 t[L];
      _mm_storeu_si128((__m128i*)t, b);
      std::copy(t, t + m, p);
    }
  }
  static Vec round(const Vec& v) {
    __m256 o;
    at::vec::cvtbf16_fp32(at::vec::cvtfp32_bf16(__m256(v)), o);
    return Vec(o);
  }
};
#endif

static void check_rows(const at::Tensor& x, int dims, const char* name, c10::ScalarType dtype) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              name, " must be float32 or bfloat16");
  TORCH_CHECK(x.scalar_type() == dtype, name, " must have the input's dtype");
  TORCH_CHECK(x.dim() == dims, name, " must have ", dims, " dimensions");
  TORCH_CHECK(x.stride(dims - 1) == 1, name, "'s rows must be contiguous");
}

template <typename T>
static void norm_rows(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  using IO = Io<T>;
  const int64_t n = x.size(0), d = x.size(1), ldx = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* xr = xp + i * ldx;
      T* o = op + i * d;
      Vec acc(0.f);
      for (int64_t j = 0; j < d; j += L) { Vec v = IO::load(xr + j, std::min(L, d - j)); acc = at::vec::fmadd(v, v, acc); }
      const Vec r(1.f / std::sqrt(simd::reduce_add(acc) / float(d) + float(eps)));
      for (int64_t j = 0; j < d; j += L) {
        const int64_t m = std::min(L, d - j);
        IO::store(o + j, IO::round(IO::load(xr + j, m) * r) * IO::load(wp + j, m), m);
      }
    }
  });
}

// x [n, d] (rows contiguous), w [d] -> [n, d]: x * rsqrt(mean(x^2) + eps), then times w
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_rows(x, 2, "x", x.scalar_type());
  check_rows(w, 1, "the norm's weight", x.scalar_type());
  TORCH_CHECK(w.size(0) == x.size(1), "the norm's weight must be [", x.size(1), "]");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) norm_rows<float>(x, w, eps, out); else norm_rows<BF16>(x, w, eps, out);
  return out;
}

// One row of RoPE at one position: o = x * c + rotate_half(x) * s, x first moved by the
// chunk shift dx where there is one (the sum rounded to T, as PyTorch's add rounds it).
// The re-positioning and the plain RoPE share it, so their bits are the same.
template <typename T>
static inline void rope_row(const T* x, const T* dx, const T* c, const T* s, T* o, int64_t half) {
  using IO = Io<T>;
  for (int64_t j = 0; j < half; j += L) {  // first half: x * cos + (-x[j + half]) * sin
    const int64_t m = std::min(L, half - j);
    Vec lo = IO::load(x + j, m), hi = IO::load(x + half + j, m);
    if (dx) { lo = IO::round(lo + IO::load(dx + j, m)); hi = IO::round(hi + IO::load(dx + half + j, m)); }
    IO::store(o + j, IO::round(lo * IO::load(c + j, m)) + IO::round(hi.neg() * IO::load(s + j, m)), m);
    IO::store(o + half + j, IO::round(hi * IO::load(c + half + j, m)) + IO::round(lo * IO::load(s + half + j, m)), m);
  }
}

template <typename T>
static void rope_typed(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t H = x.size(0), n = x.size(1), hd = x.size(2), half = hd / 2;
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), o0 = out.stride(0), o1 = out.stride(1);
  const int64_t ldc = cos.stride(0), lds = sin.stride(0);
  at::parallel_for(0, H * n, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t h = r / n, i = r % n;
      const T* xr = xp + h * s0 + i * s1;
      rope_row<T>(xr, nullptr, cp + i * ldc, sp + i * lds, op + h * o0 + i * o1, half);
    }
  });
}

// out = x * cos + rotate_half(x) * sin, x and out [heads, n, hd] (last dimension contiguous,
// any other strides), cos and sin [n, hd] (rows contiguous)
static void rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  check_rows(x, 3, "x", x.scalar_type());
  check_rows(cos, 2, "cos", x.scalar_type());
  check_rows(sin, 2, "sin", x.scalar_type());
  check_rows(out, 3, "out", x.scalar_type());
  const int64_t n = x.size(1), hd = x.size(2);
  TORCH_CHECK(hd % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.size(0) == n && cos.size(1) == hd && sin.sizes() == cos.sizes(),
              "cos and sin must be [", n, ", ", hd, "]");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must have x's shape");
  if (x.scalar_type() == at::kFloat) rope_typed<float>(x, cos, sin, out); else rope_typed<BF16>(x, cos, sin, out);
}

// x [heads, n, hd] -> x rotated, [heads, n, hd] contiguous
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  auto out = at::empty(x.sizes(), x.options());
  rope_rows(x, cos, sin, out);
  return out;
}

// x rotated into out (a slice of the fused cache: re-positioning a chunk's keys); out must not overlap x
void rope_into(at::Tensor out, at::Tensor x, at::Tensor cos, at::Tensor sin) {
  rope_rows(x, cos, sin, out);
}

template <typename T>
static void gate_rows(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  using IO = Io<T>;
  const int64_t n = gate.size(0), I = gate.size(1), ldg = gate.stride(0), ldu = up.stride(0);
  const T* gp = gate.data_ptr<T>();
  const T* up_ = up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const Vec one(1.f);
  at::parallel_for(0, n, 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* g = gp + i * ldg;
      const T* u = up_ + i * ldu;
      T* o = op + i * I;
      for (int64_t j = 0; j < I; j += L) {
        const int64_t m = std::min(L, I - j);
        Vec x = IO::load(g + j, m);
        IO::store(o + j, IO::round(x / (one + x.neg().exp())) * IO::load(u + j, m), m);
      }
    }
  });
}

// silu(gate) * up, gate and up [n, I] (rows contiguous, any row strides: the two halves of
// one packed product, or two products of transformers' modules) -> [n, I]
at::Tensor silu_mul(at::Tensor gate, at::Tensor up) {
  check_rows(gate, 2, "gate", gate.scalar_type());
  check_rows(up, 2, "up", gate.scalar_type());
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up must have one shape");
  auto out = at::empty({gate.size(0), gate.size(1)}, gate.options());
  if (gate.scalar_type() == at::kFloat) gate_rows<float>(gate, up, out); else gate_rows<BF16>(gate, up, out);
  return out;
}

// One layer's re-positioning of every reused chunk in one call (the fusor's per-span RoPE
// and copies, with the chunk shift added on the way): for span s starting at position a,
//   out_k[:, a + i] = rope(k_s[:, i] + dk_s) at position a + i,   out_v[:, a + i] = v_s[:, i] + dv_s
// (dk_s, dv_s [KVH, 1, hd]; absent: nothing added).  The sums round to the element type
// before RoPE, as PyTorch's add does, so the bits are those of the per-span PyTorch ops.
struct Span {
  int64_t start, len, ks0, ks1, vs0, vs1, dks, dvs;
  const void *k, *v, *dk, *dv;
};

template <typename T>
static void reposition_typed(at::Tensor& out_k, at::Tensor& out_v, const std::vector<Span>& spans,
                             const at::Tensor& cos, const at::Tensor& sin) {
  using IO = Io<T>;
  const int64_t H = out_k.size(0), hd = out_k.size(2), half = hd / 2, S = spans.size();
  const int64_t ok0 = out_k.stride(0), ok1 = out_k.stride(1), ov0 = out_v.stride(0), ov1 = out_v.stride(1);
  const int64_t ldc = cos.stride(0), lds = sin.stride(0);
  T* okp = out_k.data_ptr<T>();
  T* ovp = out_v.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  std::vector<int64_t> first(S + 1, 0);  // rows (head, token) of all spans, flattened
  for (int64_t s = 0; s < S; ++s) first[s + 1] = first[s] + H * spans[s].len;
  at::parallel_for(0, first[S], 64, [&](int64_t b, int64_t e) {
    int64_t s = std::upper_bound(first.begin(), first.end(), b) - first.begin() - 1;
    for (int64_t r = b; r < e; ++r) {
      while (r >= first[s + 1]) ++s;
      const Span& sp_ = spans[s];
      const int64_t h = (r - first[s]) / sp_.len, i = (r - first[s]) % sp_.len, p = sp_.start + i;
      const T* x = static_cast<const T*>(sp_.k) + h * sp_.ks0 + i * sp_.ks1;
      const T* dk = sp_.dk ? static_cast<const T*>(sp_.dk) + h * sp_.dks : nullptr;
      rope_row<T>(x, dk, cp + p * ldc, sp + p * lds, okp + h * ok0 + p * ok1, half);
      const T* y = static_cast<const T*>(sp_.v) + h * sp_.vs0 + i * sp_.vs1;
      const T* dv = sp_.dv ? static_cast<const T*>(sp_.dv) + h * sp_.dvs : nullptr;
      T* ov = ovp + h * ov0 + p * ov1;
      for (int64_t j = 0; j < hd; j += L) {
        const int64_t m = std::min(L, hd - j);
        Vec val = IO::load(y + j, m);
        IO::store(ov + j, dv ? IO::round(val + IO::load(dv + j, m)) : val, m);
      }
    }
  });
}

// out_k, out_v [KVH, >= n, hd]: one layer of the fused cache; per span its start, K and V
// [KVH, len, hd] and optional shifts dk, dv [KVH, 1, hd]; cos, sin [n, hd] for positions 0..n-1
void reposition(at::Tensor out_k, at::Tensor out_v, std::vector<int64_t> starts, std::vector<at::Tensor> ks,
                std::vector<at::Tensor> vs, std::vector<c10::optional<at::Tensor>> dks,
                std::vector<c10::optional<at::Tensor>> dvs, at::Tensor cos, at::Tensor sin) {
  const auto dtype = out_k.scalar_type();
  check_rows(out_k, 3, "out_k", dtype);
  check_rows(out_v, 3, "out_v", dtype);
  check_rows(cos, 2, "cos", dtype);
  check_rows(sin, 2, "sin", dtype);
  const int64_t H = out_k.size(0), hd = out_k.size(2), S = starts.size();
  TORCH_CHECK(hd % 2 == 0, "head_dim must be even");
  TORCH_CHECK(out_v.size(0) == H && out_v.size(2) == hd && out_v.size(1) == out_k.size(1), "out_v must have out_k's shape");
  TORCH_CHECK(cos.size(1) == hd && sin.sizes() == cos.sizes(), "cos and sin must be [n, ", hd, "]");
  TORCH_CHECK((int64_t)ks.size() == S && (int64_t)vs.size() == S && (int64_t)dks.size() == S && (int64_t)dvs.size() == S,
              "one start, K, V, dk and dv per span");
  std::vector<Span> spans(S);
  for (int64_t s = 0; s < S; ++s) {
    check_rows(ks[s], 3, "a span's K", dtype);
    check_rows(vs[s], 3, "a span's V", dtype);
    const int64_t len = ks[s].size(1);
    TORCH_CHECK(ks[s].size(0) == H && ks[s].size(2) == hd && vs[s].sizes() == ks[s].sizes(),
                "a span's K and V must be [", H, ", len, ", hd, "]");
    TORCH_CHECK(starts[s] >= 0 && starts[s] + len <= std::min(out_k.size(1), cos.size(0)),
                "span ", s, " runs past the cache or the RoPE tables");
    Span& sp = spans[s];
    sp = {starts[s], len, ks[s].stride(0), ks[s].stride(1), vs[s].stride(0), vs[s].stride(1), 0, 0,
          ks[s].data_ptr(), vs[s].data_ptr(), nullptr, nullptr};
    for (int which = 0; which < 2; ++which) {
      const auto& d = which == 0 ? dks[s] : dvs[s];
      if (!d.has_value()) continue;
      check_rows(*d, 3, "a shift", dtype);
      TORCH_CHECK(d->size(0) == H && d->size(1) == 1 && d->size(2) == hd, "a shift must be [", H, ", 1, ", hd, "]");
      (which == 0 ? sp.dk : sp.dv) = d->data_ptr();
      (which == 0 ? sp.dks : sp.dvs) = d->stride(0);
    }
  }
  if (dtype == at::kFloat) reposition_typed<float>(out_k, out_v, spans, cos, sin);
  else reposition_typed<BF16>(out_k, out_v, spans, cos, sin);
}
