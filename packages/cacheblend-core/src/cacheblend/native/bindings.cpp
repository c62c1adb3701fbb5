// The module cacheblend/native/__init__.py builds: the attention kernels and the layer pieces,
// each called without the GIL.  PyTorch's pybind11 header (its Tensor type casters), not
// <torch/extension.h>, which compiles five times slower (kernels.h says why that matters).
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, py::call_guard<py::gil_scoped_release>());
  m.def("positional_attention", &positional_attention, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("rope", &rope, py::call_guard<py::gil_scoped_release>());
  m.def("rope_into", &rope_into, py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, py::call_guard<py::gil_scoped_release>());
  m.def("reposition", &reposition, py::call_guard<py::gil_scoped_release>());
}
