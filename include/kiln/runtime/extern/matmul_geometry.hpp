// The sizes and element strides of one matmul after broadcasting, checked and derived from its
// tensors (shape_error / dtype_error otherwise); shared by the CPU GEMM and the cuBLASLt path.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>

#include "../../core/config.hpp"
#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/tensor.hpp"

namespace kiln::runtime {

// The sizes of one matmul after broadcasting, and where its operands and output lie.
struct MatmulGeometry {
  std::int64_t batch = 1, M = 0, N = 0, K = 0;
  // Element strides: per batch (0 for a broadcast operand), per row and per column.
  std::int64_t a_bs = 0, a_sm = 0, a_sk = 0;
  std::int64_t b_bs = 0, b_sk = 0, b_sn = 0;
  std::int64_t o_bs = 0, o_sm = 0, o_sn = 0;
  bool batched = false;  // either operand is 3-D, so the output is [batch, M, N]
};

namespace mm_detail {

// KILN_ALLOW_TF32=1: f32 products may run through TF32 on tensor cores (cuBLASLt's and the GEMM
// template's); read once.
inline bool allow_tf32() {
  static const bool allowed = [] {
    const char* v = kiln::config::env("KILN_ALLOW_TF32");
    return v && std::string(v) == "1";
  }();
  return allowed;
}

inline std::string shapes_of(const Tensor& a, const Tensor& b) {
  return a.shape().str() + " (" + std::string(name(a.dtype())) + ") and " + b.shape().str() + " (" +
         std::string(name(b.dtype())) + ")";
}

}  // namespace mm_detail

// Checks shapes and dtypes (kiln::shape_error / dtype_error naming them) and describes the product.
inline MatmulGeometry matmul_geometry(const Tensor& a, const Tensor& b, const Tensor& out, const char* op) {
  const std::string what = std::string(op) + ": ";
  if (!a.defined() || !b.defined() || !out.defined())
    throw shape_error(what + "an operand or the output is an undefined tensor");
  if (a.dim() < 2 || a.dim() > 3 || b.dim() < 2 || b.dim() > 3)
    throw shape_error(what + "operands must be 2-D or 3-D (batched), got " + mm_detail::shapes_of(a, b));
  for (const Tensor* t : {&a, &b, &out})
    if (!is_floating(t->dtype()))
      throw dtype_error(what + "supports f64, f32, f16 and bf16 only, got " + mm_detail::shapes_of(a, b) + " into " +
                        std::string(name(out.dtype())));
  MatmulGeometry g;
  const int ad = a.dim(), bd = b.dim();
  g.M = a.shape()[ad - 2];
  g.K = a.shape()[ad - 1];
  g.N = b.shape()[bd - 1];
  if (b.shape()[bd - 2] != g.K)
    throw shape_error(what + "cannot multiply " + mm_detail::shapes_of(a, b) + ": the inner dimensions " +
                      std::to_string(g.K) + " and " + std::to_string(b.shape()[bd - 2]) + " differ");
  g.a_sm = a.strides()[ad - 2];
  g.a_sk = a.strides()[ad - 1];
  g.b_sk = b.strides()[bd - 2];
  g.b_sn = b.strides()[bd - 1];
  const std::int64_t ab = ad == 3 ? a.shape()[0] : 1, bb = bd == 3 ? b.shape()[0] : 1;
  g.batched = ad == 3 || bd == 3;
  if (ab != bb && ab != 1 && bb != 1)
    throw shape_error(what + "cannot multiply " + mm_detail::shapes_of(a, b) + ": batch sizes " + std::to_string(ab) +
                      " and " + std::to_string(bb) + " do not broadcast");
  g.batch = std::max(ab, bb);
  if (ab == 0 || bb == 0) g.batch = 0;
  g.a_bs = ad == 3 && ab != 1 ? a.strides()[0] : 0;
  g.b_bs = bd == 3 && bb != 1 ? b.strides()[0] : 0;
  Dims expect = g.batched ? Dims{g.batch, g.M, g.N} : Dims{g.M, g.N};
  if (!(out.shape() == expect))
    throw shape_error(what + "the output of " + mm_detail::shapes_of(a, b) + " must have shape " + expect.str() +
                      ", got " + out.shape().str());
  const int od = out.dim();
  g.o_bs = g.batched ? out.strides()[0] : 0;
  g.o_sm = out.strides()[od - 2];
  g.o_sn = out.strides()[od - 1];
  return g;
}

}  // namespace kiln::runtime
