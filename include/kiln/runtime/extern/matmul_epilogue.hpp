// What a GEMM step applies to its product before storing it (cuBLASLt's epilogues, and the same
// set on kiln's own GEMM template, dot_matmul.hpp).
#pragma once

namespace kiln::runtime {

// What cuBLASLt applies to the product before storing it. bias adds a vector of N (one value per
// output column, broadcast over rows and batches). cuBLASLt's GELU is the tanh approximation, so
// only k::gelu(x, k::approximate::tanh) may be fused into gelu_tanh*; exact gelu may not. The *_aux
// forms also store the pre-activation (product + bias) in a second buffer, for readers such as
// gelu's backward (GELU_AUX).
// dgelu_tanh: out = (a @ b) * gelu_tanh'(aux), aux the pre-activation a gelu_tanh_aux step stored;
// dgelu_tanh_bgrad: the same, and out's column sums written into the bias (a bias's gradient).
enum class Epilogue {
  none,
  bias,
  relu,
  relu_bias,
  gelu_tanh,
  gelu_tanh_bias,
  gelu_tanh_aux,
  gelu_tanh_aux_bias,
  dgelu_tanh,
  dgelu_tanh_bgrad
};

constexpr bool epilogue_has_bias(Epilogue e) {
  return e == Epilogue::bias || e == Epilogue::relu_bias || e == Epilogue::gelu_tanh_bias ||
         e == Epilogue::gelu_tanh_aux_bias;
}
constexpr bool epilogue_has_aux(Epilogue e) {  // (written by the *_aux epilogues, read by dgelu)
  return e == Epilogue::gelu_tanh_aux || e == Epilogue::gelu_tanh_aux_bias || e == Epilogue::dgelu_tanh ||
         e == Epilogue::dgelu_tanh_bgrad;
}
constexpr bool epilogue_writes_bias(Epilogue e) { return e == Epilogue::dgelu_tanh_bgrad; }

}  // namespace kiln::runtime
