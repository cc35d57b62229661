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
#pragma once
#include <cublasLt.h>  // types and prototypes only: libcublasLt is never linked
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../../core/config.hpp"
#include "../../core/driver.hpp"
#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/tensor.hpp"
#include "../../debug/log.hpp"
#include "../compile/nvrtc.hpp"
#include "../launch/cuda_module.hpp"
#include "cpu_matmul.hpp"

namespace kiln::runtime {

// What cuBLASLt applies to the product before storing it. bias adds a vector of N (one value per
// output column, broadcast over rows and batches). cuBLASLt's GELU is the tanh approximation, so
// only k::gelu(x, k::approximate::tanh) may be fused into gelu_tanh*; exact gelu may not.
enum class Epilogue { none, bias, relu, relu_bias, gelu_tanh, gelu_tanh_bias };

constexpr bool epilogue_has_bias(Epilogue e) {
  return e == Epilogue::bias || e == Epilogue::relu_bias || e == Epilogue::gelu_tanh_bias;
}

namespace cublaslt {

// X(member, symbol): the cuBLASLt entry points kiln uses.
#define KILN_CUBLASLT_FUNCTIONS(X)                                  \
  X(create, cublasLtCreate)                                         \
  X(matmul_desc_create, cublasLtMatmulDescCreate)                   \
  X(matmul_desc_destroy, cublasLtMatmulDescDestroy)                 \
  X(matmul_desc_set_attribute, cublasLtMatmulDescSetAttribute)      \
  X(layout_create, cublasLtMatrixLayoutCreate)                      \
  X(layout_destroy, cublasLtMatrixLayoutDestroy)                    \
  X(layout_set_attribute, cublasLtMatrixLayoutSetAttribute)         \
  X(preference_create, cublasLtMatmulPreferenceCreate)              \
  X(preference_destroy, cublasLtMatmulPreferenceDestroy)            \
  X(preference_set_attribute, cublasLtMatmulPreferenceSetAttribute) \
  X(algo_get_heuristic, cublasLtMatmulAlgoGetHeuristic)             \
  X(matmul, cublasLtMatmul)

struct Api {
#define KILN_CUBLASLT_MEMBER(member, symbol) decltype(&::symbol) member = nullptr;
  KILN_CUBLASLT_FUNCTIONS(KILN_CUBLASLT_MEMBER)
#undef KILN_CUBLASLT_MEMBER
  decltype(&::cublasLtGetStatusName) get_status_name = nullptr;  // optional
};

namespace detail {

struct Loaded {
  Api api;
  std::string error;
};

inline Loaded load() {
  Loaded l;
  std::string why;
  void* lib = nullptr;
  for (const char* name : {"libcublasLt.so.13", "libcublasLt.so"}) {
    lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib) break;
    const char* e = dlerror();
    why += std::string(why.empty() ? "" : "; ") + name + ": " + (e ? e : "unknown reason");
  }
  if (!lib) {
    l.error =
        "matmul: cuBLASLt is not available (libcublasLt.so.13 or libcublasLt.so could not be loaded: " + why + ")";
    return l;
  }
  std::string missing;
#define KILN_CUBLASLT_BIND(member, symbol)                                      \
  l.api.member = reinterpret_cast<decltype(l.api.member)>(dlsym(lib, #symbol)); \
  if (!l.api.member) missing += (missing.empty() ? "" : ", ") + std::string(#symbol);
  KILN_CUBLASLT_FUNCTIONS(KILN_CUBLASLT_BIND)
#undef KILN_CUBLASLT_BIND
  l.api.get_status_name = reinterpret_cast<decltype(l.api.get_status_name)>(dlsym(lib, "cublasLtGetStatusName"));
  if (!missing.empty()) l.error = "matmul: the loaded libcublasLt is too old for kiln (it lacks " + missing + ")";
  return l;
}

inline const Loaded& loaded() {
  static const Loaded l = load();
  return l;
}

}  // namespace detail

// True when libcublasLt loads and has every entry point kiln needs.
inline bool available() noexcept {
  try {
    return detail::loaded().error.empty();
  } catch (...) {
    return false;
  }
}

// The entry points; a kiln::device_error naming the library when it cannot be loaded.
inline const Api& api() {
  const detail::Loaded& l = detail::loaded();
  if (!l.error.empty()) [[unlikely]]
    throw device_error(l.error);
  return l.api;
}

inline std::string status_text(cublasStatus_t s) {
  const Api& a = detail::loaded().api;
  const char* name = a.get_status_name ? a.get_status_name(s) : nullptr;
  return name ? std::string(name) + " (" + std::to_string(static_cast<int>(s)) + ")"
              : "cublasStatus_t " + std::to_string(static_cast<int>(s));
}

// Throws kiln::cuda_error("matmul: <fn> failed: <status>") unless s is CUBLAS_STATUS_SUCCESS.
inline void check(cublasStatus_t s, const char* fn) {
  if (s != CUBLAS_STATUS_SUCCESS) [[unlikely]]
    throw cuda_error(std::string("matmul: ") + fn + " failed: " + status_text(s));
}

// Descriptors released however the call ends.
struct MatmulDesc {
  cublasLtMatmulDesc_t h = nullptr;
  MatmulDesc(cublasComputeType_t compute, cudaDataType_t scale) {
    check(api().matmul_desc_create(&h, compute, scale), "cublasLtMatmulDescCreate");
  }
  ~MatmulDesc() {
    if (h) api().matmul_desc_destroy(h);
  }
  template <class V>
  void set(cublasLtMatmulDescAttributes_t attr, const V& value) {
    check(api().matmul_desc_set_attribute(h, attr, &value, sizeof(V)), "cublasLtMatmulDescSetAttribute");
  }
  MatmulDesc(const MatmulDesc&) = delete;
  MatmulDesc& operator=(const MatmulDesc&) = delete;
};

struct Layout {
  cublasLtMatrixLayout_t h = nullptr;
  Layout(cudaDataType_t type, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
    check(api().layout_create(&h, type, static_cast<std::uint64_t>(rows), static_cast<std::uint64_t>(cols), ld),
          "cublasLtMatrixLayoutCreate");
  }
  ~Layout() {
    if (h) api().layout_destroy(h);
  }
  template <class V>
  void set(cublasLtMatrixLayoutAttribute_t attr, const V& value) {
    check(api().layout_set_attribute(h, attr, &value, sizeof(V)), "cublasLtMatrixLayoutSetAttribute");
  }
  void batch(std::int32_t count, std::int64_t stride) {
    if (count <= 1) return;
    set(CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, count);
    set(CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride);
  }
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;
};

struct Preference {
  cublasLtMatmulPreference_t h = nullptr;
  Preference() { check(api().preference_create(&h), "cublasLtMatmulPreferenceCreate"); }
  ~Preference() {
    if (h) api().preference_destroy(h);
  }
  template <class V>
  void set(cublasLtMatmulPreferenceAttributes_t attr, const V& value) {
    check(api().preference_set_attribute(h, attr, &value, sizeof(V)), "cublasLtMatmulPreferenceSetAttribute");
  }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
};

}  // namespace cublaslt

namespace cuda_mm_detail {

inline constexpr std::size_t workspace_bytes = std::size_t(32) << 20;
inline constexpr std::size_t max_cached_algos = 4096;

// The strided copy-and-convert kernels, one per (source, destination) dtype among f64/f32/f16/bf16:
// kiln_mm_copy_<src>_<dst>(src, dst, n, d1, d2, src strides[3], dst strides[3]) over a 3-D index space.
inline const char* copy_kernel_source() {
  return R"(#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef long long kiln_i64;
__device__ __forceinline__ double kiln_to_double(double x) { return x; }
__device__ __forceinline__ double kiln_to_double(float x) { return static_cast<double>(x); }
__device__ __forceinline__ double kiln_to_double(__half x) { return static_cast<double>(__half2float(x)); }
__device__ __forceinline__ double kiln_to_double(__nv_bfloat16 x) { return static_cast<double>(__bfloat162float(x)); }
template <class T> __device__ __forceinline__ T kiln_from_double(double x);
template <> __device__ __forceinline__ double kiln_from_double<double>(double x) { return x; }
template <> __device__ __forceinline__ float kiln_from_double<float>(double x) { return static_cast<float>(x); }
template <> __device__ __forceinline__ __half kiln_from_double<__half>(double x) { return __double2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 kiln_from_double<__nv_bfloat16>(double x) { return __double2bfloat16(x); }
template <class S, class D>
__device__ __forceinline__ void kiln_copy(const S* __restrict__ src, D* __restrict__ dst, kiln_i64 n, kiln_i64 d1,
                                          kiln_i64 d2, kiln_i64 s0, kiln_i64 s1, kiln_i64 s2, kiln_i64 t0,
                                          kiln_i64 t1, kiln_i64 t2) {
  const kiln_i64 step = static_cast<kiln_i64>(gridDim.x) * blockDim.x;
  for (kiln_i64 i = static_cast<kiln_i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const kiln_i64 i2 = i % d2, r = i / d2, i1 = r % d1, i0 = r / d1;
    dst[i0 * t0 + i1 * t1 + i2 * t2] = kiln_from_double<D>(kiln_to_double(src[i0 * s0 + i1 * s1 + i2 * s2]));
  }
}
#define KILN_MM_COPY(SN, S, DN, D)                                                                            \
  extern "C" __global__ void kiln_mm_copy_##SN##_##DN(const S* src, D* dst, kiln_i64 n, kiln_i64 d1,         \
                                                     kiln_i64 d2, kiln_i64 s0, kiln_i64 s1, kiln_i64 s2,      \
                                                     kiln_i64 t0, kiln_i64 t1, kiln_i64 t2) {                 \
    kiln_copy<S, D>(src, dst, n, d1, d2, s0, s1, s2, t0, t1, t2);                                             \
  }
#define KILN_MM_COPY_TO(DN, D) \
  KILN_MM_COPY(f64, double, DN, D) KILN_MM_COPY(f32, float, DN, D) \
  KILN_MM_COPY(f16, __half, DN, D) KILN_MM_COPY(bf16, __nv_bfloat16, DN, D)
KILN_MM_COPY_TO(f64, double)
KILN_MM_COPY_TO(f32, float)
KILN_MM_COPY_TO(f16, __half)
KILN_MM_COPY_TO(bf16, __nv_bfloat16)
)";
}

inline std::string copy_kernel_name(dtype src, dtype dst) {
  return "kiln_mm_copy_" + std::string(name(src)) + "_" + std::string(name(dst));
}

// A workspace of one stream. cuBLASLt may run one matmul as several kernels that pass partial sums
// through it (split K), so two host threads queueing matmuls on one stream (the default stream, say)
// must not interleave their kernels: each holds `busy` while it queues one matmul.
struct Workspace {
  void* ptr = nullptr;
  std::mutex busy;
};

// cuBLASLt's state for one device: its handle, the copy kernels, a workspace per stream and the
// heuristic's answers per problem.
struct DeviceState {
  std::once_flag handle_once;
  cublasLtHandle_t handle = nullptr;
  std::once_flag copy_once;
  Module* copy_module = nullptr;  // never unloaded: the driver may be gone at exit
  CUfunction copy_fns[4][4] = {};
  std::mutex mutex;
  std::map<CUstream, std::unique_ptr<Workspace>> workspaces;  // never freed: captured graphs may still point at them
  std::map<std::vector<std::int64_t>, cublasLtMatmulAlgo_t> algos;
};

inline DeviceState& state(int device) {
  static std::once_flag made;
  static DeviceState* states = nullptr;  // never destroyed, like the caching allocator
  std::call_once(made, [] { states = new DeviceState[driver::device_count()]; });
  driver::require_device(device);
  return states[device];
}

inline cublasLtHandle_t handle(int device) {
  DeviceState& s = state(device);
  std::call_once(s.handle_once, [&] {
    driver::make_current(device);
    cublasLtHandle_t h = nullptr;
    cublaslt::check(cublaslt::api().create(&h), "cublasLtCreate");
    s.handle = h;
  });
  return s.handle;
}

// The workspace for work queued on this stream (one per stream, so concurrent streams never share;
// threads sharing a stream take turns through its `busy` mutex).
inline Workspace& workspace(int device, CUstream stream) {
  DeviceState& s = state(device);
  std::lock_guard lock(s.mutex);
  auto it = s.workspaces.find(stream);
  if (it != s.workspaces.end()) return *it->second;
  auto w = std::make_unique<Workspace>();
  w->ptr = driver::allocate(workspace_bytes, device, stream);
  return *s.workspaces.emplace(stream, std::move(w)).first->second;
}

inline CUfunction copy_function(int device, dtype src, dtype dst) {
  DeviceState& s = state(device);
  std::call_once(s.copy_once, [&] {
    std::vector<char> cubin = compile_cubin(copy_kernel_source(), "kiln_mm_copy", driver::arch(device));
    auto module = std::make_unique<Module>(cubin, device);
    const dtype types[4] = {dtype::f64, dtype::f32, dtype::f16, dtype::bf16};
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) s.copy_fns[i][j] = module->function(copy_kernel_name(types[i], types[j]).c_str());
    s.copy_module = module.release();
  });
  return s.copy_fns[static_cast<int>(src)][static_cast<int>(dst)];
}

// Copies src into dst (same shape, rank <= 3, any strides, floating dtypes, converting) on stream.
inline void device_copy(const Tensor& src, const Tensor& dst, CUstream stream) {
  if (!(src.shape() == dst.shape()) || src.dim() > 3)
    throw shape_error("matmul: internal copy from " + src.shape().str() + " to " + dst.shape().str());
  const std::int64_t n = src.numel();
  if (n == 0) return;
  std::int64_t d[3] = {1, 1, 1}, s[3] = {0, 0, 0}, t[3] = {0, 0, 0};
  for (int i = 0, o = 3 - src.dim(); i < src.dim(); ++i) {
    d[o + i] = src.shape()[i];
    s[o + i] = src.strides()[i];
    t[o + i] = dst.strides()[i];
  }
  const int device = dst.device().index;
  CUfunction f = copy_function(device, src.dtype(), dst.dtype());
  driver::make_current(device);
  const void* sp = src.data_ptr();
  void* dp = dst.data_ptr();
  void* args[] = {&sp, &dp, const_cast<std::int64_t*>(&n), &d[1], &d[2], &s[0], &s[1], &s[2], &t[0], &t[1], &t[2]};
  const std::int64_t threads = 256;
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((n + threads - 1) / threads, 65535));
  launch(f, Dim3{blocks}, Dim3{static_cast<unsigned>(threads)}, 0, stream, args, "kiln_mm_copy");
}

// A contiguous copy of t in dtype d, on t's device.
inline Tensor contiguous_as(const Tensor& t, dtype d, CUstream stream) {
  Tensor c = Tensor::empty(t.shape(), d, t.device(), Stream(stream));
  device_copy(t, c, stream);
  return c;
}

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

inline bool allow_tf32() {
  static const bool allowed = [] {
    const char* v = kiln::config::env("KILN_ALLOW_TF32");
    return v && std::string(v) == "1";
  }();
  return allowed;
}

// The largest power of two (up to 256) dividing the address: what the heuristic may assume.
inline std::uint32_t alignment(const void* p) {
  auto v = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t a = 256;
  while (a > 1 && v % a) a /= 2;
  return a;
}

// How a row-major-view R x C matrix with strides (sr, sc) reads in cuBLAS's column-major view:
// stored row-major, the memory is the column-major C x R matrix X^T (op N); stored column-major,
// it is X itself, R x C (op T), which cuBLAS transposes. ok = false: neither, copy it first.
struct OperandLayout {
  bool ok = false;
  bool transpose = false;  // op T
  std::int64_t rows = 0, cols = 0, ld = 0;
};

inline OperandLayout classify(std::int64_t R, std::int64_t C, std::int64_t sr, std::int64_t sc) {
  const std::int64_t r1 = std::max<std::int64_t>(R, 1), c1 = std::max<std::int64_t>(C, 1);
  if ((sc == 1 || C == 1) && (R == 1 || sr >= c1)) return {true, false, C, R, R == 1 ? c1 : sr};
  if ((sr == 1 || R == 1) && (C == 1 || sc >= r1)) return {true, true, R, C, C == 1 ? r1 : sc};
  return {};
}

}  // namespace cuda_mm_detail

// How one matmul maps onto a single strided-batched cuBLASLt call: cuBLAS's D (m x n, column-major,
// m = N, n = M) = op_a(A) (m x k) * op_b(B) (k x n), where A is kiln's b and B is kiln's a.
// Pure host logic, so tests can check it against a host emulation of cuBLAS's semantics.
struct GemmPlan {
  bool copy_a = false, copy_b = false;    // kiln's a / b go through a contiguous copy first
  bool direct = true;                     // cuBLAS writes kiln's out in place (else a contiguous temporary)
  bool trans_a = false, trans_b = false;  // op T for cuBLAS's A (from b) / B (from a)
  std::int64_t m = 0, n = 0, k = 0;
  std::int64_t rows_a = 0, cols_a = 0, lda = 0;  // cuBLAS's A as stored
  std::int64_t rows_b = 0, cols_b = 0, ldb = 0;  // cuBLAS's B as stored
  std::int64_t ldd = 0;
  std::int64_t batch = 1, stride_a = 0, stride_b = 0, stride_d = 0;
};

// g describes the operands as given (K > 0); a_ok / b_ok say whether their dtypes can be used as
// they are, out_ok whether out's dtype is the one cuBLAS will write.
inline GemmPlan plan_gemm(MatmulGeometry g, bool a_ok, bool b_ok, bool out_ok) {
  using namespace cuda_mm_detail;
  GemmPlan p;
  OperandLayout la = classify(g.M, g.K, g.a_sm, g.a_sk);
  if (!la.ok || !a_ok) {
    p.copy_a = true;
    g.a_sm = g.K, g.a_sk = 1;
    g.a_bs = g.a_bs == 0 ? 0 : g.M * g.K;
    la = classify(g.M, g.K, g.a_sm, g.a_sk);
  }
  OperandLayout lb = classify(g.K, g.N, g.b_sk, g.b_sn);
  if (!lb.ok || !b_ok) {
    p.copy_b = true;
    g.b_sk = g.N, g.b_sn = 1;
    g.b_bs = g.b_bs == 0 ? 0 : g.K * g.N;
    lb = classify(g.K, g.N, g.b_sk, g.b_sn);
  }
  p.direct = out_ok && (g.o_sn == 1 || g.N == 1) && (g.M == 1 || g.o_sm >= g.N);
  p.ldd = p.direct ? (g.M == 1 ? std::max<std::int64_t>(g.N, 1) : g.o_sm) : g.N;
  p.stride_d = p.direct ? g.o_bs : g.M * g.N;
  p.batch = g.batch;
  std::int64_t M = g.M;
  // A 2-D b under a batch of row-major a whose batches (and out's) lie back to back: one GEMM of
  // batch * M rows.
  if (p.batch > 1 && g.b_bs == 0 && g.a_bs != 0 && !la.transpose && g.a_bs == g.M * la.ld &&
      p.stride_d == g.M * p.ldd) {
    M = p.batch * g.M;
    p.batch = 1;
    la.cols = M;
  }
  p.trans_a = lb.transpose, p.rows_a = lb.rows, p.cols_a = lb.cols, p.lda = lb.ld;
  p.trans_b = la.transpose, p.rows_b = la.rows, p.cols_b = la.cols, p.ldb = la.ld;
  p.m = g.N, p.n = M, p.k = g.K;
  p.stride_a = g.b_bs, p.stride_b = g.a_bs;
  return p;
}

// out = epilogue(a @ b (+ bias)) on CUDA, queued on stream. Same contract as cpu_matmul: a [M,K]
// or [B,M,K], b [K,N] or [B,K,N] (broadcasting a 2-D operand or a batch of 1), out [M,N] or
// [B,M,N] allocated with the result dtype; any strides, dtypes f64/f32/f16/bf16. f32 accumulates in
// f32 (TF32 only when KILN_ALLOW_TF32=1), f16/bf16 in f32, f64 in f64. bias is a vector of N
// (shape [N], or [1, ..., N]) on the same device, required by the *_bias epilogues. Never
// synchronises; temporaries are freed stream-ordered on stream. out must not overlap a, b or bias.
// autotune: the first call of a problem times cuBLASLt's best few algorithms on these operands
// (synchronising) and keeps the fastest, instead of taking the heuristic's first answer.
inline void cuda_matmul_epilogue(const Tensor& a_in, const Tensor& b_in, const Tensor* bias_in, Epilogue e,
                                 const Tensor& out, CUstream stream, bool autotune = false) {
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
  if (g.batch == 0 || g.M == 0 || g.N == 0) return;
  if (g.batch > INT32_MAX)
    throw shape_error("matmul: a batch of " + std::to_string(g.batch) + " is too large for cuBLASLt");
  const int device = dev.index;
  driver::make_current(device);
  const cublaslt::Api& lt = cublaslt::api();
  const Stream s(stream);

  // Types: cuBLASLt multiplies two operands of one type into f32 or that type.
  const dtype ab = a_in.dtype() == dtype::f64 || b_in.dtype() == dtype::f64 ? dtype::f64
                   : a_in.dtype() == b_in.dtype()                           ? a_in.dtype()
                                                                            : dtype::f32;
  const dtype dt = (ab == dtype::f16 || ab == dtype::bf16) && out.dtype() != ab ? dtype::f32 : ab;
  const bool tf32 = ab == dtype::f32 && allow_tf32();
  const cublasComputeType_t compute = ab == dtype::f64 ? CUBLAS_COMPUTE_64F
                                      : tf32           ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                       : CUBLAS_COMPUTE_32F;
  const cudaDataType_t scale_type = ab == dtype::f64 ? CUDA_R_64F : CUDA_R_32F;

  // K = 0: the product is zero (plus any epilogue); multiply zero operands of K = 1 instead.
  Tensor a = a_in, b = b_in;
  if (g.K == 0) {
    a = Tensor::empty({g.M, 1}, ab, dev, s);
    b = Tensor::empty({1, g.N}, ab, dev, s);
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
  Tensor d = p.direct ? out : Tensor::empty(out.shape(), dt, dev, s);

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
  const auto count = static_cast<std::int32_t>(p.batch);
  cublaslt::Layout layout_a(cuda_type(ab), p.rows_a, p.cols_a, p.lda);
  layout_a.batch(count, p.stride_a);
  cublaslt::Layout layout_b(cuda_type(ab), p.rows_b, p.cols_b, p.ldb);
  layout_b.batch(count, p.stride_b);
  cublaslt::Layout layout_d(cuda_type(dt), p.m, p.n, p.ldd);
  layout_d.batch(count, p.stride_d);

  const void* pa = b.data_ptr();  // cuBLAS's A
  const void* pb = a.data_ptr();  // cuBLAS's B
  void* pd = d.data_ptr();
  const std::uint32_t align_a = alignment(pa), align_b = alignment(pb), align_d = alignment(pd);
  const std::uint32_t align_bias = with_bias ? alignment(bias.data_ptr()) : 0;

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
                                      p.m,
                                      p.n,
                                      p.k,
                                      p.lda,
                                      p.ldb,
                                      p.ldd,
                                      p.batch,
                                      p.stride_a,
                                      p.stride_b,
                                      p.stride_d,
                                      align_a,
                                      align_b,
                                      align_d,
                                      align_bias,
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
            failed = failed || lt.matmul(h, desc.h, al, b.data_ptr(), layout_a.h, a.data_ptr(), layout_b.h, be,
                                         d.data_ptr(), layout_d.h, d.data_ptr(), layout_d.h, &results[i].algo, ws,
                                         workspace_bytes, stream) != CUBLAS_STATUS_SUCCESS;
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
  if (!p.direct) device_copy(d, out, stream);
}

// out = a @ b on CUDA, queued on stream (see cuda_matmul_epilogue).
inline void cuda_matmul(const Tensor& a, const Tensor& b, const Tensor& out, CUstream stream, bool autotune = false) {
  cuda_matmul_epilogue(a, b, nullptr, Epilogue::none, out, stream, autotune);
}

}  // namespace kiln::runtime
