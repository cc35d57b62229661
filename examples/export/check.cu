// Runs kernels exported by examples/export_kernels.cpp with plain CUDA (this file never sees kiln)
// and compares them with kiln's result, then shows the launcher refusing a wrong size.
//   nvcc -std=c++17 -arch=native -I<dir> check.cu <dir>/residual_rms_norm.cu -o check_exported && ./check_exported
//   <dir>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "residual_rms_norm.h"

static std::vector<float> read_f32(const std::string& path, size_t n) {
  std::vector<float> v(n);
  std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * 4));
  return v;
}

static float* to_device(const std::vector<float>& v) {
  float* p = nullptr;
  cudaMalloc(&p, v.size() * 4);
  cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice);
  return p;
}

int main(int argc, char** argv) {
  std::string dir = std::string(argc > 1 ? argv[1] : "exported") + "/check/";
  int64_t rows = 0, cols = 0;
  std::ifstream(dir + "shape.txt") >> rows >> cols;
  size_t n = static_cast<size_t>(rows * cols);
  float* x = to_device(read_f32(dir + "x.f32", n));
  float* residual = to_device(read_f32(dir + "residual.f32", n));
  float* w = to_device(read_f32(dir + "w.f32", static_cast<size_t>(cols)));
  std::vector<float> expected = read_f32(dir + "expected.f32", n), got(n);
  float* out = nullptr;
  cudaMalloc(&out, n * 4);

  int64_t x_shape[2] = {rows, cols}, w_shape[1] = {cols};
  if (residual_rms_norm(x, x_shape, residual, x_shape, w, w_shape, out) != kiln_export_success) {
    std::printf("launch failed: %s\n", residual_rms_norm_last_error());
    return 1;
  }
  cudaMemcpy(got.data(), out, n * 4, cudaMemcpyDeviceToHost);  // waits for the kernels
  double worst = 0;
  for (size_t i = 0; i < n; ++i)
    worst = std::fmax(worst, std::fabs(got[i] - expected[i]) / (1e-4 + std::fabs(expected[i])));
  std::printf("exported kernels vs kiln at [%lld, %lld]: worst relative error %.3g\n", (long long)rows, (long long)cols,
              worst);

  int64_t wrong[1] = {cols - 1};
  int status = residual_rms_norm(x, x_shape, residual, x_shape, w, wrong, out);
  std::printf("a wrong size: status %d, \"%s\"\n", status, residual_rms_norm_last_error());
  bool ok = worst < 1e-3 && status == kiln_export_shape_mismatch;
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
