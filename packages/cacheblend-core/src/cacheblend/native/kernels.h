// What the kernel sources and the bindings share: the kernels' signatures and the ATen
// headers they need.  Why not <torch/extension.h>: it brings PyTorch's whole C++ frontend and
// pybind11, which took 25 s of each source's 28 s to compile on 2 cores; these headers take
// about 5 s, so a first build takes about a third of the time.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <vector>

at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, int64_t n, double scale, int64_t splits);
at::Tensor positional_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor q_pos, double scale,
                                int64_t window);
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin);
void rope_into(at::Tensor out, at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor silu_mul(at::Tensor gate, at::Tensor up);
void reposition(at::Tensor out_k, at::Tensor out_v, std::vector<int64_t> starts, std::vector<at::Tensor> ks,
                std::vector<at::Tensor> vs, std::vector<c10::optional<at::Tensor>> dks,
                std::vector<c10::optional<at::Tensor>> dvs, at::Tensor cos, at::Tensor sin);
