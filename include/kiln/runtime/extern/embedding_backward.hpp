// The extern step of embedding_backward(g [P.., D], ids [P..]) -> [V, D]: row v of the result is
// the sum of g's rows at the positions holding v, added in position order. That order makes the
// result deterministic (the same bits every run, on the CPU and the GPU alike: both accumulate in
// the compute dtype in the same order and round once), where a scatter with atomics would not be.
//
// On the GPU the positions are sorted by (id, position) — a bitonic sort of 64-bit keys
// id * P + position, whose result does not depend on how the sort proceeds — the result is zeroed,
// and the first position of each run of one id sums the run into its row. Ids outside [0, V)
// contribute nothing (the forward read zeros there; with index checks on, the program rejected
// them before running). (A block a row that looked its run up by binary search took 401 us of
// GPT-2's step on an H200, 50257 rows of two dependent searches each; NOTES item 143.)
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../../core/driver.hpp"
#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/tensor.hpp"
#include "../compile/nvrtc.hpp"
#include "../launch/capture_keep.hpp"
#include "../launch/cuda_module.hpp"

namespace kiln::runtime {
namespace embedding_detail {

inline void check_operands(const Tensor& g, const Tensor& ids, const Tensor& out) {
  if (!g.is_contiguous() || !ids.is_contiguous() || !out.is_contiguous())
    throw error("embedding_backward: operands must be contiguous (lowering copies strided arguments)");
  if (ids.dtype() != dtype::i64 && ids.dtype() != dtype::i32)
    throw dtype_error("embedding_backward: ids must be i64 or i32, got " + std::string(name(ids.dtype())));
}

// ---- CPU ------------------------------------------------------------------------------------------
inline void cpu(const Tensor& g, const Tensor& ids, Tensor& out) {
  check_operands(g, ids, out);
  const std::int64_t P = ids.numel(), V = out.shape()[0], D = out.shape()[1];
  visit_dtype(g.dtype(), [&](auto t) {
    using T = decltype(t);
    if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16>) {
      using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
      std::vector<Acc> acc(static_cast<std::size_t>(V * D), Acc(0));
      const T* gp = static_cast<const T*>(g.data_ptr());
      for (std::int64_t p = 0; p < P; ++p) {
        const auto v = static_cast<std::int64_t>(load_as_double(ids.data_ptr(), ids.dtype(), p));
        if (v < 0 || v >= V) continue;
        for (std::int64_t d = 0; d < D; ++d) acc[v * D + d] += static_cast<Acc>(gp[p * D + d]);
      }
      T* op = static_cast<T*>(out.data_ptr());
      for (std::int64_t i = 0; i < V * D; ++i) op[i] = T(acc[i]);
    } else {
      throw dtype_error("embedding_backward: the gradient must be floating, got " + std::string(name(g.dtype())));
    }
  });
}

// ---- CUDA -----------------------------------------------------------------------------------------
inline constexpr int sort_chunk = 2048;  // keys a block sorts in shared memory (16 KiB)

inline const char* kernel_source() {
  return R"(#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef long long i64;
typedef unsigned long long u64;
#define CHUNK 2048

// key = id * P + position; ids outside [0, V) and the padding sort last.
template <class I>
__device__ void keys(const I* ids, u64* out, i64 P, i64 n, i64 V) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    u64 key = ~0ull;
    if (i < P) {
      i64 v = (i64)ids[i];
      key = (u64)((v >= 0 && v < V) ? v : V) * (u64)P + (u64)i;
    }
    out[i] = key;
  }
}
extern "C" __global__ void kiln_emb_keys_i64(const i64* ids, u64* out, i64 P, i64 n, i64 V) { keys(ids, out, P, n, V); }
extern "C" __global__ void kiln_emb_keys_i32(const int* ids, u64* out, i64 P, i64 n, i64 V) { keys(ids, out, P, n, V); }

__device__ __forceinline__ void order(u64& a, u64& b, bool up) {
  if ((a > b) == up) { u64 t = a; a = b; b = t; }
}
// Bitonic steps of stage k with partner distances j <= jmax, inside each chunk held in shared memory.
__device__ void chunk_steps(u64* keys, i64 n, i64 k0, i64 k1, int jmax0) {
  __shared__ u64 s[CHUNK];
  const i64 base = (i64)blockIdx.x * CHUNK;
  const int len = (int)(n - base < CHUNK ? n - base : CHUNK);
  for (int t = threadIdx.x; t < len; t += blockDim.x) s[t] = keys[base + t];
  __syncthreads();
  for (i64 k = k0; k <= k1; k *= 2)
    for (int j = (int)(k / 2 < jmax0 ? k / 2 : jmax0); j >= 1; j /= 2) {
      for (int t = threadIdx.x; t < len / 2; t += blockDim.x) {
        int lo = 2 * t - (t & (j - 1)), hi = lo + j;
        order(s[lo], s[hi], ((base + lo) & k) == 0);
      }
      __syncthreads();
    }
  for (int t = threadIdx.x; t < len; t += blockDim.x) keys[base + t] = s[t];
}
// Sorts each chunk (stages 2 .. min(n, CHUNK)), alternating directions as the global sort needs.
extern "C" __global__ void kiln_emb_sort_chunks(u64* keys, i64 n) { chunk_steps(keys, n, 2, n < CHUNK ? n : CHUNK, CHUNK); }
// One step of stage k at distance j >= CHUNK, over the whole array.
extern "C" __global__ void kiln_emb_sort_step(u64* keys, i64 n, i64 j, i64 k) {
  for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < n / 2; t += (i64)gridDim.x * blockDim.x) {
    i64 lo = 2 * t - (t & (j - 1)), hi = lo + j;
    u64 a = keys[lo], b = keys[hi];
    order(a, b, (lo & k) == 0);
    keys[lo] = a;
    keys[hi] = b;
  }
}
// The steps of stage k at distances below CHUNK, in shared memory.
extern "C" __global__ void kiln_emb_sort_merge(u64* keys, i64 n, i64 k) { chunk_steps(keys, n, k, k, CHUNK / 2); }

__device__ __forceinline__ float acc_of(float x) { return x; }
__device__ __forceinline__ double acc_of(double x) { return x; }
__device__ __forceinline__ float acc_of(__half x) { return __half2float(x); }
__device__ __forceinline__ float acc_of(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> __device__ __forceinline__ T store_of(float x) { return (T)x; }
template <> __device__ __forceinline__ double store_of<double>(float x) { return x; }
template <> __device__ __forceinline__ __half store_of<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 store_of<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ double store_of_d(double x) { return x; }

// The run of sorted keys starting at s (its first, or none): its id's row, the sum of g's rows
// at the run's positions, in position order. Rows of ids no position holds stay zero.
template <class T, class A>
__device__ void rows(const u64* keys, const T* g, T* out, i64 P, i64 V, i64 D) {
  for (i64 s = blockIdx.x; s < P; s += gridDim.x) {
    const i64 v = (i64)(keys[s] / (u64)P);
    if (v >= V || (s > 0 && (i64)(keys[s - 1] / (u64)P) == v)) continue;
    i64 hi = s + 1;
    while (hi < P && (i64)(keys[hi] / (u64)P) == v) ++hi;
    for (i64 d = threadIdx.x; d < D; d += blockDim.x) {
      A acc = 0;
      for (i64 t = s; t < hi; ++t) acc += acc_of(g[(i64)(keys[t] - (u64)v * (u64)P) * D + d]);
      if constexpr (sizeof(A) == 8) out[v * D + d] = store_of_d(acc); else out[v * D + d] = store_of<T>(acc);
    }
  }
}
#define KILN_EMB_ROWS(N, T, A) \
  extern "C" __global__ void kiln_emb_rows_##N(const u64* keys, const T* g, T* out, i64 P, i64 V, i64 D) { rows<T, A>(keys, g, out, P, V, D); }
KILN_EMB_ROWS(f64, double, double)
KILN_EMB_ROWS(f32, float, float)
KILN_EMB_ROWS(f16, __half, float)
KILN_EMB_ROWS(bf16, __nv_bfloat16, float)
)";
}

struct Functions {
  std::unique_ptr<Module> module;
  CUfunction keys_i64 = nullptr, keys_i32 = nullptr, sort_chunks = nullptr, sort_step = nullptr, sort_merge = nullptr;
  CUfunction rows[4] = {};  // f64, f32, f16, bf16 (dtype order)
};

inline const Functions& functions(int device) {
  static std::mutex mutex;
  static std::vector<std::unique_ptr<Functions>>* per_device =
      new std::vector<std::unique_ptr<Functions>>();  // never unloaded
  std::lock_guard lock(mutex);
  if (per_device->size() <= static_cast<std::size_t>(device)) per_device->resize(static_cast<std::size_t>(device) + 1);
  auto& f = (*per_device)[static_cast<std::size_t>(device)];
  if (!f) {
    auto made = std::make_unique<Functions>();
    made->module = std::make_unique<Module>(compile_cubin(kernel_source(), "kiln_emb", driver::arch(device)), device);
    made->keys_i64 = made->module->function("kiln_emb_keys_i64");
    made->keys_i32 = made->module->function("kiln_emb_keys_i32");
    made->sort_chunks = made->module->function("kiln_emb_sort_chunks");
    made->sort_step = made->module->function("kiln_emb_sort_step");
    made->sort_merge = made->module->function("kiln_emb_sort_merge");
    const char* rows[4] = {"kiln_emb_rows_f64", "kiln_emb_rows_f32", "kiln_emb_rows_f16", "kiln_emb_rows_bf16"};
    for (int i = 0; i < 4; ++i) made->rows[i] = made->module->function(rows[i]);
    f = std::move(made);
  }
  return *f;
}

inline void cuda(const Tensor& g, const Tensor& ids, Tensor& out, CUstream stream) {
  check_operands(g, ids, out);
  const int device = out.device().index;
  const Functions& f = functions(device);
  driver::make_current(device);
  std::int64_t P = ids.numel(), V = out.shape()[0], D = out.shape()[1];
  if (V * D == 0) return;
  std::int64_t n = 2;  // keys, padded to a power of two
  while (n < P) n *= 2;
  Tensor keys = capture_temporary(Dims{n}, dtype::i64, out.device(), stream);
  void* kp = keys.data_ptr();
  const void* ip = ids.data_ptr();
  auto blocks_for = [](std::int64_t work, int threads) {
    return static_cast<unsigned>(std::clamp<std::int64_t>((work + threads - 1) / threads, 1, 65535));
  };
  {
    void* args[] = {&ip, &kp, &P, &n, &V};
    launch(ids.dtype() == dtype::i64 ? f.keys_i64 : f.keys_i32, Dim3{blocks_for(n, 256)}, Dim3{256}, 0, stream, args,
           "kiln_emb_keys");
  }
  const unsigned chunks = static_cast<unsigned>((n + sort_chunk - 1) / sort_chunk);
  {
    void* args[] = {&kp, &n};
    launch(f.sort_chunks, Dim3{chunks}, Dim3{1024}, 0, stream, args, "kiln_emb_sort_chunks");
  }
  for (std::int64_t k = 2 * sort_chunk; k <= n; k *= 2) {
    for (std::int64_t j = k / 2; j >= sort_chunk; j /= 2) {
      void* args[] = {&kp, &n, &j, &k};
      launch(f.sort_step, Dim3{blocks_for(n / 2, 256)}, Dim3{256}, 0, stream, args, "kiln_emb_sort_step");
    }
    void* args[] = {&kp, &n, &k};
    launch(f.sort_merge, Dim3{chunks}, Dim3{1024}, 0, stream, args, "kiln_emb_sort_merge");
  }
  const void* gp = g.data_ptr();
  void* op = out.data_ptr();
  driver::memset_async(op, 0, out.nbytes(), stream);  // rows of ids no position holds (0 bits: 0.0)
  if (P == 0) return;
  void* args[] = {&kp, &gp, &op, &P, &V, &D};
  const int threads = static_cast<int>(std::clamp<std::int64_t>((D + 31) / 32 * 32, 32, 256));
  launch(f.rows[static_cast<int>(g.dtype())], Dim3{static_cast<unsigned>(std::min<std::int64_t>(P, 1 << 20))},
         Dim3{static_cast<unsigned>(threads)}, 0, stream, args, "kiln_emb_rows");
}

}  // namespace embedding_detail

// Runs embedding_backward into `out` ([V, D], allocated by the program).
inline void embedding_backward(const Tensor& g, const Tensor& ids, Tensor& out, CUstream stream) {
  if (out.device().is_cpu())
    embedding_detail::cpu(g, ids, out);
  else
    embedding_detail::cuda(g, ids, out, stream);
}

}  // namespace kiln::runtime
