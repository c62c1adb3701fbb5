// The elementwise parts of a layer in float32, each one pass over its rows where PyTorch's
// CPU ops make several (and allocate a temporary per op):
//
// * RMSNorm: PyTorch's CPU rms_norm is a composite of six ops (square, mean, add, rsqrt, two
//   products); here one pass to sum the squares and one to scale.  The sum is taken in
//   another order than PyTorch's reduction, so the last bit can differ.
// * RoPE: x * cos + rotate_half(x) * sin is a negation, a concatenation, two products and a
//   sum in PyTorch; here the same products and sum per element (the build has
//   -ffp-contract=off, so no product is fused into the sum): the same bits as
//   models/kernels.apply_rope, which the chunk caches' re-positioning also computes.
// * SiLU gate times up: the same expression as PyTorch's SiLU kernel (x / (1 + exp(-x)) with
//   the same vectorized exp), then the product: the same bits, without the gate's temporary.
//
// Rows are independent: a row's result does not depend on which other rows share the call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>

using Vec = at::vec::Vectorized<float>;
constexpr int64_t L = Vec::size();

static void check_rows(const torch::Tensor& x, int dims, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(x.dim() == dims, name, " must have ", dims, " dimensions");
  TORCH_CHECK(x.stride(dims - 1) == 1, name, "'s rows must be contiguous");
}

// x [n, d] (rows contiguous), w [d] -> [n, d]: x * rsqrt(mean(x^2) + eps) * w, in that order
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, 2, "x");
  const int64_t n = x.size(0), d = x.size(1), ldx = x.stride(0);
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.dim() == 1 && w.size(0) == d && w.is_contiguous(),
              "the norm's weight must be float32 [", d, "]");
  auto out = torch::empty({n, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* xr = xp + i * ldx;
      float* o = op + i * d;
      Vec acc(0.f);
      int64_t j = 0;
      for (; j + L <= d; j += L) { Vec v = Vec::loadu(xr + j); acc = at::vec::fmadd(v, v, acc); }
      if (j < d) { Vec v = Vec::loadu(xr + j, d - j); acc = at::vec::fmadd(v, v, acc); }
      const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / float(d) + float(eps));
      const Vec rv(r);
      for (j = 0; j + L <= d; j += L) ((Vec::loadu(xr + j) * rv) * Vec::loadu(wp + j)).store(o + j);
      if (j < d) ((Vec::loadu(xr + j, d - j) * rv) * Vec::loadu(wp + j, d - j)).store(o + j, d - j);
    }
  });
  return out;
}

// out = x * cos + rotate_half(x) * sin, x and out [heads, n, hd] (last dimension contiguous,
// any other strides), cos and sin [n, hd] (rows contiguous)
static void rope_rows(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& out) {
  check_rows(x, 3, "x");
  check_rows(cos, 2, "cos");
  check_rows(sin, 2, "sin");
  check_rows(out, 3, "out");
  const int64_t H = x.size(0), n = x.size(1), hd = x.size(2), half = hd / 2;
  TORCH_CHECK(hd % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.size(0) == n && cos.size(1) == hd && sin.sizes() == cos.sizes(),
              "cos and sin must be [", n, ", ", hd, "]");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must have x's shape");
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), o0 = out.stride(0), o1 = out.stride(1);
  const int64_t ldc = cos.stride(0), lds = sin.stride(0);
  at::parallel_for(0, H * n, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t h = r / n, i = r % n;
      const float* xr = xp + h * s0 + i * s1;
      const float* c = cp + i * ldc;
      const float* s = sp + i * lds;
      float* o = op + h * o0 + i * o1;
      for (int64_t j = 0; j < half; j += L) {  // first half: x * cos + (-x[j + half]) * sin
        const int64_t m = std::min(L, half - j);
        Vec lo = Vec::loadu(xr + j, m), hi = Vec::loadu(xr + half + j, m);
        (lo * Vec::loadu(c + j, m) + hi.neg() * Vec::loadu(s + j, m)).store(o + j, m);
        (hi * Vec::loadu(c + half + j, m) + lo * Vec::loadu(s + half + j, m)).store(o + half + j, m);
      }
    }
  });
}

// x [heads, n, hd] -> x rotated, [heads, n, hd] contiguous
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  auto out = torch::empty(x.sizes(), x.options());
  rope_rows(x, cos, sin, out);
  return out;
}

// x rotated into out (a slice of the fused cache: re-positioning a chunk's keys); out must not overlap x
void rope_into(torch::Tensor out, torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  rope_rows(x, cos, sin, out);
}

// silu(gate) * up, gate and up [n, I] (rows contiguous, any row strides: the two halves of
// one packed product, or two products of transformers' modules) -> [n, I]
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  check_rows(gate, 2, "gate");
  check_rows(up, 2, "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up must have one shape");
  const int64_t n = gate.size(0), I = gate.size(1), ldg = gate.stride(0), ldu = up.stride(0);
  auto out = torch::empty({n, I}, gate.options());
  const float* gp = gate.data_ptr<float>();
  const float* up_ = up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const Vec one(1.f);
  at::parallel_for(0, n, 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* g = gp + i * ldg;
      const float* u = up_ + i * ldu;
      float* o = op + i * I;
      for (int64_t j = 0; j < I; j += L) {
        const int64_t m = std::min(L, I - j);
        Vec x = Vec::loadu(g + j, m);
        ((x / (one + x.neg().exp())) * Vec::loadu(u + j, m)).store(o + j, m);
      }
    }
  });
  return out;
}
