// The strided copy-and-convert kernel that cuda_matmul runs on operands cuBLASLt cannot read in place:
// its NVRTC source, compiled once per device, and device_copy / contiguous_as, which launch it.
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
#include "cuda_matmul_state.hpp"

namespace kiln::runtime {
namespace cuda_mm_detail {

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
// A column-major rows_d x cols_d block of dst (leading dimension ldd) from src's rows_s x cols_s
// (lds), zeros past src's edges: padded GEMM operands and their results copied back. Bits are
// copied (no conversion). A block moves 16 bytes a thread of one column through shared memory: as
// one vector a thread on a side whose address allows it (the padded side always does), else
// element by element with neighbouring threads on neighbouring elements (a leading dimension off
// 16 bytes), so that both sides' accesses coalesce. Launched with 256 threads.
template <class T>
__device__ __forceinline__ void kiln_pad(const T* __restrict__ src, T* __restrict__ dst, kiln_i64 rows_s,
                                         kiln_i64 cols_s, kiln_i64 lds, kiln_i64 rows_d, kiln_i64 cols_d,
                                         kiln_i64 ldd) {
  constexpr int V = 16 / sizeof(T), THREADS = 256, SPAN = THREADS * V;
  __shared__ uint4 stage[THREADS];
  T* tile = reinterpret_cast<T*>(stage);
  const int t = threadIdx.x;
  for (kiln_i64 c = blockIdx.y; c < cols_d; c += gridDim.y) {
    const T* from = src + c * lds;
    T* to = dst + c * ldd;
    const bool from_vectors = reinterpret_cast<unsigned long long>(from) % 16 == 0;
    const bool to_vectors = reinterpret_cast<unsigned long long>(to) % 16 == 0;
    for (kiln_i64 r0 = static_cast<kiln_i64>(blockIdx.x) * SPAN; r0 < rows_d;
         r0 += static_cast<kiln_i64>(gridDim.x) * SPAN) {
      if (c < cols_s && from_vectors && r0 + SPAN <= rows_s) {
        stage[t] = reinterpret_cast<const uint4*>(from + r0)[t];
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const kiln_i64 r = r0 + j * THREADS + t;
          tile[j * THREADS + t] = c < cols_s && r < rows_s ? from[r] : T(0);
        }
      }
      __syncthreads();
      if (to_vectors && r0 + SPAN <= rows_d) {
        reinterpret_cast<uint4*>(to + r0)[t] = stage[t];
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const kiln_i64 r = r0 + j * THREADS + t;
          if (r < rows_d) to[r] = tile[j * THREADS + t];
        }
      }
      __syncthreads();
    }
  }
}
#define KILN_MM_PAD(N, T)                                                                                    \
  extern "C" __global__ void kiln_mm_pad_##N(const T* src, T* dst, kiln_i64 rows_s, kiln_i64 cols_s,         \
                                             kiln_i64 lds, kiln_i64 rows_d, kiln_i64 cols_d, kiln_i64 ldd) { \
    kiln_pad<T>(src, dst, rows_s, cols_s, lds, rows_d, cols_d, ldd);                                         \
  }
KILN_MM_PAD(b16, unsigned short)
KILN_MM_PAD(b32, unsigned int)
)";
}

inline std::string copy_kernel_name(dtype src, dtype dst) {
  return "kiln_mm_copy_" + std::string(name(src)) + "_" + std::string(name(dst));
}

// The device's state with the copy and padding kernels loaded (compiled on first use).
inline DeviceState& copy_kernels(int device) {
  DeviceState& s = state(device);
  std::call_once(s.copy_once, [&] {
    std::vector<char> cubin = compile_cubin(copy_kernel_source(), "kiln_mm_copy", driver::arch(device));
    auto module = std::make_unique<Module>(cubin, device);
    const dtype types[4] = {dtype::f64, dtype::f32, dtype::f16, dtype::bf16};
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) s.copy_fns[i][j] = module->function(copy_kernel_name(types[i], types[j]).c_str());
    s.pad_fns[0] = module->function("kiln_mm_pad_b16");
    s.pad_fns[1] = module->function("kiln_mm_pad_b32");
    s.copy_module = module.release();
  });
  return s;
}

inline CUfunction copy_function(int device, dtype src, dtype dst) {
  return copy_kernels(device).copy_fns[static_cast<int>(src)][static_cast<int>(dst)];
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

// The column-major rows_d x cols_d block at dst (leading dimension ldd) from the rows_s x cols_s
// block at src (lds), zeros where src has none; elements of 2 or 4 bytes, on stream.
inline void pad_copy(const void* src, std::int64_t rows_s, std::int64_t cols_s, std::int64_t lds, void* dst,
                     std::int64_t rows_d, std::int64_t cols_d, std::int64_t ldd, std::size_t item, int device,
                     CUstream stream) {
  if (rows_d <= 0 || cols_d <= 0) return;
  if (item != 2 && item != 4)
    throw dtype_error("matmul: internal padded copy of " + std::to_string(item) + "-byte items");
  CUfunction f = copy_kernels(device).pad_fns[item == 2 ? 0 : 1];
  driver::make_current(device);
  void* args[] = {&src, &dst, &rows_s, &cols_s, &lds, &rows_d, &cols_d, &ldd};
  const std::int64_t threads = 256;
  const std::int64_t per_block = threads * 16 / static_cast<std::int64_t>(item);  // rows a block moves
  const auto blocks_x = static_cast<unsigned>(std::min<std::int64_t>((rows_d + per_block - 1) / per_block, 65535));
  const auto blocks_y = static_cast<unsigned>(std::min<std::int64_t>(cols_d, 65535));
  launch(f, Dim3{blocks_x, blocks_y}, Dim3{static_cast<unsigned>(threads)}, 0, stream, args, "kiln_mm_pad");
}

// A contiguous copy of t in dtype d, on t's device.
inline Tensor contiguous_as(const Tensor& t, dtype d, CUstream stream) {
  Tensor c = capture_temporary(t.shape(), d, t.device(), stream);
  device_copy(t, c, stream);
  return c;
}

}  // namespace cuda_mm_detail
}  // namespace kiln::runtime
