// Matrix multiplication on CUDA through cuBLASLt, opened with dlopen on first use (as the driver
// is) so that kiln loads, and its CPU path runs, on machines without it.
//
// kiln's tensors are row-major; cuBLAS is column-major. A row-major [M,N] output is a column-major
// N x M matrix, so out = a @ b is computed as out^T = b^T a^T: cuBLAS's A is b, its B is a. An
// operand stored row-major in its last dim (stride 1 there) reads as its own transpose in the
// column-major view (op N); one stored column-major (stride 1 in its last-but-one dim, e.g. a
// permuted weight) reads as itself (op T). Any other layout, or a dtype cuBLASLt cannot pair with
// the other operand's, is first copied into a contiguous temporary by a small NVRTC kernel.
// Batches use strided batches; a broadcast operand has batch stride 0, and a 3-D a with a 2-D b
// whose batches lie back to back folds its batch into M (one large GEMM).
//
// Parts: cublaslt.hpp (the dlopen'd binding), cuda_matmul_state.hpp (per-device state),
// strided_copy.hpp (the copy kernel), matmul_layout.hpp (the plan); here the call itself.
#pragma once
#include <cublasLt.h>  // types and prototypes only: libcublasLt is never linked

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "../../core/config.hpp"
#include "../../core/driver.hpp"
#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/tensor.hpp"
#include "../../debug/log.hpp"
#include "../launch/capture_keep.hpp"
#include "../launch/cuda_module.hpp"
#include "cpu_matmul.hpp"
#include "cublaslt.hpp"
#include "cuda_matmul_state.hpp"
#include "dot_matmul.hpp"
#include "matmul_epilogue.hpp"
#include "matmul_geometry.hpp"
#include "matmul_layout.hpp"
#include "strided_copy.hpp"

namespace kiln::runtime {

// The storage shapes of a GEMM's operands and output where they have room (empty: none).
struct GemmRooms {
  Dims a, b, out;
};

namespace cuda_mm_detail {

inline cudaDataType_t cuda_type(dtype d) {
  switch (d) {
    case dtype::f64:
      return CUDA_R_64F;
    case dtype::f32:
      return CUDA_R_32F;
    case dtype::f16:
      return CUDA_R_16F;
    case dtype::bf16:
      return CUDA_R_16BF;
    default:
      throw dtype_error("matmul: cuBLASLt has no type for " + std::string(name(d)));
  }
}

// KILN_TUNE_GEMM_PAD=0: 16-bit GEMMs with sizes or leading dimensions off 16 bytes run as they are
// (matmul_layout.hpp's plan_padding decides otherwise).
inline bool gemm_padding_enabled() {
  static const bool enabled = [] {
    const char* v = kiln::config::env("KILN_TUNE_GEMM_PAD");
    return !(v && std::string(v) == "0");
  }();
  return enabled;
}

// The largest power of two (up to 256) dividing the address: what the heuristic may assume.
inline std::uint32_t alignment(const void* p) {
  auto v = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t a = 256;
  while (a > 1 && v % a) a /= 2;
  return a;
}

// The room of cuBLAS's A, B and D (GemmRoom) from the rooms of kiln's b, a and out: a kiln view
// R x C as cuBLAS stores it (matmul_layout.hpp's classify) is C x R, or R x C under op T. Only
// for a single GEMM over the operands as given (not through copies), out written in place.
inline GemmRoom gemm_room(const GemmPlan& p, const GemmRooms* rooms, const Tensor& a, const Tensor& b,
                          const Tensor& a_in, const Tensor& b_in) {
  GemmRoom r;
  if (!rooms || p.batch != 1) return r;
  auto stored = [](const Dims& view, bool transposed, std::int64_t& rows, std::int64_t& cols) {
    rows = transposed ? view[0] : view[1], cols = transposed ? view[1] : view[0];
  };
  if (rooms->b.size() == 2 && !p.copy_b && b.data_ptr() == b_in.data_ptr())
    stored(rooms->b, p.trans_a, r.rows_a, r.cols_a);
  if (rooms->a.size() == 2 && !p.copy_a && a.data_ptr() == a_in.data_ptr())
    stored(rooms->a, p.trans_b, r.rows_b, r.cols_b);
  if (rooms->out.size() == 2 && p.direct) r.m = rooms->out[1], r.n = rooms->out[0];
  return r;
}

}  // namespace cuda_mm_detail

// out = epilogue(a @ b (+ bias)) on CUDA, queued on stream. Same contract as cpu_matmul: a [M,K]
// or [B,M,K], b [K,N] or [B,K,N] (broadcasting a 2-D operand or a batch of 1), out [M,N] or
// [B,M,N] allocated with the result dtype; any strides, dtypes f64/f32/f16/bf16. f32 accumulates in
// f32 (TF32 only when KILN_ALLOW_TF32=1), f16/bf16 in f32, f64 in f64. bias is a vector of N
// (shape [N], or [1, ..., N]) on the same device, required by the *_bias epilogues. Never
// synchronises; temporaries are freed stream-ordered on stream. out must not overlap a, b or bias.
// autotune: the first call of a problem times cuBLASLt's best few algorithms on these operands
// (synchronising) and keeps the fastest, instead of taking the heuristic's first answer.
// aux (the *_aux epilogues): a contiguous tensor of out's shape in the type cuBLASLt writes (out's
// dtype when out is written in place), N a multiple of 8, that receives the pre-activation; for
// dgelu_tanh, the same tensor as that step wrote it, read.
// rooms: the storage shapes of a, b and out where they have room for a padded problem, zeroed
// (a program's buffers, schedule/pad_buffers.hpp); views with the operands' strides.
// (cuda_matmul_epilogue below: this, or under autotuning kiln's GEMM template where it is faster.)
inline void cublaslt_matmul_epilogue(const Tensor& a_in, const Tensor& b_in, const Tensor* bias_in, Epilogue e,
                                     const Tensor& out, CUstream stream, bool autotune = false,
                                     const Tensor* aux = nullptr, const GemmRooms* rooms = nullptr) {
  using namespace cuda_mm_detail;
  MatmulGeometry g = matmul_geometry(a_in, b_in, out, "matmul");
  const Device dev = out.device();
  if (!dev.is_cuda() || a_in.device() != dev || b_in.device() != dev)
    throw device_error("matmul: cuda_matmul needs its operands and output on one CUDA device, got " +
                       a_in.device().str() + " x " + b_in.device().str() + " into " + dev.str());
  const bool with_bias = epilogue_has_bias(e);
  if (with_bias) {
    if (!bias_in || !bias_in->defined()) throw shape_error("matmul: this epilogue adds a bias, but none was given");
    const Tensor& bias = *bias_in;
    bool vector_of_n = bias.dim() >= 1 && bias.shape().back() == g.N && bias.numel() == g.N;
    if (!vector_of_n)
      throw shape_error("matmul: the bias of an output " + out.shape().str() + " must be a vector of " +
                        std::to_string(g.N) + ", got " + bias.shape().str());
    if (bias.device() != dev)
      throw device_error("matmul: the bias is on " + bias.device().str() + ", the output on " + dev.str());
    if (!is_floating(bias.dtype()))
      throw dtype_error("matmul: the bias must be floating, got " + std::string(name(bias.dtype())));
  }
  const bool writes_bias = epilogue_writes_bias(e);
  if (writes_bias) {  // a bias gradient: written in place, a contiguous vector of N in out's dtype
    const bool usable = bias_in && bias_in->defined() && bias_in->numel() == g.N && bias_in->is_contiguous() &&
                        bias_in->device() == dev && bias_in->dtype() == out.dtype() && g.batch == 1 &&
                        alignment(bias_in->data_ptr()) >= 16;
    if (!usable)
      throw shape_error("matmul: this epilogue writes the columns' sums of an output " + out.shape().str() +
                        " (one matrix) into a contiguous, 16-byte-aligned vector of " + std::to_string(g.N) + " " +
                        std::string(name(out.dtype())) + "; got " +
                        (bias_in && bias_in->defined()
                             ? bias_in->shape().str() + " " + std::string(name(bias_in->dtype()))
                             : std::string("none")));
    if (g.M == 0) driver::memset_async(bias_in->data_ptr(), 0, bias_in->nbytes(), stream);  // sums of no rows
  }
  if (g.batch == 0 || g.M == 0 || g.N == 0) return;
  if (g.batch > INT32_MAX)
    throw shape_error("matmul: a batch of " + std::to_string(g.batch) + " is too large for cuBLASLt");
  const int device = dev.index;
  driver::make_current(device);
  const cublaslt::Api& lt = cublaslt::api();

  // Types: cuBLASLt multiplies two operands of one type into f32 or that type.
  const dtype ab = a_in.dtype() == dtype::f64 || b_in.dtype() == dtype::f64 ? dtype::f64
                   : a_in.dtype() == b_in.dtype()                           ? a_in.dtype()
                                                                            : dtype::f32;
  const dtype dt = (ab == dtype::f16 || ab == dtype::bf16) && out.dtype() != ab ? dtype::f32 : ab;
  const bool tf32 = ab == dtype::f32 && mm_detail::allow_tf32();
  const cublasComputeType_t compute = ab == dtype::f64 ? CUBLAS_COMPUTE_64F
                                      : tf32           ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                       : CUBLAS_COMPUTE_32F;
  const cudaDataType_t scale_type = ab == dtype::f64 ? CUDA_R_64F : CUDA_R_32F;

  // K = 0: the product is zero (plus any epilogue); multiply zero operands of K = 1 instead.
  Tensor a = a_in, b = b_in;
  if (g.K == 0) {
    a = capture_temporary({g.M, 1}, ab, dev, stream);
    b = capture_temporary({1, g.N}, ab, dev, stream);
    driver::memset_async(a.data_ptr(), 0, a.nbytes(), stream);
    driver::memset_async(b.data_ptr(), 0, b.nbytes(), stream);
    g.K = 1;
    g.a_bs = g.b_bs = 0;
    g.a_sm = 1, g.a_sk = 1, g.b_sk = g.N, g.b_sn = 1;
  }

  // Operands cuBLASLt can read in place, else contiguous copies in the operand type; the output
  // written in place when cuBLASLt can, else through a contiguous temporary.
  const GemmPlan p = plan_gemm(g, a.dtype() == ab, b.dtype() == ab, out.dtype() == dt);
  if (p.copy_a) a = contiguous_as(a, ab, stream);
  if (p.copy_b) b = contiguous_as(b, ab, stream);
  Tensor d = p.direct ? out : capture_temporary(out.shape(), dt, dev, stream);

  Tensor bias;
  if (with_bias) {
    bias = *bias_in;
    const bool usable =
        bias.dtype() == dt && (bias.strides().back() == 1 || g.N == 1) && alignment(bias.data_ptr()) >= 16;
    if (!usable) bias = contiguous_as(bias.as_strided({g.N}, {bias.strides().back()}, bias.offset()), dt, stream);
  }

  cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
  switch (e) {
    case Epilogue::none:
      epi = CUBLASLT_EPILOGUE_DEFAULT;
      break;
    case Epilogue::bias:
      epi = CUBLASLT_EPILOGUE_BIAS;
      break;
    case Epilogue::relu:
      epi = CUBLASLT_EPILOGUE_RELU;
      break;
    case Epilogue::relu_bias:
      epi = CUBLASLT_EPILOGUE_RELU_BIAS;
      break;
    case Epilogue::gelu_tanh:
      epi = CUBLASLT_EPILOGUE_GELU;
      break;
    case Epilogue::gelu_tanh_bias:
      epi = CUBLASLT_EPILOGUE_GELU_BIAS;
      break;
    case Epilogue::gelu_tanh_aux:
      epi = CUBLASLT_EPILOGUE_GELU_AUX;
      break;
    case Epilogue::gelu_tanh_aux_bias:
      epi = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
      break;
    case Epilogue::dgelu_tanh:
      epi = CUBLASLT_EPILOGUE_DGELU;
      break;
    case Epilogue::dgelu_tanh_bgrad:
      epi = CUBLASLT_EPILOGUE_DGELU_BGRAD;
      break;
  }
  if (epilogue_has_aux(e)) {
    const bool usable = aux && aux->defined() && aux->shape() == out.shape() && aux->is_contiguous() &&
                        aux->device() == dev && g.N % 8 == 0;
    if (!usable)
      throw shape_error("matmul: this epilogue keeps the pre-activation in a contiguous tensor of " +
                        out.shape().str() + " with a multiple of 8 columns; got " +
                        (aux && aux->defined() ? aux->shape().str() + " on " + aux->device().str() : "none"));
    if (aux->dtype() != dt)
      throw dtype_error("matmul: the pre-activation is stored as " + std::string(name(dt)) + " here, not " +
                        std::string(name(aux->dtype())));
  }

  // 16-bit sizes or leading dimensions off 16 bytes: zero-padded copies where they pay
  // (plan_padding); q is the problem cuBLAS then runs.
  const void* pa = b.data_ptr();  // cuBLAS's A
  const void* pb = a.data_ptr();  // cuBLAS's B
  void* pd = d.data_ptr();
  GemmPlan q = p;
  const GemmPadding pad =
      gemm_padding_enabled() && !epilogue_has_aux(e)
          ? plan_padding(p, static_cast<std::int64_t>(itemsize(ab)), static_cast<std::int64_t>(itemsize(dt)),
                         gemm_room(p, rooms, a, b, a_in, b_in))
          : GemmPadding{};
  Tensor pad_a, pad_b, pad_d, pad_bias;
  if (pad.pad) {
    const std::size_t ab_size = itemsize(ab), dt_size = itemsize(dt);
    if (pad.in_a) {  // in its own room: the same storage, read further
      q.rows_a = pad.rows_a, q.cols_a = pad.cols_a;
    } else if (pad.a) {
      pad_a = capture_temporary({pad.cols_a, pad.rows_a}, ab, dev, stream);
      pad_copy(pa, p.rows_a, p.cols_a, p.lda, pad_a.data_ptr(), pad.rows_a, pad.cols_a, pad.rows_a, ab_size, device,
               stream);
      pa = pad_a.data_ptr(), q.rows_a = pad.rows_a, q.cols_a = pad.cols_a, q.lda = pad.rows_a;
    }
    if (pad.in_b) {
      q.rows_b = pad.rows_b, q.cols_b = pad.cols_b;
    } else if (pad.b) {
      pad_b = capture_temporary({pad.cols_b, pad.rows_b}, ab, dev, stream);
      pad_copy(pb, p.rows_b, p.cols_b, p.ldb, pad_b.data_ptr(), pad.rows_b, pad.cols_b, pad.rows_b, ab_size, device,
               stream);
      pb = pad_b.data_ptr(), q.rows_b = pad.rows_b, q.cols_b = pad.cols_b, q.ldb = pad.rows_b;
    }
    if (pad.d && !pad.in_d) {
      pad_d = capture_temporary({pad.n, pad.m}, dt, dev, stream);
      pd = pad_d.data_ptr(), q.ldd = pad.m;
    }
    if (with_bias && pad.m != p.m) {
      pad_bias = capture_temporary({pad.m}, dt, dev, stream);
      pad_copy(bias.data_ptr(), p.m, 1, p.m, pad_bias.data_ptr(), pad.m, 1, pad.m, dt_size, device, stream);
      bias = pad_bias;
    }
    q.m = pad.m, q.n = pad.n, q.k = pad.k;
    q.stride_a = q.lda * q.cols_a, q.stride_b = q.ldb * q.cols_b, q.stride_d = q.ldd * q.n;  // batch 1
  }

  // cuBLAS's D (N x M, column-major) = op(A) (N x K) * op(B) (K x M), with A from b and B from a.
  const cublasOperation_t op_a = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublaslt::MatmulDesc desc(compute, scale_type);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, static_cast<std::int32_t>(op_a));
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, static_cast<std::int32_t>(op_b));
  if (epi != CUBLASLT_EPILOGUE_DEFAULT) desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, epi);
  if (with_bias) {
    const void* bias_ptr = bias.data_ptr();
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_ptr);
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, std::int64_t{0});
  }
  if (writes_bias) {  // BGRAD: the sums over D's columns (kiln's rows), a vector of N, into it
    void* grad_ptr = bias_in->data_ptr();
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, grad_ptr);
  }
  if (epilogue_has_aux(e)) {  // contiguous like kiln's out: cuBLAS's column-major N x M, ld N
    void* aux_ptr = aux->data_ptr();
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux_ptr);
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.N);
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, p.batch > 1 ? g.M * g.N : std::int64_t{0});
  }
  const auto count = static_cast<std::int32_t>(q.batch);
  cublaslt::Layout layout_a(cuda_type(ab), q.rows_a, q.cols_a, q.lda);
  layout_a.batch(count, q.stride_a);
  cublaslt::Layout layout_b(cuda_type(ab), q.rows_b, q.cols_b, q.ldb);
  layout_b.batch(count, q.stride_b);
  cublaslt::Layout layout_d(cuda_type(dt), q.m, q.n, q.ldd);
  layout_d.batch(count, q.stride_d);

  const std::uint32_t align_a = alignment(pa), align_b = alignment(pb), align_d = alignment(pd);
  const std::uint32_t align_bias = with_bias     ? alignment(bias.data_ptr())
                                   : writes_bias ? alignment(bias_in->data_ptr())
                                                 : 0;
  const std::uint32_t align_aux = epilogue_has_aux(e) ? alignment(aux->data_ptr()) : 0;

  DeviceState& st = state(device);
  cublasLtHandle_t h = handle(device);
  Workspace& workspace_of_stream = workspace(device, stream);
  void* ws = workspace_of_stream.ptr;
  // Held until this matmul's kernels are queued (and, when tuning, timed): see Workspace.
  std::lock_guard queueing(workspace_of_stream.busy);
  const std::vector<std::int64_t> key{static_cast<std::int64_t>(ab),
                                      static_cast<std::int64_t>(dt),
                                      static_cast<std::int64_t>(compute),
                                      static_cast<std::int64_t>(epi),
                                      op_a,
                                      op_b,
                                      q.m,
                                      q.n,
                                      q.k,
                                      q.lda,
                                      q.ldb,
                                      q.ldd,
                                      q.batch,
                                      q.stride_a,
                                      q.stride_b,
                                      q.stride_d,
                                      align_a,
                                      align_b,
                                      align_d,
                                      align_bias,
                                      align_aux,
                                      autotune};
  cublasLtMatmulAlgo_t algo{};
  bool cached = false;
  {
    std::lock_guard lock(st.mutex);
    if (auto it = st.algos.find(key); it != st.algos.end()) {
      algo = it->second;
      cached = true;
    }
  }
  if (!cached) {
    cublaslt::Preference pref;
    pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(workspace_bytes));
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a);
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b);
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d);
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d);
    // Tuning times the heuristic's first answers on the real operands (not while a graph is captured).
    const bool timed = autotune && !(stream && driver::is_capturing(stream));
    constexpr int max_tried = 8;
    cublasLtMatmulHeuristicResult_t results[max_tried] = {};
    int found = 0;
    cublaslt::check(lt.algo_get_heuristic(h, desc.h, layout_a.h, layout_b.h, layout_d.h, layout_d.h, pref.h,
                                          timed ? max_tried : 1, results, &found),
                    "cublasLtMatmulAlgoGetHeuristic");
    if (found == 0)
      throw cuda_error("matmul: cublasLtMatmulAlgoGetHeuristic found no algorithm for " +
                       mm_detail::shapes_of(a_in, b_in) + " into " + std::string(name(out.dtype())));
    algo = results[0].algo;
    const float one = 1.0f, zero = 0.0f;
    const double one64 = 1.0, zero64 = 0.0;
    const void* al = ab == dtype::f64 ? static_cast<const void*>(&one64) : static_cast<const void*>(&one);
    const void* be = ab == dtype::f64 ? static_cast<const void*>(&zero64) : static_cast<const void*>(&zero);
    double best = 0;
    for (int i = 0; timed && found > 1 && i < found; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
      bool failed = false;
      double ms = time_calls_ms(
          [&] {
            failed =
                failed || lt.matmul(h, desc.h, al, pa, layout_a.h, pb, layout_b.h, be, pd, layout_d.h, pd, layout_d.h,
                                    &results[i].algo, ws, workspace_bytes, stream) != CUBLAS_STATUS_SUCCESS;
          },
          stream);
      if (failed || (best > 0 && ms >= best)) continue;
      best = ms;
      algo = results[i].algo;
    }
    if (debug::log_enabled(debug::Channel::autotune) && timed)
      debug::log(debug::Channel::autotune, "matmul " + mm_detail::shapes_of(a_in, b_in) + ": " + std::to_string(found) +
                                               " algorithms timed, fastest " + std::to_string(best) + " ms");
    if (timed || !autotune) {  // an untimed pick under autotune (during a capture) is not kept
      std::lock_guard lock(st.mutex);
      if (st.algos.size() >= max_cached_algos) st.algos.clear();
      st.algos.emplace(key, algo);
    }
  }

  const double alpha64 = 1.0, beta64 = 0.0;
  const float alpha32 = 1.0f, beta32 = 0.0f;
  const void* alpha = ab == dtype::f64 ? static_cast<const void*>(&alpha64) : static_cast<const void*>(&alpha32);
  const void* beta = ab == dtype::f64 ? static_cast<const void*>(&beta64) : static_cast<const void*>(&beta32);
  cublaslt::check(lt.matmul(h, desc.h, alpha, pa, layout_a.h, pb, layout_b.h, beta, pd, layout_d.h, pd, layout_d.h,
                            &algo, ws, workspace_bytes, stream),
                  "cublasLtMatmul");
  if (pad.d && !pad.in_d)  // the product's block of the padded output back into d
    pad_copy(pd, q.m, q.n, q.ldd, d.data_ptr(), p.m, p.n, p.ldd, itemsize(dt), device, stream);
  if (!p.direct) device_copy(d, out, stream);
}

// out = epilogue(a @ b (+ bias)) on CUDA (the contract above). Under autotune with
// KILN_TUNE_GEMM_TEMPLATE=1, the first call of a problem (outside a capture) also times kiln's GEMM template
// (dot_matmul.hpp) at each of its blockings against cuBLASLt's tuned best, each result checked against cuBLASLt's, and
// the faster serves every later call of the problem in this process; the template's kernels compile at that first call
// (NVRTC, in parallel), so tuning a model's GEMMs takes seconds once.
inline void cuda_matmul_epilogue(const Tensor& a, const Tensor& b, const Tensor* bias, Epilogue e, const Tensor& out,
                                 CUstream stream, bool autotune = false, const Tensor* aux = nullptr,
                                 const GemmRooms* rooms = nullptr) {
  auto cublas = [&] { cublaslt_matmul_epilogue(a, b, bias, e, out, stream, autotune, aux, rooms); };
  if (!autotune || !gemm_template_enabled() || !dot_matmul_unsupported(a, b, out, e).empty() ||
      !out.device().is_cuda() || a.device() != out.device() || b.device() != out.device() ||
      (epilogue_has_bias(e) && (!bias || !bias->defined())))
    return cublas();
  const MatmulGeometry g = matmul_geometry(a, b, out, "matmul");
  if (g.batch == 0 || g.M == 0 || g.N == 0) return cublas();
  const DotMatmulPick* pick =
      pick_dot_matmul(g, a, b, bias, e, out, aux, stream, [&] { return time_calls_ms(cublas, stream); });
  if (!pick) return cublas();
  Tensor bias_c;
  if (epilogue_has_bias(e)) bias_c = dot_matmul_bias(*bias, g, out, stream);
  run_dot_matmul(pick->kernel, g, a, b, bias_c.defined() ? &bias_c : nullptr, aux, out, stream, pick);
}

// out = a @ b on CUDA, queued on stream (see cuda_matmul_epilogue).
inline void cuda_matmul(const Tensor& a, const Tensor& b, const Tensor& out, CUstream stream, bool autotune = false,
                        const GemmRooms* rooms = nullptr) {
  cuda_matmul_epilogue(a, b, nullptr, Epilogue::none, out, stream, autotune, nullptr, rooms);
}

}  // namespace kiln::runtime
