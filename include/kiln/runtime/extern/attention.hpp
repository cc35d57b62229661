// The extern step of attention_flash(q [B, H, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, D], scale):
// the fused forward kernel of codegen/attention_kernel.hpp, compiled once per (device, head dim,
// warps, causal, dtype) through the disk cache. Lowering (runtime/lower.hpp) gives an attention
// node to it only where attention_flash_fits says so; everywhere else attention is decomposed.
#pragma once
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <numbers>
#include <string>
#include <tuple>

#include "../../codegen/attention_kernel.hpp"
#include "../../core/driver.hpp"
#include "../../core/error.hpp"
#include "../../core/tensor.hpp"
#include "../../graph/graph.hpp"
#include "../compile/cached_cubin.hpp"
#include "../launch/cuda_module.hpp"

namespace kiln::runtime {

// Whether the fused kernel runs attention over these operands: 16-bit q, k and v of one dtype, one
// head dim for all three, a multiple of 16 up to 128 (the registers a warp holds for 16 rows),
// tensor cores with 16-bit mma (compute capability 8.0+).
inline bool attention_flash_fits(const Dims& q, const Dims& k, const Dims& v, dtype dt, int compute_capability) {
  if (dt != dtype::bf16 && dt != dtype::f16) return false;
  if (q.size() != 4 || k.size() != 4 || v.size() != 4 || compute_capability < 80) return false;
  const std::int64_t D = q[3];
  return D % 16 == 0 && D >= 16 && D <= 128 && v[3] == D && k[3] == D;
}

// The scale an attention_flash node runs with: its scalar when the user gave one, else 1/sqrt(D).
inline double attention_scale(const graph::Graph& g, const graph::Node& n, const double* scalars, std::int64_t D) {
  if (!n.attrs.b) return 1.0 / std::sqrt(static_cast<double>(std::max<std::int64_t>(D, 1)));
  const graph::Node& s = g[n.in[3]];
  return s.op == Op::scalar ? scalars[s.slot] : s.value;
}

// The kernel an attention_flash node runs, as explain shows it: its source.
inline codegen::AttentionKernel attention_kernel_of(const graph::Graph& g, const graph::Node& n) {
  codegen::AttentionKernel a = codegen::AttentionKernel::for_head_dim(static_cast<int>(g[n.in[0]].shape[3]),
                                                                      static_cast<int>(n.attrs.dims[0]));
  a.warps = static_cast<int>(n.attrs.d);
  a.causal = n.attrs.a != 0;
  a.dt = g[n.in[0]].dt;
  return a;
}
inline std::string describe_attention_step(const graph::Graph& g, int node) {
  return codegen::attention_forward_source(attention_kernel_of(g, g[node]));
}

namespace attention_detail {

inline CUfunction function(const codegen::AttentionKernel& a, int device) {
  using Key = std::tuple<int, std::string>;
  struct Loaded {
    std::unique_ptr<Module> module;
    CUfunction f = nullptr;
  };
  static std::mutex mutex;
  static auto* loaded = new std::map<Key, Loaded>();  // never unloaded
  std::lock_guard lock(mutex);
  Loaded& l = (*loaded)[Key{device, a.name()}];
  if (!l.f) {
    l.module = std::make_unique<Module>(
        cached_cubin(codegen::attention_forward_source(a), a.name(), driver::arch(device)), device);
    l.f = l.module->function(a.name().c_str());
  }
  return l.f;
}

inline void check(const Tensor& t, const char* what) {
  const Dims& s = t.strides();
  bool ok = s.size() == 4 && s[3] == 1;
  for (int i = 0; ok && i < 3; ++i) ok = s[i] % 8 == 0;
  ok = ok && reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0;
  if (!ok)
    throw error(std::string("attention: the fused kernel reads ") + what + " " + t.shape().str() + " with strides " +
                s.str() + "; it needs a contiguous head dim, 16-byte rows and a 16-byte aligned start");
}

}  // namespace attention_detail

// out = softmax(q k^T * scale [causal]) v, written by the fused kernel with `warps` warps a block
// and `row_tiles` 16-row tiles a warp (0: AttentionKernel::for_head_dim's choice).
inline void attention_flash(const Tensor& q, const Tensor& k, const Tensor& v, double scale, bool causal, int warps,
                            int row_tiles, Tensor& out, CUstream stream) {
  if (!q.device().is_cuda()) throw error("attention: the fused kernel runs on CUDA devices only");
  attention_detail::check(q, "q");
  attention_detail::check(k, "k");
  attention_detail::check(v, "v");
  attention_detail::check(out, "its output");
  const Dims &qs = q.shape(), &ks = k.shape();
  if (!attention_flash_fits(qs, ks, v.shape(), q.dtype(), 80) || k.dtype() != q.dtype() || v.dtype() != q.dtype())
    throw shape_error("attention: this program runs the fused kernel, which does not take q " + qs.str() + ", k " +
                      ks.str() + ", v " + v.shape().str() + " " + std::string(name(q.dtype())) +
                      " (sizes changed under dynamic shapes): compile it again");
  codegen::AttentionKernel a = codegen::AttentionKernel::for_head_dim(static_cast<int>(qs[3]), row_tiles);
  a.warps = warps;
  a.causal = causal;
  a.dt = q.dtype();
  const int device = out.device().index;
  CUfunction f = attention_detail::function(a, device);
  driver::make_current(device);
  int BH = static_cast<int>(qs[0] * qs[1]), H = static_cast<int>(qs[1]), G = static_cast<int>(qs[1] / ks[1]), Tq = static_cast<int>(qs[2]),
      Tk = static_cast<int>(ks[2]);
  float scale_log2 = static_cast<float>(scale * std::numbers::log2e);
  const void *qp = q.data_ptr(), *kp = k.data_ptr(), *vp = v.data_ptr();
  void* op = out.data_ptr();
  std::int64_t st[12];
  const Tensor* ts[4] = {&q, &k, &v, &out};
  for (int t = 0; t < 4; ++t)
    for (int i = 0; i < 3; ++i) st[3 * t + i] = ts[t]->strides()[i];
  void* args[] = {&qp, &kp, &vp, &op, &BH, &H, &G, &Tq, &Tk, &scale_log2, &st[0], &st[1], &st[2], &st[3],
                  &st[4], &st[5], &st[6], &st[7], &st[8], &st[9], &st[10], &st[11]};
  const unsigned blocks = static_cast<unsigned>((Tq + a.query_rows() - 1) / a.query_rows());
  const std::int64_t heads = qs[0] * qs[1], most = 65535;  // (batch, head) pairs along y, then z
  if (blocks == 0 || heads == 0) return;
  launch(f, Dim3{blocks, static_cast<unsigned>(std::min(heads, most)), static_cast<unsigned>((heads + most - 1) / most)},
         Dim3{static_cast<unsigned>(32 * warps)},
         static_cast<unsigned>(a.shared_bytes()), stream, args, a.name().c_str());
}

}  // namespace kiln::runtime
