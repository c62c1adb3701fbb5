// Prefill attention by position: query rows at sorted positions q_pos, query i sees keys
// 0..q_pos[i] (with a sliding window w, only keys > q_pos[i] - w).  Full prefill is the
// case q_pos = 0..n-1; a blend's recomputed rows are scattered through the prompt.
//
// Why a kernel of our own: PyTorch's causal kernel only takes contiguous positions, so a
// blend's scattered rows went through buckets with masks and log-sum-exp merges
// (blend/attention.py), about a quarter slower per query-key pair than this kernel.
//
// A work item is one KV head and QB consecutive query positions, with the grouped query
// heads folded into its rows.  It walks the visible keys in blocks of KB, and each block 8
// rows at a time: scores through an 8-row x 32-key register tile over K transposed per
// block (the rows' maxima taken from the registers), masking only where a block crosses a
// row's position, an online softmax per row, then the output through a 4-row x head_dim
// register tile over V.  The 8 rows' scores (16 KB) stay in L1 from the product to the
// softmax to the product with V; a whole item's (96 rows, 192 KB) did not, and cost a tenth
// more time.  Items go to threads by their cost (rows x keys), largest first.  float32,
// AVX-512 or AVX2 (simd.h: on AVX2's 16 registers the tiles are 4 rows x 16 keys and 1-4 rows
// x head_dim); cacheblend/native builds it (with -ffp-contract=off: the bits do not depend on
// where the compiler would fuse a product into a sum).
#include "kernels.h"
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#include "simd.h"

using Vec = at::vec::Vectorized<float>;
using simd::R;
using simd::W;
constexpr int KB = 512;  // keys per block: fewer blocks, fewer per-row softmax updates (64: 14 % slower)
constexpr int QB = 32;   // query positions per work item (rows: groups x QB)
static const float NEG = -std::numeric_limits<float>::infinity();

// S[r][c] = sum_d Qs[r][d] * Kt[d][k0 + c] for 8 rows r (S has rows of KB); mx[r]: the rows' maxima.
// SR rows x 2 registers of keys are accumulated at once: all 8 rows on AVX-512, 4 on AVX2.
constexpr int SR = simd::kWide ? 8 : 4;
template <int HD>
static inline void scores8(const float* Qs, const float* Kb, int width, float* S, float* mx) {
  R m[8];
  for (int r = 0; r < 8; ++r) m[r] = simd::set1(NEG);
  for (int r0 = 0; r0 < 8; r0 += SR)
    for (int c0 = 0; c0 < width; c0 += 2 * W) {
      R acc[SR][2];
      for (int r = 0; r < SR; ++r) { acc[r][0] = simd::zero(); acc[r][1] = simd::zero(); }
      const float* kp = Kb + c0;
      for (int d = 0; d < HD; ++d) {
        R k0v = simd::load(kp + d * KB), k1v = simd::load(kp + d * KB + W);
        for (int r = 0; r < SR; ++r) {
          R qb = simd::set1(Qs[(r0 + r) * HD + d]);
          acc[r][0] = simd::fmadd(qb, k0v, acc[r][0]);
          acc[r][1] = simd::fmadd(qb, k1v, acc[r][1]);
        }
      }
      for (int r = 0; r < SR; ++r) {
        simd::store(S + (r0 + r) * KB + c0, acc[r][0]);
        simd::store(S + (r0 + r) * KB + c0 + W, acc[r][1]);
        m[r0 + r] = simd::max(m[r0 + r], simd::max(acc[r][0], acc[r][1]));
      }
    }
  for (int r = 0; r < 8; ++r) mx[r] = simd::reduce_max(m[r]);
}

// O[r][:] += sum_c P[r][c] * V[c][:], c in [0, kn).  AR rows' outputs (AR x head_dim) stay in
// registers: 4 rows on AVX-512; on AVX2 as many of 4, 2, 1 as leave room for a row of V.
template <int HD>
static inline void accumulate(const float* P, const float* V, int64_t ldv, int kn, int R_, float* O) {
  constexpr int DV = HD / W;
  constexpr int AR = simd::kWide || DV <= 2 ? 4 : DV <= 4 ? 2 : 1;
  for (int r0 = 0; r0 < R_; r0 += AR) {
    R o[AR][DV];
    for (int r = 0; r < AR; ++r) for (int d = 0; d < DV; ++d) o[r][d] = simd::load(O + (r0 + r) * HD + W * d);
    for (int c = 0; c < kn; ++c) {
      R vv[DV];
      for (int d = 0; d < DV; ++d) vv[d] = simd::load(V + c * ldv + W * d);
      for (int r = 0; r < AR; ++r) {
        R p = simd::set1(P[(r0 + r) * KB + c]);
        for (int d = 0; d < DV; ++d) o[r][d] = simd::fmadd(p, vv[d], o[r][d]);
      }
    }
    for (int r = 0; r < AR; ++r) for (int d = 0; d < DV; ++d) simd::store(O + (r0 + r) * HD + W * d, o[r][d]);
  }
}

struct Scratch {
  std::vector<float> Qs, O, S, m, l;
  std::vector<int64_t> rp, lo, hi;  // per row its position; per 8-row tile its first and last
  Scratch(int R, int HD) : Qs(R * HD), O(R * HD), S(8 * KB), m(R), l(R), rp(R), lo(R / 8), hi(R / 8) {}
};

template <int HD>
static void item(const float* q, int64_t qhs, int64_t qrs, const float* Kt, const float* V, int64_t ldv,
                 const int64_t* pos, int64_t i0, int64_t i1, int G, double scale, int64_t window, float* out,
                 int64_t ohs, int64_t ors, int h, Scratch& w) {
  const int n = i1 - i0;
  const int R = ((G * n) + 7) / 8 * 8;
  float* Qs_ = w.Qs.data();
  float* O_ = w.O.data();
  std::fill(Qs_, Qs_ + R * HD, 0.f); std::fill(O_, O_ + R * HD, 0.f);
  std::fill(w.m.begin(), w.m.begin() + R, NEG); std::fill(w.l.begin(), w.l.begin() + R, 0.f);
  std::fill(w.rp.begin(), w.rp.begin() + R, pos[i1 - 1]);
  float* S_ = w.S.data();
  float* m = w.m.data(); float* l = w.l.data(); int64_t* rp = w.rp.data();
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < n; ++i) {
      const float* src = q + (h * G + g) * qhs + (i0 + i) * qrs;
      float* dst = Qs_ + (g * n + i) * HD;
      for (int d = 0; d < HD; ++d) dst[d] = src[d] * (float)scale;
      rp[g * n + i] = pos[i0 + i];
    }
  // each 8-row tile's first and last position (padding rows left out): a tile walks the
  // keys up to its own last position, not the item's, so a blend's scattered rows cost
  // about what their positions ask (skipped keys would only add exact zeros)
  const int valid = G * n;
  for (int r0 = 0; r0 < R; r0 += 8) {
    int64_t lo = rp[r0], hi = rp[r0];
    for (int j = 1; j < 8 && r0 + j < valid; ++j) { lo = std::min(lo, rp[r0 + j]); hi = std::max(hi, rp[r0 + j]); }
    w.lo[r0 / 8] = lo; w.hi[r0 / 8] = hi;
  }
  const int64_t pmin = pos[i0], pmax = pos[i1 - 1];
  const int64_t kstart = window > 0 ? std::max<int64_t>(0, pmin - window + 1) / KB * KB : 0;
  const int64_t kend = pmax + 1;
  for (int64_t k0 = kstart; k0 < kend; k0 += KB) {
    const float* Kb = Kt + (k0 / KB) * HD * KB;
    for (int r0 = 0; r0 < R; r0 += 8) {
      const int64_t tlo = w.lo[r0 / 8], thi = w.hi[r0 / 8];
      if (thi < k0) continue;  // every row of the tile ends before this block
      const int kn = (int)std::min<int64_t>(KB, thi + 1 - k0);
      const int width = (kn + 31) / 32 * 32;
      const bool masked = k0 + kn - 1 > tlo || (window > 0 && k0 <= thi - window);
      float bmx[8];
      scores8<HD>(Qs_ + r0 * HD, Kb, width, S_, bmx);
      for (int j = 0; j < 8; ++j) {
        const int r = r0 + j;
        float* s = S_ + j * KB;
        float bm = bmx[j];
        if (masked || kn < width) {
          const int64_t p = rp[r];
          const int64_t hi = std::min<int64_t>(kn, std::max<int64_t>(0, p - k0 + 1));
          std::fill(s + hi, s + width, NEG);
          if (window > 0) {
            const int64_t lo = std::min<int64_t>(hi, std::max<int64_t>(0, p - window + 1 - k0));
            std::fill(s, s + lo, NEG);
          }
          Vec mv(NEG);
          for (int c = 0; c < width; c += W) mv = at::vec::maximum(mv, Vec::loadu(s + c));
          bm = simd::reduce_max(mv);
        }
        const float mnew = std::max(m[r], bm);
        if (mnew == NEG) { for (int c = 0; c < width; ++c) s[c] = 0.f; continue; }
        const float alpha = std::exp(m[r] - mnew);
        Vec sum(0.f);
        for (int c = 0; c < width; c += W) {
          Vec e = (Vec::loadu(s + c) - Vec(mnew)).exp_u20();
          e.store(s + c);
          sum = sum + e;
        }
        l[r] = l[r] * alpha + simd::reduce_add(sum);
        if (alpha != 1.f) {
          float* o = O_ + r * HD;
          for (int d = 0; d < HD; d += W) (Vec::loadu(o + d) * Vec(alpha)).store(o + d);
        }
        m[r] = mnew;
      }
      accumulate<HD>(S_, V + k0 * ldv, ldv, kn, 8, O_ + r0 * HD);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < n; ++i) {
      const float* o = O_ + (g * n + i) * HD;
      const float inv = 1.f / l[g * n + i];
      float* dst = out + (h * G + g) * ohs + (i0 + i) * ors;
      for (int d = 0; d < HD; ++d) dst[d] = o[d] * inv;
    }
}

// Kt[h][b][d][c] = k[h][b * KB + c][d], zero past the N keys; one (head, block) per task.
// W keys at a time: each of the HD columns is one gather of the W rows and one full
// register's store (element by element, the stores strided by a block row cost about 1 ms
// a call on a 3.7K-token prompt, a blend's whole attention at 5 % being 6 ms)
template <int HD>
static void transpose_keys(const at::Tensor& k, int64_t N, at::Tensor& Kt) {
  const int64_t KVH = k.size(0), nb = Kt.size(1), s0 = k.stride(0), s1 = k.stride(1);
  const float* kp = k.data_ptr<float>();
  float* tp = Kt.data_ptr<float>();
  const simd::I rows = simd::strided(s1);
  at::parallel_for(0, KVH * nb, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t h = t / nb, blk = t % nb, c_end = std::min<int64_t>(KB, N - blk * KB);
      float* dst = tp + t * HD * KB;
      const float* src = kp + h * s0 + blk * KB * s1;
      int64_t c = 0;
      for (; c + W <= c_end; c += W)
        for (int d = 0; d < HD; ++d) simd::store(dst + d * KB + c, simd::gather(src + c * s1 + d, rows));
      for (; c < c_end; ++c)
        for (int d = 0; d < HD; ++d) dst[d * KB + c] = src[c * s1 + d];
      if (c_end < KB)
        for (int d = 0; d < HD; ++d) std::fill(dst + d * KB + c_end, dst + (d + 1) * KB, 0.f);
    }
  });
}

template <int HD>
static at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos,
                         double scale, int64_t window) {
  const int64_t H = q.size(0), M = q.size(1), KVH = k.size(0);
  const int G = H / KVH;
  const int64_t N = pos[M - 1].item<int64_t>() + 1;
  const int64_t nb = (N + KB - 1) / KB, ldk = nb * HD * KB;
  // K transposed in blocks of KB keys: [KVH][block][HD][KB], each block one contiguous 16 KB
  auto Kt = at::empty({KVH, nb, HD, KB}, at::kFloat);
  transpose_keys<HD>(k, N, Kt);
  // the output in [M, H, HD] memory, returned as its [H, M, HD] view: the caller's next step
  // (the output projection) reads it as [M, H * HD] rows without a copy
  auto out = at::empty({M, H, HD}, at::kFloat);
  const int64_t* pp = pos.data_ptr<int64_t>();
  // items: (head, block), cost ~ the keys its rows see; greedy to the least loaded thread
  struct It { int h; int64_t i0, i1; double cost; };
  std::vector<It> items;
  for (int h = 0; h < KVH; ++h)
    for (int64_t i0 = 0; i0 < M; i0 += QB) {
      int64_t i1 = std::min<int64_t>(M, i0 + QB);
      int64_t ks = window > 0 ? std::max<int64_t>(0, pp[i0] - window + 1) : 0;
      double cost = 0;  // the keys its rows see
      for (int64_t i = i0; i < i1; ++i) cost += double(pp[i] + 1 - ks);
      items.push_back({h, i0, i1, cost});
    }
  std::sort(items.begin(), items.end(), [](const It& a, const It& b) { return a.cost > b.cost; });
  const int T = at::get_num_threads();
  std::vector<std::vector<int>> mine(T);
  std::vector<double> load(T, 0.0);
  for (int j = 0; j < (int)items.size(); ++j) {
    int t = std::min_element(load.begin(), load.end()) - load.begin();
    mine[t].push_back(j);
    load[t] += items[j].cost;
  }
  const float* qp = q.data_ptr<float>();
  const float* ktp = Kt.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t b, int64_t e) {
    Scratch w((G * QB + 7) / 8 * 8, HD);
    for (int64_t t = b; t < e; ++t)
      for (int j : mine[t]) {
        const It& it = items[j];
        item<HD>(qp, q.stride(0), q.stride(1), ktp + it.h * ldk, vp + it.h * v.stride(0), v.stride(1),
                 pp, it.i0, it.i1, G, scale, window, op, HD, H * HD, it.h, w);
      }
  });
  return out.transpose(0, 1);
}

// q [H, M, hd] float32 (rows contiguous), k and v [KVH, >=N, hd] (rows contiguous), q_pos [M] int64 sorted:
// query i sees keys 0..q_pos[i] (and, with a window w > 0, only keys > q_pos[i] - w).
at::Tensor positional_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor q_pos, double scale,
                                   int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "rows must be contiguous");
  TORCH_CHECK(q_pos.scalar_type() == at::kLong && q_pos.is_contiguous(), "q_pos must be contiguous int64");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && q.size(2) == k.size(2),
              "q must be [heads, rows, head_dim], k and v [kv_heads, keys, head_dim]");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && q_pos.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(k.size(0) >= 1 && k.size(2) >= 1, "k and v need at least one head of head_dim >= 1");
  TORCH_CHECK(q.size(0) % k.size(0) == 0, "query heads must be a multiple of kv_heads");
  TORCH_CHECK(q_pos.dim() == 1 && q_pos.size(0) == q.size(1) && q.size(1) >= 1, "q_pos must hold one position per query row");
  const int64_t* p = q_pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < q_pos.size(0); ++i)
    TORCH_CHECK(p[i] >= 0 && (i == 0 || p[i] >= p[i - 1]), "q_pos must be sorted and non-negative");
  TORCH_CHECK(p[q_pos.size(0) - 1] < k.size(1), "q_pos reaches past the keys");
  switch (k.size(2)) {
    case 16: return run<16>(q, k, v, q_pos, scale, window);
    case 32: return run<32>(q, k, v, q_pos, scale, window);
    case 64: return run<64>(q, k, v, q_pos, scale, window);
    case 128: return run<128>(q, k, v, q_pos, scale, window);
    default: TORCH_CHECK(false, "head_dim must be 16, 32, 64 or 128");
  }
}

