// One decode step's attention over the fused KV cache: a few query rows per KV head (the
// grouped query heads of one token) against every cached key, in one pass over K and V.
//
// Why a kernel of our own: PyTorch's CPU flash kernel treats the 3-row query block like a
// prefill block (small GEMMs, a horizontal sum per score) and runs at half the memory
// bandwidth a decode step is bound by.  Here each work item is one KV head's slice of the
// keys: a register's width of keys' scores (16, or 8 on AVX2) come out of one transposed
// reduction, softmax is taken over the slice, V is streamed once with the accumulators in
// registers, and the slices are merged by their maxima and sums (the softmax-of-partial-sums
// identity, exact up to rounding).  AVX-512 or AVX2 (simd.h); cacheblend/native/__init__.py
// builds it on first use and falls back otherwise.
#include "kernels.h"
#include <cmath>
#include <limits>
#include <vector>
#include "simd.h"

using Vec = at::vec::Vectorized<float>;
using simd::R;
using simd::W;
// query rows (grouped heads) that share one pass over V: their accumulators stay in registers
constexpr int GT = simd::kWide ? 4 : 1;

template <typename T, int DV>
static void attend_range(const float* q, const T* k, const T* v, int64_t t0, int64_t t1, int64_t G,
                         int64_t rs, float* s, float* acc, float* m, float* l) {
  constexpr int HD = DV * W;
  const int64_t L = t1 - t0;
  const int64_t Lp = (L + 15) / 16 * 16;
  for (int64_t g = 0; g < G; ++g) {
    R qv[DV];
    for (int d = 0; d < DV; ++d) qv[d] = simd::load(q + g * HD + W * d);
    float* sg = s + g * Lp;
    int64_t t = 0;
    for (; t + W <= L; t += W) {
      R a[W];
      for (int j = 0; j < W; ++j) {
        const T* kr = k + (t0 + t + j) * rs;
        R x = simd::mul(qv[0], simd::load(kr));
        for (int d = 1; d < DV; ++d) x = simd::fmadd(qv[d], simd::load(kr + W * d), x);
        a[j] = x;
      }
      simd::store(sg + t, simd::reduce_rows(a));
    }
    for (; t < L; ++t) {
      const T* kr = k + (t0 + t) * rs;
      R x = simd::mul(qv[0], simd::load(kr));
      for (int d = 1; d < DV; ++d) x = simd::fmadd(qv[d], simd::load(kr + W * d), x);
      sg[t] = simd::reduce_add(x);
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (t = 0; t < L; ++t) mx = std::max(mx, sg[t]);
    for (; t < Lp; ++t) sg[t] = -std::numeric_limits<float>::infinity();
    Vec sum(0.f);
    for (t = 0; t < Lp; t += W) {
      Vec e = (Vec::loadu(sg + t) - Vec(mx)).exp_u20();
      e.store(sg + t);
      sum = sum + e;
    }
    m[g] = mx;
    l[g] = simd::reduce_add(sum);
  }
  for (int64_t g0 = 0; g0 < G; g0 += GT) {
    const int64_t gn = std::min<int64_t>(GT, G - g0);
    R o[GT][DV];
    for (int gi = 0; gi < GT; ++gi) for (int d = 0; d < DV; ++d) o[gi][d] = simd::zero();
    for (int64_t t = 0; t < L; ++t) {
      const T* vr = v + (t0 + t) * rs;
      R vv[DV];
      for (int d = 0; d < DV; ++d) vv[d] = simd::load(vr + W * d);
      for (int gi = 0; gi < GT; ++gi) {
        if (gi >= gn) break;
        R p = simd::set1(s[(g0 + gi) * Lp + t]);
        for (int d = 0; d < DV; ++d) o[gi][d] = simd::fmadd(p, vv[d], o[gi][d]);
      }
    }
    for (int gi = 0; gi < gn; ++gi) for (int d = 0; d < DV; ++d) simd::store(acc + (g0 + gi) * HD + W * d, o[gi][d]);
  }
}

template <typename T, int DV>
static at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t n,
                         double scale, int64_t splits) {
  constexpr int HD = DV * W;
  const int64_t H = q.numel() / HD, KVH = k.size(0), G = H / KVH;
  auto qf = q.reshape({H, HD}).to(at::kFloat).mul(scale).contiguous();
  const int64_t S = std::max<int64_t>(1, std::min<int64_t>(splits, (n + 15) / 16));
  const int64_t per = ((n + S - 1) / S + 15) / 16 * 16;
  const int64_t items = KVH * S;
  std::vector<float> accs(items * G * HD), ms(items * G), ls(items * G);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t hs = k.stride(0), rs = k.stride(1);
  const float* qp = qf.data_ptr<float>();
  at::parallel_for(0, items, 1, [&](int64_t b, int64_t e) {
    std::vector<float> s(G * (per + 16));
    for (int64_t i = b; i < e; ++i) {
      const int64_t h = i / S, sp = i % S;
      const int64_t t0 = std::min(n, sp * per), t1 = std::min(n, t0 + per);
      float* acc = accs.data() + i * G * HD;
      if (t1 <= t0) {
        std::fill(acc, acc + G * HD, 0.f);
        for (int64_t g = 0; g < G; ++g) { ms[i * G + g] = -INFINITY; ls[i * G + g] = 0.f; }
        continue;
      }
      attend_range<T, DV>(qp + h * G * HD, kp + h * hs, vp + h * hs, t0, t1, G, rs, s.data(), acc,
                          ms.data() + i * G, ls.data() + i * G);
    }
  });
  auto out = at::empty({H, 1, HD}, at::kFloat);
  float* op = out.data_ptr<float>();
  for (int64_t h = 0; h < KVH; ++h)
    for (int64_t g = 0; g < G; ++g) {
      float M = -INFINITY;
      for (int64_t sp = 0; sp < S; ++sp) M = std::max(M, ms[(h * S + sp) * G + g]);
      float den = 0.f, w[64];
      for (int64_t sp = 0; sp < S; ++sp) { w[sp] = std::exp(ms[(h * S + sp) * G + g] - M); den += w[sp] * ls[(h * S + sp) * G + g]; }
      float* o = op + (h * G + g) * HD;
      for (int d = 0; d < HD; ++d) {
        float x = 0.f;
        for (int64_t sp = 0; sp < S; ++sp) x += w[sp] * accs[((h * S + sp) * G + g) * HD + d];
        o[d] = x / den;
      }
    }
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

template <typename T>
static at::Tensor dispatch_hd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t n, double scale, int64_t splits) {
  switch (k.size(2)) {
    case 16: return run<T, 16 / W>(q, k, v, n, scale, splits);
    case 32: return run<T, 32 / W>(q, k, v, n, scale, splits);
    case 64: return run<T, 64 / W>(q, k, v, n, scale, splits);
    case 128: return run<T, 128 / W>(q, k, v, n, scale, splits);
    default: TORCH_CHECK(false, "head_dim must be 16, 32, 64 or 128");
  }
}

// q [H, 1, hd] (any float dtype), k and v [KVH, capacity, hd] views with contiguous rows holding
// keys 0..n-1, scale, key slices per head (work items: KVH x splits).  Returns [H, 1, hd] in q's dtype.
at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, int64_t n, double scale, int64_t splits) {
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.strides() == v.strides(), "K/V rows must be contiguous");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(), "k and v must both be [kv_heads, capacity, head_dim]");
  TORCH_CHECK(k.size(0) >= 1 && k.size(2) >= 1, "k and v need at least one head of head_dim >= 1");
  TORCH_CHECK(n >= 1 && n <= k.size(1), "n must be in [1, capacity]");
  TORCH_CHECK(q.size(-1) == k.size(2) && (q.numel() / k.size(2)) % k.size(0) == 0,
              "q must hold a multiple of kv_heads query heads of head_dim");
  TORCH_CHECK(splits >= 1 && splits <= 64, "splits must be in [1, 64]");
  if (k.scalar_type() == at::kFloat) return dispatch_hd<float>(q, k, v, n, scale, splits);
  TORCH_CHECK(k.scalar_type() == at::kBFloat16, "float32 or bfloat16 caches");
  return dispatch_hd<at::BFloat16>(q, k, v, n, scale, splits);
}
