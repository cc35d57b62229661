// A scheduled matmul step with the epilogue that schedule/epilogue.hpp chose for it: the cuBLASLt
// epilogue that computes it, the call, and the line that k::explain and KILN_PROFILE print for it.
#pragma once
#include <string>
#include <vector>

#include "../../ir/shape_env.hpp"
#include "../../schedule/fuse.hpp"
#include "cuda_matmul.hpp"

namespace kiln::runtime {

// cuBLASLt's epilogue for a scheduled one: by activation, then with a bias, then keeping pre.
inline Epilogue cuda_epilogue(const schedule::MatmulEpilogue& e) {
  using A = schedule::Activation;
  if (e.act == A::dgelu_tanh) return e.bias_grad() >= 0 ? Epilogue::dgelu_tanh_bgrad : Epilogue::dgelu_tanh;
  constexpr Epilogue plain[3][2] = {{Epilogue::none, Epilogue::bias},
                                    {Epilogue::relu, Epilogue::relu_bias},
                                    {Epilogue::gelu_tanh, Epilogue::gelu_tanh_bias}};
  const int with_bias = e.bias >= 0;
  if (e.aux) {
    if (e.act != A::gelu_tanh)
      throw error("matmul: only gelu keeps its pre-activation in a cuBLASLt epilogue, not " +
                  std::string(schedule::activation_name(e.act)));
    return with_bias ? Epilogue::gelu_tanh_aux_bias : Epilogue::gelu_tanh_aux;
  }
  return plain[static_cast<int>(e.act)][with_bias];
}

// Runs matmul step `e` on CUDA: out = act(a @ b + bias), pre stored too when e.aux; a dgelu step
// reads the kept pre-activation aux_in and writes bias_grad. `buffer(node)` gives a node's tensor this call.
template <class Buffer>
void run_matmul_step(const schedule::MatmulEpilogue& e, const Tensor& a, const Tensor& b, Buffer&& buffer,
                     CUstream stream, bool autotune) {
  const Tensor* bias = e.bias >= 0 ? &buffer(e.bias) : e.bias_grad() >= 0 ? &buffer(e.bias_grad()) : nullptr;
  const Tensor* aux = e.aux ? &buffer(e.pre) : e.aux_in >= 0 ? &buffer(e.aux_in) : nullptr;
  cuda_matmul_epilogue(a, b, bias, cuda_epilogue(e), buffer(e.out), stream, autotune, aux);
}

// "extern matmul [8192, 768] x [768, 3072] + bias + gelu_tanh (cuBLASLt epilogue)": what a matmul
// step computes, its operands' sizes as the program knows them (symbols where dynamic).
inline std::string describe_matmul_step(const graph::Graph& g, const ir::ShapeEnv& env, int matmul,
                                        const schedule::MatmulEpilogue* e) {
  auto dims = [&](int node) {
    std::string s = "[";
    for (const auto& d : env[node]) s += (s.size() > 1 ? ", " : "") + d.str();
    return s + "]";
  };
  std::string s = "extern matmul " + dims(g[matmul].in[0]) + " x " + dims(g[matmul].in[1]);
  if (!e) return s;
  if (e->bias >= 0) s += " + bias";
  if (e->act == schedule::Activation::dgelu_tanh)
    s += " * gelu_tanh'(%" + std::to_string(e->aux_in) + ")";
  else if (e->act != schedule::Activation::none)
    s += " + " + std::string(schedule::activation_name(e->act));
  if (e->aux) s += ", pre-activation kept";
  if (e->bias_grad() >= 0) s += ", its column sums into %" + std::to_string(e->bias_grad());
  return s + " (cuBLASLt epilogue)";
}

}  // namespace kiln::runtime
