// kiln included from a CUDA translation unit: nvcc must accept the headers beside a
// user's own __global__ kernels, and the host side must still evaluate on the CPU. A
// custom op launches the user's kernel on kiln's stream when a GPU is present.
#include <kiln/kiln.hpp>

#include <cmath>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

namespace k = kiln;

// The compile-time structure is a constant expression under nvcc's front end too.
static_assert(k::structure<1>([](auto x) { return k::softmax(x, -1); }).count(k::Op::exp) == 1);
static_assert(k::structure<2>(k::grad([](auto x, auto w) { return k::sum(k::sigmoid(x) * w); }, k::wrt<0, 1>))
                  .count(k::Op::sigmoid) == 1);

// Never launched (CI has no GPU): it only proves device code coexists with kiln.
__global__ void scale(float* data, float factor, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] *= factor;
}

// The device side of the custom op below: out = tanh(x) * w, elementwise.
__global__ void scaled_tanh_kernel(const float* x, const float* w, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = tanhf(x[i]) * w[i];
}

// A user's kernel as a kiln op: launched with <<<..., stream>>> on the stream kiln passes (the
// program's), or run on the host for CPU tensors. f32 inputs of one shape.
k::CustomOp scaled_tanh = k::custom_op(
    "scaled_tanh", {
                       .inputs = 2,
                       .infer =
                           [](std::span<const k::TensorSpec> in) {
                             if (!(in[0].shape == in[1].shape) || in[0].dtype != k::f32 || in[1].dtype != k::f32)
                               throw k::shape_error("x and w must be f32 tensors of one shape");
                             return in[0];
                           },
                       .forward =
                           [](std::span<const k::Tensor> in, k::Tensor& out, k::Stream s) {
                             const int n = static_cast<int>(out.numel());
                             const auto* x = static_cast<const float*>(in[0].data_ptr());
                             const auto* w = static_cast<const float*>(in[1].data_ptr());
                             auto* o = static_cast<float*>(out.data_ptr());
                             if (out.device().is_cpu()) {
                               for (int i = 0; i < n; ++i) o[i] = std::tanh(x[i]) * w[i];
                               return;
                             }
                             scaled_tanh_kernel<<<(n + 255) / 256, 256, 0, s.handle()>>>(x, w, o, n);
                             if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
                               throw k::cuda_error(cudaGetErrorName(e));
                           },
                   });

bool close(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return false;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::abs(got[i] - want[i]) > 1e-5f * (1 + std::abs(want[i]))) return false;
  return true;
}

int main() {
  k::Tensor x = k::from_vector(std::vector<float>{1, 2, 3}, {3});
  k::Tensor y = x * 2.0f;
  if (k::to_vector<float>(y) != std::vector<float>{2, 4, 6}) {
    std::fprintf(stderr, "kiln_in_cu: x * 2 gave the wrong values\n");
    return 1;
  }

  // The custom op between generated kernels: sum(scaled_tanh(a * 2, b) + 1, 1).
  auto a = k::randn({37, 129}, k::f32, k::cpu, 1), b = k::randn({37, 129}, k::f32, k::cpu, 2);
  std::vector<float> av = k::to_vector<float>(a), bv = k::to_vector<float>(b), want(37, 0.0f);
  for (int i = 0; i < 37 * 129; ++i) want[i / 129] += std::tanh(av[i] * 2) * bv[i] + 1;
  auto f = k::compile([](auto p, auto q) { return k::sum(scaled_tanh(p * 2.0f, q) + 1.0f, 1); });
  if (!close(k::to_vector<float>(f(a, b)), want)) {
    std::fprintf(stderr, "kiln_in_cu: the custom op on the CPU gave the wrong values\n");
    return 1;
  }
  if (!k::driver::available()) {
    std::printf("kiln_in_cu: no CUDA device, the custom op's kernel launch is not exercised\n");
    return 0;
  }
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    std::fprintf(stderr, "kiln_in_cu: cudaStreamCreateWithFlags failed\n");
    return 1;
  }
  k::Tensor ga = a.to(k::cuda), gb = b.to(k::cuda);
  k::Tensor got = f(k::Stream(stream), ga, gb);
  cudaStreamSynchronize(stream);
  bool ok = got.device().is_cuda() && close(k::to_vector<float>(got), want);
  cudaStreamDestroy(stream);
  if (!ok) {
    std::fprintf(stderr, "kiln_in_cu: the custom op's kernel on the GPU gave the wrong values\n");
    return 1;
  }
  return 0;
}
