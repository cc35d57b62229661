// kiln's own GEMM: the template of codegen/gemm_template.hpp (a block program on the prelude's tile
// `dot`), compiled for the operands' layout and the epilogue, on the GPU by NVRTC and on the CPU by
// the host compiler. On CUDA it is an autotuning candidate beside cuBLASLt (cuda_matmul.hpp: under
// `.autotune` the first call of a problem times both and keeps the faster); dot_matmul runs it
// directly (tests, benchmarks).
#pragma once
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../../codegen/gemm_template.hpp"
#include "../../core/driver.hpp"
#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/tensor.hpp"
#include "../../debug/log.hpp"
#include "../compile/cached_cubin.hpp"
#include "../compile/host_compiler.hpp"
#include "../compile/kernel_units.hpp"
#include "../launch/cuda_module.hpp"
#include "../launch/named_function.hpp"
#include "../tune/kept_choices.hpp"
#include "matmul_epilogue.hpp"
#include "matmul_geometry.hpp"
#include "strided_copy.hpp"

namespace kiln::runtime {

// KILN_TUNE_GEMM_TEMPLATE=1: autotuning also times the template against cuBLASLt
// (cuda_matmul_epilogue). Off until the template has run on a GPU (benchmarks/NOTES.md item 195);
// read at each autotuned call.
inline bool gemm_template_enabled() {
  const char* v = kiln::config::env("KILN_TUNE_GEMM_TEMPLATE");
  return v && std::string(v) == "1";
}

namespace dot_mm_detail {

inline schedule::Activation activation_of(Epilogue e) {
  switch (e) {
    case Epilogue::relu:
    case Epilogue::relu_bias:
      return schedule::Activation::relu;
    case Epilogue::gelu_tanh:
    case Epilogue::gelu_tanh_bias:
    case Epilogue::gelu_tanh_aux:
    case Epilogue::gelu_tanh_aux_bias:
      return schedule::Activation::gelu_tanh;
    case Epilogue::dgelu_tanh:
    case Epilogue::dgelu_tanh_bgrad:
      return schedule::Activation::dgelu_tanh;
    default:
      return schedule::Activation::none;
  }
}

inline bool on_16_bytes(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// The pre-activation as the template reads or writes it: a contiguous tensor of out's shape, dtype
// and device.
inline bool aux_usable(const Tensor* aux, const Tensor& out) {
  return aux && aux->defined() && aux->shape() == out.shape() && aux->is_contiguous() && aux->dtype() == out.dtype() &&
         aux->device() == out.device();
}

}  // namespace dot_mm_detail

// Why the template cannot compute out = e(a @ b) as asked ("" when it can): types (a and b of one
// type among bf16, f16 and f32; out in it or f32), the epilogue (the bias gradient's column sums
// are cuBLASLt's), a GPU grid's batch. (And a GPU before compute capability 8.0: dot_matmul says
// so, autotuning has no candidates there.)
inline std::string dot_matmul_unsupported(const Tensor& a, const Tensor& b, const Tensor& out, Epilogue e) {
  const dtype ab = a.dtype();
  if (b.dtype() != ab || !(ab == dtype::bf16 || ab == dtype::f16 || ab == dtype::f32))
    return "operands of one type among bf16, f16 and f32";
  if (out.dtype() != ab && out.dtype() != dtype::f32) return "an output in the operands' type or f32";
  if (epilogue_writes_bias(e)) return "no bias gradient (column sums)";
  if (out.device().is_cuda() && out.dim() == 3 && out.shape()[0] > 65535) return "a batch of at most 65535 on a GPU";
  return "";
}

// How the operands' tiles lie in shared memory, from their strides: a_k (b_k) where the operand's
// stride along K is 1 (else along M, or N, where that stride is 1: a transposed a, or b [K, N]
// row-major), and async (cp.async copies of 16 bytes) where both operands have stride 1 along the
// dim their tiles keep contiguous and their rows, batches and first elements start on 16 bytes; any
// other layout is staged element by element (a strided slice, an odd row stride of 16-bit values).
struct DotLayout {
  bool a_k = true, b_k = false, async = false;
};
inline DotLayout dot_layout(const MatmulGeometry& g, dtype dt, const void* a, const void* b) {
  DotLayout l;
  l.a_k = !(g.a_sm == 1 && g.a_sk != 1);
  l.b_k = g.b_sk == 1 && g.b_sn != 1;
  const std::int64_t vec = 16 / static_cast<std::int64_t>(itemsize(dt));
  const std::int64_t a_row = l.a_k ? g.a_sm : g.a_sk, b_row = l.b_k ? g.b_sn : g.b_sk;
  const bool a_unit = (l.a_k ? g.a_sk : g.a_sm) == 1, b_unit = (l.b_k ? g.b_sk : g.b_sn) == 1;
  l.async = a_unit && b_unit && a_row % vec == 0 && b_row % vec == 0 && g.a_bs % vec == 0 && g.b_bs % vec == 0 &&
            dot_mm_detail::on_16_bytes(a) && dot_mm_detail::on_16_bytes(b);
  return l;
}

// A GPU blocking of the template: bm x bn tiles of warps_m x warps_n warps, `stages` deep; wgmma
// (16-bit on sm_90a): by warpgroup MMA, the warps along M only (warps_m = bm / 16).
struct DotBlocking {
  int bm = 128, bn = 128, warps_m = 2, warps_n = 2, stages = 3;
  bool wgmma = false, overlap = false;  // overlap: wgmma's products of a step in flight under the next's
  bool tma = false;  // wgmma at bm 128: tiles by TMA from a producer warpgroup, where the layout allows
  std::string str() const {
    return std::to_string(bm) + "x" + std::to_string(bn) +
           (wgmma ? (tma       ? "wgmma-tma"
                     : overlap ? "wgmma-ov"
                               : "wgmma")
                  : "w" + std::to_string(warps_m) + "x" + std::to_string(warps_n)) +
           "s" + std::to_string(stages);
  }
};

// Whether TMA can copy the operands' tiles (dot_tma_maps): cp.async's conditions (stride 1 along the
// tile's contiguous dim, rows, batches and starts on 16 bytes), rows of a positive stride, batches
// broadcast or laid past a whole operand (the tensor map's strides grow with its dims: a permuted
// view keeps cp.async), strides below 2^40 bytes, and coordinates within TMA's 32-bit signed range.
inline bool dot_tma_layout(const MatmulGeometry& g, const DotLayout& l) {
  const std::int64_t most = std::int64_t{1} << 31,
                     far = std::int64_t{1} << 36;  // (elements of 2 bytes: under 2^40 bytes)
  auto fits = [&](std::int64_t row, std::int64_t rows, std::int64_t batch) {
    return row > 0 && row < far && (batch == 0 || (batch >= rows * row && batch < far));
  };
  return l.async && g.M > 0 && g.N > 0 && g.K > 0 && g.M < most && g.N < most && g.K < most && g.batch < most &&
         fits(l.a_k ? g.a_sm : g.a_sk, l.a_k ? g.M : g.K, g.a_bs) &&
         fits(l.b_k ? g.b_sn : g.b_sk, l.b_k ? g.N : g.K, g.b_bs);
}

// The kernel for this problem at a blocking (the CPU takes 64 x 64): its layout from the operands'
// strides, cp.async where both operands' contiguous dims have stride 1 and their rows and batches
// start on 16 bytes.
inline codegen::GemmKernel dot_matmul_kernel(const MatmulGeometry& g, const Tensor& a, const Tensor& b,
                                             const Tensor& out, Epilogue e, const DotBlocking& bl = {}) {
  codegen::GemmKernel k;
  k.dt = a.dtype();
  k.out_dt = out.dtype();
  k.act = dot_mm_detail::activation_of(e);
  k.bias = epilogue_has_bias(e);
  k.aux = e == Epilogue::gelu_tanh_aux || e == Epilogue::gelu_tanh_aux_bias;
  const DotLayout layout = dot_layout(g, k.dt, a.data_ptr(), b.data_ptr());
  k.a_k = layout.a_k, k.b_k = layout.b_k, k.async = layout.async;
  k.tf32 = k.dt == dtype::f32 && mm_detail::allow_tf32();
  k.cpu = !out.device().is_cuda();
  if (k.cpu) {  // (the host's loops read any layout alike: one kernel for all)
    k.bm = k.bn = 64, k.a_k = k.b_k = true, k.async = false;
  } else {
    k.bm = bl.bm, k.bn = bl.bn, k.stages = bl.stages, k.wgmma = bl.wgmma && k.dt != dtype::f32;
    k.overlap = k.wgmma && bl.overlap;
    k.tma = k.wgmma && bl.tma && bl.bm == 128 && dot_tma_layout(g, layout);
    k.warps_m = k.wgmma ? bl.bm / 16 : bl.warps_m, k.warps_n = k.wgmma ? 1 : bl.warps_n;
  }
  return k;
}

// The bias as the template reads it: a contiguous vector of N in out's dtype (a copy where it is not).
inline Tensor dot_matmul_bias(const Tensor& bias, const MatmulGeometry& g, const Tensor& out, CUstream stream) {
  if (bias.dtype() == out.dtype() && bias.is_contiguous()) return bias;
  const Tensor view = bias.as_strided({g.N}, {bias.strides().back()}, bias.offset());
  if (out.device().is_cuda()) return cuda_mm_detail::contiguous_as(view, out.dtype(), stream);
  Tensor c = Tensor::empty({g.N}, out.dtype(), out.device());
  copy_to_contiguous_host(view, c.data_ptr(), out.dtype());
  return c;
}

// The blockings autotuning tries on a GPU, those whose shared memory the device gives a block:
// 128 x 128 tiles of four warps (each 64 x 64: 128 f32 accumulators a thread), 128 x 256 of eight,
// 128 x 64 and 64 x 64 for problems of few tiles; on sm_90a, 16-bit also by wgmma at 128 x 128 and
// 128 x 256 (two warpgroups of 64 rows), staged by every thread's cp.async or, where the layout
// allows, by TMA from a producer warpgroup.
inline std::vector<codegen::GemmKernel> dot_matmul_candidates(const MatmulGeometry& g, const Tensor& a, const Tensor& b,
                                                              const Tensor& out, Epilogue e) {
  if (driver::compute_capability(out.device().index) < 80) return {};  // (cp.async, bf16 mma.sync)
  const bool wide = a.dtype() != dtype::f32;  // (f32's FMA fragments of a 128 x 256 tile would spill)
  const bool hopper = wide && driver::arch(out.device().index) == "sm_90a";
  std::vector<codegen::GemmKernel> ks;
  const int shared = driver::shared_optin(out.device().index);
  for (const DotBlocking& bl :
       {DotBlocking{128, 128, 2, 2, 3}, DotBlocking{128, 256, 2, 4, 3}, DotBlocking{128, 64, 2, 2, 4},
        DotBlocking{64, 64, 2, 2, 4}, DotBlocking{128, 128, 8, 1, 4, true}, DotBlocking{128, 256, 8, 1, 3, true},
        DotBlocking{128, 128, 8, 1, 6, true, false, true}, DotBlocking{128, 256, 8, 1, 4, true, false, true}}) {
    if ((!wide && bl.bn == 256) || (bl.wgmma && !hopper)) continue;
    codegen::GemmKernel k = dot_matmul_kernel(g, a, b, out, e, bl);
    if (k.tma != bl.tma) continue;  // (a layout TMA cannot copy)
    if (k.shared_bytes() <= shared) ks.push_back(k);
  }
  return ks;
}

// The tensor maps of a TMA kernel's operands (prelude_dot.hpp's dot_tma_stage): {K, rows, batch} with
// boxes of 64 x the tile's rows for a K-contiguous operand, {rows, K, batch} with boxes of 64 x 64
// for an M- or N-contiguous one; a broadcast batch (stride 0) is a batch of one, which the kernel
// reads at coordinate 0.
inline void dot_tma_maps(CUtensorMap (&maps)[2], const codegen::GemmKernel& k, const MatmulGeometry& g, const void* a,
                         const void* b) {
  const auto bytes = static_cast<std::uint64_t>(itemsize(k.dt));
  auto encode = [&](CUtensorMap& map, const void* base, bool kmajor, std::int64_t rows, std::int64_t s_row,
                    std::int64_t s_k, std::int64_t s_batch, int tile_rows) {
    const std::int64_t inner = kmajor ? g.K : rows, outer = kmajor ? rows : g.K, s_outer = kmajor ? s_row : s_k;
    const std::uint64_t dims[3] = {static_cast<std::uint64_t>(inner), static_cast<std::uint64_t>(outer),
                                   static_cast<std::uint64_t>(s_batch ? g.batch : 1)};
    const std::uint64_t strides[2] = {static_cast<std::uint64_t>(s_outer) * bytes,
                                      static_cast<std::uint64_t>(s_batch ? s_batch : outer * s_outer) * bytes};
    const std::uint32_t box[3] = {64, static_cast<std::uint32_t>(kmajor ? tile_rows : 64), 1};
    if (!driver::encode_tile_map(map, k.dt == dtype::bf16, const_cast<void*>(base), 3, dims, strides, box))
      throw error("matmul: cuTensorMapEncodeTiled refused the operand of " + std::to_string(rows) + " x " +
                  std::to_string(g.K) + " for " + k.name());
  };
  encode(maps[0], a, k.a_k, g.M, g.a_sm, g.a_sk, g.a_bs, k.bm);
  encode(maps[1], b, k.b_k, g.N, g.b_sn, g.b_sk, g.b_bs, k.bn);
}

// The CUBINs of kernels ks for arch at once (NVRTC on every core, into the disk cache that
// named_function reads): autotuning's candidates, a benchmark's or a test's blockings. A kernel that
// fails to compile is left for its launch to compile again and report.
inline void compile_gemm_kernels(const std::vector<codegen::GemmKernel>& ks, const std::string& arch) {
  const std::size_t threads = std::min<std::size_t>(ks.size(), std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> compiling;
  for (std::size_t t = 0; t < threads; ++t)
    compiling.emplace_back([&ks, &arch, t, threads] {
      for (std::size_t i = t; i < ks.size(); i += threads) try {
          cached_cubin(codegen::gemm_kernel_source(ks[i]), ks[i].name(), arch);
        } catch (...) {
        }
    });
  for (auto& t : compiling) t.join();
}

// Autotuning's choice of the template for one problem (cuda_matmul.hpp): its kernel, resolved once
// (the cache-hit path builds no name and looks up no module).
struct DotMatmulPick {
  codegen::GemmKernel kernel;
  std::string name;
  CUfunction function = nullptr;
};

// Runs kernel k (dot_matmul_kernel's) for out = e(a @ b (+ bias)); bias: a contiguous vector of N
// in out's dtype; aux: a contiguous tensor of out's shape in out's dtype (written by the *_aux
// epilogues, read by dgelu_tanh). Queued on stream on a GPU; on the CPU it returns when done.
// `resolved`: the kernel's name and function where autotuning kept them.
inline void run_dot_matmul(const codegen::GemmKernel& k, const MatmulGeometry& g, const Tensor& a, const Tensor& b,
                           const Tensor* bias, const Tensor* aux, const Tensor& out, CUstream stream,
                           const DotMatmulPick* resolved = nullptr) {
  if (g.batch == 0 || g.M == 0 || g.N == 0) return;
  const void* pa = a.data_ptr();
  const void* pb = b.data_ptr();
  const void* pbias = bias ? bias->data_ptr() : nullptr;
  void* paux = aux ? aux->data_ptr() : nullptr;
  void* pout = out.data_ptr();
  std::int64_t sizes[14] = {g.M,    g.N,    g.K,    g.a_bs, g.a_sm, g.a_sk,    g.b_bs,
                            g.b_sk, g.b_sn, g.o_bs, g.o_sm, g.o_sn, g.M * g.N, g.N};  // aux: contiguous [batch, M, N]
  void* args[21] = {&pa, &pb, &pbias, &paux, &pout};
  for (int i = 0; i < 14; ++i) args[5 + i] = &sizes[i];
  CUtensorMap maps[2];
  if (k.tma) {
    dot_tma_maps(maps, k, g, pa, pb);
    args[19] = &maps[0], args[20] = &maps[1];
  }
  const std::int64_t tiles = ((g.M + k.bm - 1) / k.bm) * ((g.N + k.bn - 1) / k.bn);
  std::string own;
  if (!resolved) own = k.name();
  const std::string& name = resolved ? resolved->name : own;
  if (k.cpu) {
    codegen::KernelSource entry_of;  // (what cpu_trampoline reads: the name and parameters)
    entry_of.params = codegen::gemm_kernel_params(k);
    auto object = compile_shared_object(codegen::gemm_kernel_source(k) + cpu_trampoline(entry_of, name), name);
    auto entry = reinterpret_cast<void (*)(void**, std::int64_t)>(object->symbol((name + "_cpu").c_str()));
    entry(args, g.batch * tiles);
    return;
  }
  if (tiles > INT32_MAX)
    throw shape_error("matmul: " + std::to_string(tiles) + " output tiles are too many for a grid");
  CUfunction f = resolved ? resolved->function
                          : named_function(
                                name, [&] { return codegen::gemm_kernel_source(k); }, out.device().index);
  launch(f, Dim3{static_cast<unsigned>(tiles), static_cast<unsigned>(g.batch)},
         Dim3{static_cast<unsigned>(k.threads())}, static_cast<unsigned>(k.shared_bytes()), stream, args, name.c_str());
}

namespace dot_mm_detail {

// Host copy of a CUDA tensor's values as f64 (waits for stream): in index order, or, for a
// contiguous tensor of more than 2^23 elements, its first and last 2^22 (whole rows of every column
// tile at the top and at the bottom, where a tile's masks would go wrong; a GPT-2 vocabulary's
// logits are 412 million values, each candidate's check would copy 800 MB).
inline std::vector<double> host_values(const Tensor& t, CUstream stream) {
  constexpr std::int64_t part = std::int64_t{1} << 22;
  const std::size_t size = itemsize(t.dtype());
  std::vector<double> v;
  if (t.is_contiguous() && t.numel() > 2 * part) {
    std::vector<char> raw(static_cast<std::size_t>(2 * part) * size);
    const char* base = static_cast<const char*>(t.data_ptr());
    driver::copy_async(raw.data(), base, static_cast<std::size_t>(part) * size, stream);
    driver::copy_async(raw.data() + part * size, base + (t.numel() - part) * size,
                       static_cast<std::size_t>(part) * size, stream);
    driver::synchronize(stream);
    v.reserve(static_cast<std::size_t>(2 * part));
    for (std::int64_t i = 0; i < 2 * part; ++i) v.push_back(load_as_double(raw.data(), t.dtype(), i));
    return v;
  }
  const std::size_t bytes = t.storage()->bytes;
  std::vector<char> raw(bytes);
  driver::copy_async(raw.data(), t.storage()->data, bytes, stream);
  driver::synchronize(stream);
  v.reserve(static_cast<std::size_t>(t.numel()));
  for_each_index(t.shape(), [&](std::int64_t, const Dims& idx) {
    v.push_back(load_as_double(raw.data(), t.dtype(), t.offset() + dot_strides(idx, t.strides())));
  });
  return v;
}

}  // namespace dot_mm_detail

// The first call of a problem under autotuning (timed: not during a capture) times cuBLASLt
// (time_cublas, its output then in out) and each candidate blocking of the template, each checked
// first against cuBLASLt's output (within the rounding of out's dtype), and keeps the fastest for
// the process: the template only where it beats cuBLASLt by more than 1% (timing noise). Later calls
// (and calls during a capture) take the kept choice; a first call inside a capture takes cuBLASLt,
// unkept.
// Returns the kept template kernel, or nullptr for cuBLASLt.
template <class TimeCublas>
const DotMatmulPick* pick_dot_matmul(const MatmulGeometry& g, const Tensor& a, const Tensor& b, const Tensor* bias,
                                     Epilogue e, const Tensor& out, const Tensor* aux, CUstream stream,
                                     TimeCublas&& time_cublas) {
  if (epilogue_has_aux(e) && !dot_mm_detail::aux_usable(aux, out)) return nullptr;  // (cuBLASLt's path names why)
  const auto align = [](const Tensor& t) { return std::int64_t{dot_mm_detail::on_16_bytes(t.data_ptr())}; };
  const std::vector<std::int64_t> key{out.device().index,
                                      static_cast<std::int64_t>(a.dtype()),
                                      static_cast<std::int64_t>(out.dtype()),
                                      static_cast<std::int64_t>(e),
                                      g.batch,
                                      g.M,
                                      g.N,
                                      g.K,
                                      g.a_bs,
                                      g.a_sm,
                                      g.a_sk,
                                      g.b_bs,
                                      g.b_sk,
                                      g.b_sn,
                                      g.o_bs,
                                      g.o_sm,
                                      g.o_sn,
                                      align(a),
                                      align(b)};
  // (a kept cuBLASLt is an empty optional)
  static auto* kept = new KeptChoices<std::vector<std::int64_t>, std::optional<DotMatmulPick>>();
  if (const auto* pick = kept->find(key)) return *pick ? &**pick : nullptr;
  if (stream && driver::is_capturing(stream)) return nullptr;  // (not timed inside a capture, nor kept)
  std::vector<codegen::GemmKernel> ks = dot_matmul_candidates(g, a, b, out, e);
  compile_gemm_kernels(ks, driver::arch(out.device().index));
  const double cublas_ms = time_cublas();
  const std::vector<double> want = dot_mm_detail::host_values(out, stream);
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  const double tol = (out.dtype() == dtype::f32 ? 1e-3 : 2e-2) * std::max(scale, 1e-30);
  Tensor bias_c;
  if (epilogue_has_bias(e)) bias_c = dot_matmul_bias(*bias, g, out, stream);
  const codegen::GemmKernel* picked = nullptr;
  double best = 0.99 * cublas_ms;
  std::string report;
  for (const auto& k : ks) {
    auto go = [&] { run_dot_matmul(k, g, a, b, bias_c.defined() ? &bias_c : nullptr, aux, out, stream); };
    try {  // (a candidate that does not compile or launch is left out; a fault in it cannot be undone)
      go();
    } catch (const kiln::error& failed) {
      report += ", " + k.name() + " failed (" + failed.what() + ")";
      continue;
    }
    const std::vector<double> got = dot_mm_detail::host_values(out, stream);
    bool same = got.size() == want.size();
    for (std::size_t i = 0; same && i < got.size(); ++i) same = std::abs(got[i] - want[i]) <= tol;
    if (!same) {
      report += ", " + k.name() + " differs from cuBLASLt (not taken)";
      continue;
    }
    const double ms = time_calls_ms(go, stream);
    report += ", " + k.name() + " " + std::to_string(ms) + " ms";
    if (ms < best) best = ms, picked = &k;
  }
  // out holds the last candidate's values, which passed the check; a pick of cuBLASLt's rewrites it
  // on this call (cuda_matmul_epilogue).
  debug::log_lazy(debug::Channel::autotune, [&] {
    return "matmul " + mm_detail::shapes_of(a, b) + " (" + std::string(name(out.dtype())) + " out, epilogue " +
           std::to_string(static_cast<int>(e)) + "): cuBLASLt " + std::to_string(cublas_ms) + " ms" + report + ": " +
           (picked ? picked->name() : std::string("cuBLASLt"));
  });
  std::optional<DotMatmulPick> pick;
  if (picked)
    pick = DotMatmulPick{*picked, picked->name(),
                         named_function(
                             picked->name(), [&] { return codegen::gemm_kernel_source(*picked); }, out.device().index)};
  const auto& entry = kept->keep(key, std::move(pick));
  return entry ? &*entry : nullptr;
}

// out = e(a @ b (+ bias)) by the template, on out's device (the same contract as
// cuda_matmul_epilogue's, minus the bias gradient; a bias in another layout or dtype is made
// contiguous in out's first). Throws kiln::error naming what the template does not take.
inline void dot_matmul(const Tensor& a, const Tensor& b, const Tensor* bias, Epilogue e, const Tensor& out,
                       CUstream stream = nullptr, const Tensor* aux = nullptr, const DotBlocking& blocking = {}) {
  const MatmulGeometry g = matmul_geometry(a, b, out, "matmul");
  if (const std::string why = dot_matmul_unsupported(a, b, out, e); !why.empty())
    throw dtype_error("matmul: kiln's GEMM template takes " + why + "; got " + mm_detail::shapes_of(a, b) + " into " +
                      std::string(name(out.dtype())));
  for (const Tensor* t : {&b, &out})
    if (t->device() != a.device())
      throw device_error("matmul: operands and output on " + a.device().str() + " and " + t->device().str());
  if (out.device().is_cuda() && driver::compute_capability(out.device().index) < 80)
    throw device_error("matmul: kiln's GEMM template needs a GPU of compute capability 8.0 or later, got " +
                       out.device().str());
  Tensor bias_c, aux_c;
  if (epilogue_has_bias(e)) {
    if (!bias || !bias->defined() || bias->numel() != g.N)
      throw shape_error("matmul: this epilogue adds a bias of " + std::to_string(g.N) + " values");
    bias_c = dot_matmul_bias(*bias, g, out, stream);
  }
  if (epilogue_has_aux(e)) {
    if (!dot_mm_detail::aux_usable(aux, out))
      throw shape_error("matmul: this epilogue's pre-activation is a contiguous " + out.shape().str() + " " +
                        std::string(name(out.dtype())));
    aux_c = *aux;
  }
  run_dot_matmul(dot_matmul_kernel(g, a, b, out, e, blocking), g, a, b, bias_c.defined() ? &bias_c : nullptr,
                 aux_c.defined() ? &aux_c : nullptr, out, stream);
}

}  // namespace kiln::runtime
