// The Python bindings of the CPU kernels (one extension module, built from every .cpp file in this folder).
#include <torch/python.h>  // pybind11 and the tensor casters, not all of torch/extension.h (a faster build)

#include <vector>

std::vector<torch::Tensor> scan_forward(torch::Tensor u, torch::Tensor Mt, torch::Tensor W1, torch::Tensor keep,
                                        torch::Tensor p0, int64_t chunk, int64_t offset, torch::Tensor restart,
                                        torch::Tensor p_start, double safe_min, double safe_max);
std::vector<torch::Tensor> scan_backward(torch::Tensor dG, torch::Tensor u, torch::Tensor S, torch::Tensor P,
                                         torch::Tensor p0, torch::Tensor p_start, torch::Tensor MtT,
                                         torch::Tensor keep, torch::Tensor restart);
std::vector<torch::Tensor> cp_step(torch::Tensor u, torch::Tensor h, torch::Tensor W1, torch::Tensor W2,
                                   torch::Tensor keep, torch::Tensor restart, torch::Tensor h_start, bool boundary,
                                   bool guard, double safe_min, double safe_max);
std::vector<torch::Tensor> delta_rule_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                                           torch::Tensor beta, torch::Tensor S, torch::Tensor c, torch::Tensor keep,
                                           torch::Tensor restart, bool boundary);
torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor W);
torch::Tensor swiglu_forward(torch::Tensor gate_up);
torch::Tensor swiglu_backward(torch::Tensor gate_up, torch::Tensor dh);
std::vector<torch::Tensor> rms_norm_forward(torch::Tensor x, torch::Tensor weight, double eps, double floor);
std::vector<torch::Tensor> rms_norm_backward(torch::Tensor dy, torch::Tensor x, torch::Tensor weight,
                                             torch::Tensor rstd, double floor);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  m.def("scan_forward", &scan_forward, arg("u"), arg("Mt"), arg("W1"), arg("keep"), arg("p0"), arg("chunk"),
        arg("offset"), arg("restart"), arg("p_start"), arg("safe_min"), arg("safe_max"));
  m.def("scan_backward", &scan_backward, arg("dG"), arg("u"), arg("S"), arg("P"), arg("p0"), arg("p_start"),
        arg("MtT"), arg("keep"), arg("restart"));
  m.def("cp_step", &cp_step, arg("u"), arg("h"), arg("W1"), arg("W2"), arg("keep"), arg("restart"), arg("h_start"),
        arg("boundary"), arg("guard"), arg("safe_min"), arg("safe_max"));
  m.def("delta_rule_step", &delta_rule_step, arg("q"), arg("k"), arg("v"), arg("g"), arg("beta"), arg("S"), arg("c"),
        arg("keep"), arg("restart"), arg("boundary"));
  m.def("small_batch_linear", &small_batch_linear, arg("x"), arg("W"));
  m.def("swiglu_forward", &swiglu_forward, arg("gate_up"));
  m.def("swiglu_backward", &swiglu_backward, arg("gate_up"), arg("dh"));
  m.def("rms_norm_forward", &rms_norm_forward, arg("x"), arg("weight"), arg("eps"), arg("floor"));
  m.def("rms_norm_backward", &rms_norm_backward, arg("dy"), arg("x"), arg("weight"), arg("rstd"), arg("floor"));
}
