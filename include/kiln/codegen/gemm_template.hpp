// The GEMM template: a block program written on the prelude's `dot` (prelude_dot.hpp) that computes
// out = epilogue(a @ b) for a [B, M, K] and b [B, K, N] of any strides, with the epilogues cuBLASLt
// applies (schedule/epilogue.hpp: a bias of N, relu or tanh-gelu, the pre-activation kept beside
// the output, or the product times gelu' of a kept pre-activation). One source for both targets:
// on the GPU, tensor cores (runtime/extern/dot_matmul.hpp times it against cuBLASLt under
// autotuning); on the CPU, the same program over loops (its entry: runtime's cpu_trampoline).
//
// A kernel reads like this (bf16, bias and relu, A K-contiguous, B N-contiguous):
//   KILN_KERNEL KILN_BOUNDS(DOT_THREADS) kiln_mm_bf16_bias_relu_kn_...(const bf16* a, const bf16* b,
//       const bf16* bias, bf16* out, i64 M, i64 N, i64 K, i64 sa_b, ...) {
//     KILN_DOT_PROGRAM(bz, m0, n0);
//     kiln::dot_acc acc(m0, n0);
//     kiln::dot_k_loop(acc, KILN_DOT_SHARED, a + bz * sa_b, sa_m, sa_k, b + bz * sb_b, sb_k, sb_n, M, N, K);
//     KILN_DOT_ELEMENTS(acc, m, n, x) {
//       const float pre = x + kiln::to_compute(bias[n]);
//       out[bz * so_b + m * so_m + n * so_n] = kiln::store_cast<bf16>(kiln::relu(pre));
//     }
//   }
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "../core/dtype.hpp"
#include "../schedule/epilogue.hpp"
#include "c_text.hpp"
#include "kernel_writer.hpp"
#include "prelude.hpp"
#include "prelude_dot.hpp"
#include "prelude_mma.hpp"
#include "prelude_tma.hpp"

namespace kiln::codegen {

// One GEMM kernel: its types, epilogue, how its operands' tiles lie, and its blocking.
struct GemmKernel {
  kiln::dtype dt = kiln::dtype::bf16;      // a's and b's type (bf16, f16, f32)
  kiln::dtype out_dt = kiln::dtype::bf16;  // what the kernel stores (dt, or f32); the bias and aux are in it too
  schedule::Activation act = schedule::Activation::none;
  bool bias = false;  // + a vector of N before the activation
  bool aux = false;   // the pre-activation stored into aux too (gelu_tanh); dgelu_tanh reads it
  bool a_k = true;    // a's tiles K-contiguous (a's stride along K is 1), else M-contiguous
  bool b_k = false;   // b's tiles K-contiguous (b [K, N] with stride 1 along K), else N-contiguous
  bool async = true;  // stride 1 along the contiguous dims and rows on 16 bytes: cp.async copies
  bool tf32 = false;  // f32 on tensor cores through TF32 (KILN_ALLOW_TF32=1)
  bool wgmma = false;  // 16-bit on sm_90a by warpgroup MMA (warps_m = bm / 16, warps_n = 1)
  bool overlap = false;  // wgmma: a step's products in flight under the next step's
  bool tma = false;      // wgmma at bm 128: tiles by TMA from a producer warpgroup (async layouts; two maps)
  bool cpu = false;    // compiled by the host compiler (the CPU's program shape)
  int bm = 128, bn = 128, warps_m = 2, warps_n = 2, stages = 3;

  int threads() const { return warps_m * warps_n * 32 + (tma ? 128 : 0); }
  int bk() const { return 128 / static_cast<int>(itemsize(dt)); }
  // (the stages of A and B tiles from a 1024-byte boundary: prelude_dot.hpp's dot_k_loop; TMA: and
  // the stages' two mbarriers each)
  int shared_bytes() const {
    return cpu ? 0 : stages * (bm + bn) * bk() * static_cast<int>(itemsize(dt)) + 1024 + (tma ? 16 * stages : 0);
  }
  std::string epilogue() const {
    std::string s = bias ? "bias" : "";
    if (act != schedule::Activation::none) s += (s.empty() ? "" : "_") + std::string(schedule::activation_name(act));
    return (s.empty() ? "none" : s) + (aux ? "_aux" : "");
  }
  std::string name() const {
    const std::string out = out_dt == dt ? "" : "_out" + std::string(kiln::name(out_dt));
    return "kiln_mm_" + std::string(kiln::name(dt)) + out + "_" + epilogue() + "_" + (a_k ? "k" : "m") +
           (b_k ? "k" : "n") + (async ? "" : "_strided") + (tf32 ? "_tf32" : "") +
           (wgmma ? (tma       ? "_wgmma_tma"
                     : overlap ? "_wgmma_ov"
                               : "_wgmma")
                  : "") +
           "_" + std::to_string(bm) + "x" + std::to_string(bn) +
           (cpu ? "_cpu"
                : "_w" + std::to_string(warps_m) + "x" + std::to_string(warps_n) + "_s" + std::to_string(stages));
  }
};

namespace gemm_detail {

using detail::storage_c_type;

// The epilogue's statements for value x at (bz, m, n).
inline std::string epilogue_body(const GemmKernel& g) {
  const std::string o = storage_c_type(g.out_dt), at = "bz * so_b + m * so_m + n * so_n";
  std::string s;
  if (g.act == schedule::Activation::dgelu_tanh) {
    s += "    const float u = kiln::to_compute(aux[bz * sx_b + m * sx_m + n]);  // the kept pre-activation\n";
    s += "    const float t = kiln::tanh(0.7978845608028654f * (u + 0.044715f * u * u * u));\n";
    s += "    const float y = x * (0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * 0.7978845608028654f * "
         "(1.0f + 3.0f * 0.044715f * u * u));\n";
  } else {
    s += std::string("    const float pre = x") + (g.bias ? " + kiln::to_compute(bias[n])" : "") + ";\n";
    if (g.aux) s += "    aux[bz * sx_b + m * sx_m + n] = kiln::store_cast<" + o + ">(pre);\n";
    s += g.act == schedule::Activation::relu        ? "    const float y = kiln::relu(pre);\n"
         : g.act == schedule::Activation::gelu_tanh ? "    const float y = 0.5f * pre * (1.0f + "
                                                      "kiln::tanh(0.7978845608028654f * (pre + 0.044715f * pre * pre * "
                                                      "pre)));\n"
                                                    : "    const float y = pre;\n";
  }
  return s + "    out[" + at + "] = kiln::store_cast<" + o + ">(y);\n";
}

}  // namespace gemm_detail

// The kernel's parameters, in order: a, b, the bias (in out's type; unread without one), aux (the
// pre-activation: written by the *_aux epilogues, read by dgelu), out, then the sizes and element
// strides of a, b, out and aux (aux contiguous: sx_b = M N, sx_m = N). runtime/extern/dot_matmul.hpp
// passes them in this order, and the CPU's entry is written from them (cpu_trampoline).
inline std::vector<Param> gemm_kernel_params(const GemmKernel& g) {
  const bool reads_aux = g.act == schedule::Activation::dgelu_tanh;
  std::vector<Param> ps{{Param::in_ptr, 0, g.dt, "a"},
                        {Param::in_ptr, 1, g.dt, "b"},
                        {Param::in_ptr, 2, g.out_dt, "bias"},
                        {reads_aux ? Param::in_ptr : Param::out_ptr, 3, g.out_dt, "aux"},
                        {Param::out_ptr, 4, g.out_dt, "out"}};
  for (const char* size :
       {"M", "N", "K", "sa_b", "sa_m", "sa_k", "sb_b", "sb_k", "sb_n", "so_b", "so_m", "so_n", "sx_b", "sx_m"})
    ps.push_back({Param::size, static_cast<int>(ps.size()), kiln::dtype::i64, size});
  return ps;
}

// The kernel's translation unit: its configuration, the preludes and the program.
inline std::string gemm_kernel_source(const GemmKernel& g) {
  const std::string t = detail::storage_c_type(g.dt), name = g.name();
  std::string s;
  if (g.dt != kiln::dtype::f32 || g.out_dt != kiln::dtype::f32) s += "#define KILN_HALF 1\n";
  s += "#define DOT_T " + t + "\n#define DOT_BM " + std::to_string(g.bm) + "\n#define DOT_BN " + std::to_string(g.bn) +
       "\n#define DOT_WARPS_M " + std::to_string(g.warps_m) + "\n#define DOT_WARPS_N " + std::to_string(g.warps_n) +
       "\n#define DOT_STAGES " + std::to_string(g.stages) + "\n#define DOT_A_K " + (g.a_k ? "1" : "0") +
       "\n#define DOT_B_K " + (g.b_k ? "1" : "0") + "\n#define DOT_ASYNC " + (g.async ? "1" : "0") +
       "\n#define DOT_TF32 " + (g.tf32 ? "1" : "0") + "\n#define DOT_WGMMA " + (g.wgmma ? "1" : "0") +
       "\n#define DOT_OVERLAP " + (g.wgmma && g.overlap ? "1" : "0") + "\n#define DOT_TMA " + (g.tma ? "1" : "0") +
       "\n#define DOT_IS_16BIT " + (g.dt == kiln::dtype::f32 ? "0" : "1") + "\n#define DOT_IS_BF16 " +
       (g.dt == kiln::dtype::bf16 ? "1" : "0") + "\n";
  s += prelude;
  if (!g.cpu) s += prelude_mma;
  if (g.wgmma)
    s += "typedef unsigned long long u64;\n" + std::string(prelude_wgmma) +
         wgmma_function("kiln_wgmma_dot", g.bn, false, false, g.b_k ? 0 : 1, t, g.a_k ? 0 : 1);
  if (g.tma) s += mbarrier_functions() + tma_map_functions();
  s += prelude_dot;
  s += "\n// " +
       std::string(g.dt == kiln::dtype::f32 ? (g.tf32 ? "TF32" : "f32 FMA")
                   : g.tma                  ? "TMA and wgmma"
                   : g.wgmma                ? "wgmma"
                                            : "mma.sync") +
       " GEMM, epilogue " + g.epilogue() + "\n";
  // (TMA: one block an SM, the registers setmaxnreg moves between the warpgroups)
  s += "KILN_KERNEL " +
       std::string(g.tma   ? "__launch_bounds__(DOT_THREADS, 1)"
                   : g.cpu ? "KILN_BOUNDS()"
                           : "KILN_BOUNDS(DOT_THREADS)") +
       " " + name + "(";
  const char* comma = "";
  for (const Param& p : gemm_kernel_params(g)) {
    const std::string type = detail::storage_c_type(p.dt);
    s += comma +
         (p.kind == Param::in_ptr    ? "const " + type + "* "
          : p.kind == Param::out_ptr ? type + "* "
                                     : "i64 ") +
         p.name;
    comma = ", ";
  }
  if (g.tma) s += ", const __grid_constant__ kiln_tensor_map a_map, const __grid_constant__ kiln_tensor_map b_map";
  s += " KILN_PROGRAM_PARAMS) {\n";
  s += "  KILN_DOT_PROGRAM(bz, m0, n0);\n";
  s += "  kiln::dot_acc acc(m0, n0);\n";
  if (g.tma)
    s += "  if (!kiln::dot_k_loop_tma(acc, KILN_DOT_SHARED, a_map, b_map, sa_b ? bz : 0, sb_b ? bz : 0, M, N, K)) "
         "return;\n";
  else
    s += "  kiln::dot_k_loop(acc, KILN_DOT_SHARED, a + bz * sa_b, sa_m, sa_k, b + bz * sb_b, sb_k, sb_n, M, N, K);\n";
  s += "  KILN_DOT_ELEMENTS(acc, m, n, x) {\n" + gemm_detail::epilogue_body(g) + "  }\n}\n";
  return s;
}

}  // namespace kiln::codegen
