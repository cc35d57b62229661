// kiln's GEMM template (codegen/gemm_template.hpp, on the prelude's tile `dot`) beside cuBLASLt on
// the same GPU, in one run: model GEMMs (GPT-2 small's projections and LM head at 8 x 1024 tokens,
// a square 4096 product, odd sizes), bf16 (and f16, f32 with --dtypes), a's rows contiguous, b as a
// [K, N] weight or as linear's transposed [N, K] one, with no epilogue and with bias + tanh-gelu.
// cuBLASLt is timed at its heuristic's choice and at its autotuned best (its first call times its
// best few algorithms); the template at each blocking; and cuda_matmul_epilogue under autotuning
// (the faster of the two, chosen at its first call). Every template result is checked against
// cuBLASLt's output first. One JSON object a line:
//   {"id": "gemm-bf16-8192x2304x768-kn-none", "impl": "cublaslt" | "cublaslt-tuned" | "autotuned" |
//   "kiln-128x128w2x2s3", "ms": ..., "tflops": ...}
// Usage: gemm [--dtypes bf16,f16,f32] [--reps N] [--only SUBSTR] > gemm.jsonl; benchmarks/gemm_table.py gemm.jsonl
// tabulates it.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <kiln/runtime/extern/cuda_matmul.hpp>

#include "timing.hpp"

namespace k = kiln;
namespace rt = kiln::runtime;

namespace {

k::Tensor random_cuda(const k::Dims& shape, k::dtype dt, unsigned seed) {
  k::Tensor h = k::Tensor::empty(shape, dt, k::cpu);
  unsigned s = seed;
  for (std::int64_t i = 0; i < h.numel(); ++i) {
    s = s * 1664525u + 1013904223u;
    k::store_from_double(h.data_ptr(), dt, i, (static_cast<double>(s >> 8) / 16777216.0 - 0.5) * 2.0);
  }
  return h.to(k::Device(k::cuda));
}

// The largest difference between two CUDA results, relative to the largest magnitude of the first.
double max_rel_diff(const k::Tensor& x, const k::Tensor& y) {
  const k::Tensor a = x.to(k::cpu).to(k::f64), b = y.to(k::cpu).to(k::f64);
  const double* p = static_cast<const double*>(a.data_ptr());
  const double* q = static_cast<const double*>(b.data_ptr());
  double diff = 0, scale = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    diff = std::max(diff, std::abs(p[i] - q[i]));
    scale = std::max(scale, std::abs(p[i]));
    if (std::isnan(q[i])) return INFINITY;
  }
  return diff / std::max(scale, 1e-30);
}

}  // namespace

int main(int argc, char** argv) {
  setenv("KILN_TUNE_GEMM_TEMPLATE", "1", 1);  // (the "autotuned" column: cuBLASLt or the template)
  if (!kiln_bench::cuda_device_present()) {
    std::printf("gemm: no CUDA device, skipped\n");
    return 0;
  }
  std::vector<k::dtype> dtypes{k::bf16};
  int reps = 30;
  std::string only;  // --only SUBSTR: the cases whose id contains it
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--only")) only = argv[i + 1];
    if (!std::strcmp(argv[i], "--dtypes")) {
      dtypes.clear();
      std::stringstream in(argv[i + 1]);
      for (std::string d; std::getline(in, d, ',');)
        dtypes.push_back(d == "f32" ? k::f32 : d == "f16" ? k::f16 : k::bf16);
    }
  }
  struct Shape {
    std::int64_t M, N, K;
  };
  const std::vector<Shape> shapes{{8192, 2304, 768},  {8192, 768, 768},   {8192, 3072, 768},  {8192, 768, 3072},
                                  {8192, 50257, 768}, {4096, 4096, 4096}, {1000, 1000, 1000}, {777, 1536, 640}};
  const std::vector<rt::DotBlocking> blockings{{128, 128, 2, 2, 3},
                                               {128, 256, 2, 4, 3},
                                               {128, 64, 2, 2, 4},
                                               {64, 64, 2, 2, 4},
                                               {128, 128, 8, 1, 4, true},
                                               {128, 256, 8, 1, 3, true},
                                               {128, 256, 8, 1, 4, true},
                                               {128, 128, 8, 1, 4, true, true},
                                               {128, 256, 8, 1, 4, true, true},
                                               {128, 128, 8, 1, 6, true, false, true},
                                               {128, 256, 8, 1, 4, true, false, true}};
  for (k::dtype dt : dtypes)
    for (const Shape& s : shapes)
      for (bool b_k : {false, true})
        for (rt::Epilogue e : {rt::Epilogue::none, rt::Epilogue::gelu_tanh_bias}) {
          const std::string id = "gemm-" + std::string(k::name(dt)) + "-" + std::to_string(s.M) + "x" +
                                 std::to_string(s.N) + "x" + std::to_string(s.K) + (b_k ? "-kk" : "-kn") + "-" +
                                 (e == rt::Epilogue::none ? "none" : "bias_gelu");
          if (id.find(only) == std::string::npos) continue;
          const k::Tensor a = random_cuda({s.M, s.K}, dt, 1);
          // b [K, N]: a row-major weight, or linear's [N, K] weight transposed (K-contiguous).
          const k::Tensor w = random_cuda(b_k ? k::Dims{s.N, s.K} : k::Dims{s.K, s.N}, dt, 2);
          const k::Tensor b = b_k ? w.as_strided({s.K, s.N}, {1, s.K}, 0) : w;
          const k::Tensor bias = random_cuda({s.N}, dt, 3);
          k::Tensor want = k::Tensor::empty({s.M, s.N}, dt, k::cuda), got = k::Tensor::empty({s.M, s.N}, dt, k::cuda);
          const double flops = 2.0 * s.M * s.N * s.K;
          auto emit = [&](const std::string& impl, double ms) {
            std::printf("{\"id\": \"%s\", \"impl\": \"%s\", \"ms\": %.5f, \"tflops\": %.1f}\n", id.c_str(),
                        impl.c_str(), ms, flops / ms / 1e9);
            std::fflush(stdout);
          };
          emit("cublaslt",
               kiln_bench::cuda_time_ms([&] { rt::cublaslt_matmul_epilogue(a, b, &bias, e, want, nullptr); }, reps));
          emit("cublaslt-tuned", kiln_bench::cuda_time_ms(
                                     [&] { rt::cublaslt_matmul_epilogue(a, b, &bias, e, want, nullptr, true); }, reps));
          // What autotuning picks between them (cuda_matmul_epilogue): its first call tunes.
          emit("autotuned",
               kiln_bench::cuda_time_ms([&] { rt::cuda_matmul_epilogue(a, b, &bias, e, got, nullptr, true); }, reps));
          const rt::MatmulGeometry g = rt::matmul_geometry(a, b, got, "matmul");
          // The blockings that run here (f32: no wgmma, and 128 x 256 FMA fragments spill; TMA only
          // where the layout allows it), their CUBINs compiled at once first.
          std::vector<std::pair<rt::DotBlocking, k::codegen::GemmKernel>> runs;
          std::vector<k::codegen::GemmKernel> kernels;
          for (const rt::DotBlocking& bl : blockings) {
            const k::codegen::GemmKernel kern = rt::dot_matmul_kernel(g, a, b, got, e, bl);
            if ((dt == k::f32 && (bl.bn == 256 || bl.wgmma)) || kern.tma != bl.tma) continue;
            runs.emplace_back(bl, kern);
            kernels.push_back(kern);
          }
          rt::compile_gemm_kernels(kernels, k::driver::arch(0));
          for (const auto& run : runs) {
            const rt::DotBlocking& bl = run.first;
            const k::codegen::GemmKernel& kern = run.second;  // (not a structured binding: the lambda captures it)
            auto go = [&] { rt::run_dot_matmul(kern, g, a, b, &bias, nullptr, got, nullptr); };
            go();
            const double diff = max_rel_diff(want, got);
            if (!(diff < (dt == k::f32 ? 1e-3 : 2e-2))) {
              std::fprintf(stderr, "%s %s: differs from cuBLASLt by %g of its largest value\n", id.c_str(),
                           kern.name().c_str(), diff);
              continue;
            }
            emit("kiln-" + bl.str(), kiln_bench::cuda_time_ms(go, reps));
          }
        }
  return 0;
}
