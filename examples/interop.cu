// kiln dropped into a plain CUDA program: the program owns its buffers (cudaMalloc), its stream
// and its own kernels; between two of its kernels it calls one compiled kiln function, a fused
// residual add + rms_norm written straight into the program's output buffer. Nothing is copied,
// nothing waits for the device: kiln queues its kernel on the program's stream.
//
//   build: part of kiln's CMake build when nvcc is found (target `interop`)
//   run:   ./build/examples/interop      (prints "no CUDA device" and exits 0 without a GPU)
#include <kiln/kiln.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

#include <cuda_runtime.h>

namespace k = kiln;

#define CUDA_CHECK(call)                                                                          \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      return 1;                                                                                   \
    }                                                                                             \
  } while (0)

// The program's own kernels: fill the inputs, then consume kiln's output.
__global__ void make_inputs(float* x, float* residual, float* weight, int rows, int cols) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < rows * cols) {
    x[i] = std::sin(0.37f * static_cast<float>(i)) * 2.0f;
    residual[i] = std::cos(0.11f * static_cast<float>(i)) - 0.25f;
  }
  if (i < cols) weight[i] = 0.5f + static_cast<float>(i % 7) * 0.125f;
}

__global__ void scale_rows(float* y, int rows, int cols) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < rows * cols) y[i] *= static_cast<float>(1 + i / cols % 3);
}

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("interop: no CUDA device on this machine, nothing to run\n");
    return 0;
  }
  const int rows = 300, cols = 1027;
  const std::size_t n = static_cast<std::size_t>(rows) * cols;
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  float *x, *residual, *weight, *y;
  CUDA_CHECK(cudaMalloc(&x, n * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&residual, n * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&weight, cols * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&y, n * sizeof(float)));

  // kiln views the program's buffers; it never frees them.
  k::Tensor X = k::Tensor::wrap(x, {rows, cols}, k::f32, k::cuda);
  k::Tensor R = k::Tensor::wrap(residual, {rows, cols}, k::f32, k::cuda);
  k::Tensor W = k::Tensor::wrap(weight, {cols}, k::f32, k::cuda);
  k::Tensor Y = k::Tensor::wrap(y, {rows, cols}, k::f32, k::cuda);
  auto fused = k::compile([](auto x, auto r, auto w, auto out) { return k::assign(out, k::rms_norm(x + r, w)); });

  for (int step = 0; step < 3; ++step) {
    int blocks = static_cast<int>((n + 255) / 256);
    make_inputs<<<blocks, 256, 0, stream>>>(x, residual, weight, rows, cols);
    fused(k::Stream(stream), X, R, W, Y);  // one fused kernel, queued on the program's stream
    scale_rows<<<blocks, 256, 0, stream>>>(y, rows, cols);
  }
  std::vector<float> hx(n), hr(n), hw(cols), hy(n);
  CUDA_CHECK(cudaMemcpyAsync(hx.data(), x, n * sizeof(float), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaMemcpyAsync(hr.data(), residual, n * sizeof(float), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaMemcpyAsync(hw.data(), weight, cols * sizeof(float), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaMemcpyAsync(hy.data(), y, n * sizeof(float), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));

  // The same computation on the host, in double.
  double worst = 0;
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int c = 0; c < cols; ++c) {
      double v = double(hx[r * cols + c]) + hr[r * cols + c];
      ss += v * v;
    }
    double inv = 1.0 / std::sqrt(ss / cols + 1e-6);
    for (int c = 0; c < cols; ++c) {
      double want = (double(hx[r * cols + c]) + hr[r * cols + c]) * inv * hw[c] * (1 + r % 3);
      worst = std::fmax(worst, std::fabs(want - hy[r * cols + c]) / (1e-5 + std::fabs(want)));
    }
  }
  std::printf("interop: %d x %d residual + rms_norm between two user kernels, worst relative error %.2e\n", rows, cols,
              worst);
  CUDA_CHECK(cudaFree(x));
  CUDA_CHECK(cudaFree(residual));
  CUDA_CHECK(cudaFree(weight));
  CUDA_CHECK(cudaFree(y));
  CUDA_CHECK(cudaStreamDestroy(stream));
  return worst < 1e-4 ? 0 : 1;
}
