// The module cacheblend/native/__init__.py builds: the attention kernels and the layer pieces,
// each called without the GIL.
#include <torch/extension.h>

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t n, double scale,
                               int64_t splits);
torch::Tensor positional_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor q_pos,
                                   double scale, int64_t window);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
void rope_into(torch::Tensor out, torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up);
void reposition(torch::Tensor out_k, torch::Tensor out_v, std::vector<int64_t> starts, std::vector<torch::Tensor> ks,
                std::vector<torch::Tensor> vs, std::vector<c10::optional<torch::Tensor>> dks,
                std::vector<c10::optional<torch::Tensor>> dvs, torch::Tensor cos, torch::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, py::call_guard<py::gil_scoped_release>());
  m.def("positional_attention", &positional_attention, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("rope", &rope, py::call_guard<py::gil_scoped_release>());
  m.def("rope_into", &rope_into, py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, py::call_guard<py::gil_scoped_release>());
  m.def("reposition", &reposition, py::call_guard<py::gil_scoped_release>());
}
