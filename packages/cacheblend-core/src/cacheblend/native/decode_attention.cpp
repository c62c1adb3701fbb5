// One decode step's attention over the fused KV cache: a few query rows per KV head (the
// grouped query heads of one token) against every cached key, in one pass over K and V.
//
// Why a kernel of our own: PyTorch's CPU flash kernel treats the 3-row query block like a
// prefill block (small GEMMs, a horizontal sum per score) and runs at half the memory
// bandwidth a decode step is bound by.  Here each work item is one KV head's slice of the
// keys: 16 keys' scores come out of one transposed reduction, softmax is taken over the slice,
// V is streamed once with the accumulators in registers, and the slices are merged by their
// maxima and sums (the softmax-of-partial-sums identity, exact up to rounding).
// AVX-512; cacheblend/native/__init__.py builds it on first use and falls back otherwise.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include <cmath>
#include <limits>
#include <vector>

using Vec = at::vec::Vectorized<float>;

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// r[j] = the sum of the 16 lanes of a[j]: pairs, then 64-bit halves, then 128-bit quarters.
static inline __m512 reduce16(const __m512* a) {
  __m512 b[8];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  __m512 c[4];
  for (int i = 0; i < 4; ++i) {
    __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

template <typename T, int DV>
static void attend_range(const float* q, const T* k, const T* v, int64_t t0, int64_t t1, int64_t G,
                         int64_t rs, float* s, float* acc, float* m, float* l) {
  constexpr int HD = DV * 16;
  const int64_t L = t1 - t0;
  const int64_t Lp = (L + 15) / 16 * 16;
  for (int64_t g = 0; g < G; ++g) {
    __m512 qv[DV];
    for (int d = 0; d < DV; ++d) qv[d] = _mm512_loadu_ps(q + g * HD + 16 * d);
    float* sg = s + g * Lp;
    int64_t t = 0;
    for (; t + 16 <= L; t += 16) {
      __m512 a[16];
      for (int j = 0; j < 16; ++j) {
        const T* kr = k + (t0 + t + j) * rs;
        __m512 x = _mm512_mul_ps(qv[0], load16(kr));
        for (int d = 1; d < DV; ++d) x = _mm512_fmadd_ps(qv[d], load16(kr + 16 * d), x);
        a[j] = x;
      }
      _mm512_storeu_ps(sg + t, reduce16(a));
    }
    for (; t < L; ++t) {
      const T* kr = k + (t0 + t) * rs;
      __m512 x = _mm512_mul_ps(qv[0], load16(kr));
      for (int d = 1; d < DV; ++d) x = _mm512_fmadd_ps(qv[d], load16(kr + 16 * d), x);
      sg[t] = _mm512_reduce_add_ps(x);
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (t = 0; t < L; ++t) mx = std::max(mx, sg[t]);
    for (; t < Lp; ++t) sg[t] = -std::numeric_limits<float>::infinity();
    Vec sum(0.f);
    for (t = 0; t < Lp; t += 16) {
      Vec e = (Vec::loadu(sg + t) - Vec(mx)).exp_u20();
      e.store(sg + t);
      sum = sum + e;
    }
    m[g] = mx;
    l[g] = _mm512_reduce_add_ps(sum);
  }
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gn = std::min<int64_t>(4, G - g0);
    __m512 o[4][DV];
    for (int gi = 0; gi < 4; ++gi) for (int d = 0; d < DV; ++d) o[gi][d] = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; ++t) {
      const T* vr = v + (t0 + t) * rs;
      __m512 vv[DV];
      for (int d = 0; d < DV; ++d) vv[d] = load16(vr + 16 * d);
      for (int gi = 0; gi < 4; ++gi) {
        if (gi >= gn) break;
        __m512 p = _mm512_set1_ps(s[(g0 + gi) * Lp + t]);
        for (int d = 0; d < DV; ++d) o[gi][d] = _mm512_fmadd_ps(p, vv[d], o[gi][d]);
      }
    }
    for (int gi = 0; gi < gn; ++gi) for (int d = 0; d < DV; ++d) _mm512_storeu_ps(acc + (g0 + gi) * HD + 16 * d, o[gi][d]);
  }
}

template <typename T, int DV>
static torch::Tensor run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t n,
                         double scale, int64_t splits) {
  constexpr int HD = DV * 16;
  const int64_t H = q.numel() / HD, KVH = k.size(0), G = H / KVH;
  auto qf = (q.reshape({H, HD}).to(torch::kFloat32) * scale).contiguous();
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
  auto out = torch::empty({H, 1, HD}, torch::kFloat32);
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
  return q.scalar_type() == torch::kFloat32 ? out : out.to(q.scalar_type());
}

template <typename T>
static torch::Tensor dispatch_hd(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t n, double scale, int64_t splits) {
  switch (k.size(2)) {
    case 16: return run<T, 1>(q, k, v, n, scale, splits);
    case 32: return run<T, 2>(q, k, v, n, scale, splits);
    case 64: return run<T, 4>(q, k, v, n, scale, splits);
    case 128: return run<T, 8>(q, k, v, n, scale, splits);
    default: TORCH_CHECK(false, "head_dim must be 16, 32, 64 or 128");
  }
}

// q [H, 1, hd] (any float dtype), k and v [KVH, capacity, hd] views with contiguous rows holding
// keys 0..n-1, scale, key slices per head (work items: KVH x splits).  Returns [H, 1, hd] in q's dtype.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t n, double scale, int64_t splits) {
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.strides() == v.strides(), "K/V rows must be contiguous");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(), "k and v must both be [kv_heads, capacity, head_dim]");
  TORCH_CHECK(n >= 1 && n <= k.size(1), "n must be in [1, capacity]");
  TORCH_CHECK(q.numel() % k.size(2) == 0 && (q.numel() / k.size(2)) % k.size(0) == 0,
              "q must hold a multiple of kv_heads query heads of head_dim");
  TORCH_CHECK(splits >= 1 && splits <= 64, "splits must be in [1, 64]");
  if (k.scalar_type() == torch::kFloat32) return dispatch_hd<float>(q, k, v, n, scale, splits);
  TORCH_CHECK(k.scalar_type() == torch::kBFloat16, "float32 or bfloat16 caches");
  return dispatch_hd<at::BFloat16>(q, k, v, n, scale, splits);
}
