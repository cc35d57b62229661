// W13, kiln's side: k::attention forward, and forward + backward, bf16, B x H = 16 x 16, over
// sequence lengths and head dims (BENCHMARKS.md), causal and not. benchmarks/attention_peer.py is
// torch's side (SDPA's flash backend, torch.compile'd flex_attention) with the same cases, ids and
// sampling (benchmarks/timing.hpp). Every result is checked before it is timed: the forward against
// the f64 oracle on a slice of the heads (the oracle is a naive loop), the gradients' finiteness.
// One JSON object a line:
//   {"id": "W13-fwd-causal-T1024-D64", "impl": "kiln", "ms": ..., "tflops": ...}
// FLOPs: 4 B H Tq Tk D for the forward (half of it causal), 3.5x that for forward + backward (as
// FlashAttention's benchmarks count); `--bwd-T none` leaves the forward + backward cases out. With --softcap C every
// case also runs with the score_mod tanh(s / C) * C (Gemma 2's soft-capping, ids ending in -softcap; torch's side:
// flex_attention with the same score_mod; --softcap-only C: those cases alone). Usage: attention [--T 1024,4096] [--D
// 64,128] [--bwd-T 1024] [--reps N]
// [--softcap C | --softcap-only C] [--B 16] [--H 16]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include <kiln/testing.hpp>

#include "timing.hpp"

namespace k = kiln;

namespace {

std::vector<int> ints(const char* s) {
  std::vector<int> v;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ','))
    if (item != "none") v.push_back(std::stoi(item));  // (--bwd-T none: no forward + backward cases)
  return v;
}

// Attention, soft-capped by `cap` where it is positive (a C++ scalar of the score_mod: a run-time
// value). The plain cases keep k::attention without a score_mod.
template <bool Causal>
auto forward(float cap) {
  return [cap](auto q, auto k, auto v) {
    if (cap > 0)
      return k::expression(
          k::attention(q, k, v, [cap](auto s, auto...) { return k::tanh(s / cap) * cap; }, {.causal = Causal}));
    return k::expression(k::attention(q, k, v, {.causal = Causal}));
  };
}
template <bool Causal>
auto loss(float cap) {  // forward + backward: the value needs o, the gradients the backward
  return [cap](auto q, auto k, auto v, auto g) { return k::sum(k::cast(forward<Causal>(cap)(q, k, v), k::f32) * g); };
}

int batch = 16, heads = 16;  // W13's B and H (--B, --H: other shapes, ids marked with them)
template <bool Causal>
void run(int T, int D, bool backward, int reps, float cap) {
  const int B = batch, H = heads;
  // Where a case's time goes besides the timed calls (stderr): making the inputs, the first call
  // (the compile: capture, passes, NVRTC), the check.
  using clock = std::chrono::steady_clock;
  auto since = [](clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); };
  auto t0 = clock::now();
  double inputs_s = 0, first_s = 0, check_s = 0;
  k::Tensor q = k::randn({B, H, T, D}, k::bf16, k::cuda, 1), kk = k::randn({B, H, T, D}, k::bf16, k::cuda, 2);
  k::Tensor v = k::randn({B, H, T, D}, k::bf16, k::cuda, 3);
  const double fwd_flops = 4.0 * B * H * double(T) * T * D * (Causal ? 0.5 : 1.0);
  std::string id = std::string("W13-") + (backward ? "fwdbwd" : "fwd") + (Causal ? "-causal" : "") + "-T" +
                   std::to_string(T) + "-D" + std::to_string(D) + (cap > 0 ? "-softcap" : "") +
                   (B != 16 || H != 16 ? "-B" + std::to_string(B) + "H" + std::to_string(H) : "");
  double ms = 0, flops = fwd_flops;
  if (!backward) {
    k::synchronize();
    inputs_s = since(t0), t0 = clock::now();
    auto f = k::compile(forward<Causal>(cap));
    k::Tensor o = f(q, kk, v);
    k::synchronize();
    first_s = since(t0), t0 = clock::now();
    // The oracle on a slice: the first head's first 256 queries against all its keys (a naive f64
    // loop; causal rows i < 256 see the same keys in the slice as in the whole).
    const std::int64_t rows = std::min(T, 256);
    auto part = [](const k::Tensor& t, std::int64_t n) {
      return k::Tensor(k::slice(k::slice(k::slice(t, 0, 0, 1), 1, 0, 1), 2, 0, n)).to(k::cpu);
    };
    auto want = k::reference::eval(forward<Causal>(cap)(part(q, rows), part(kk, T), part(v, T)));
    auto close = k::testing::allclose(part(o, rows), want, 2e-2, 2e-2);
    if (!close) {
      std::fprintf(stderr, "%s: kiln's result is wrong: %s\n", id.c_str(), close.str().c_str());
      std::exit(1);
    }
    check_s = since(t0);
    ms = kiln_bench::cuda_time_ms([&] { o = f(q, kk, v); }, reps);
  } else {
    k::Tensor g = k::randn({B, H, T, D}, k::f32, k::cuda, 4);
    k::synchronize();
    inputs_s = since(t0), t0 = clock::now();
    auto step = k::compile(k::value_and_grad(loss<Causal>(cap), k::wrt<0, 1, 2>));
    auto [value, dq, dk, dv] = step(q, kk, v, g);
    k::synchronize();
    first_s = since(t0), t0 = clock::now();
    for (const k::Tensor* t : {&dq, &dk, &dv})
      if (!std::isfinite(k::to_vector<float>(k::sum(k::cast(*t, k::f32)))[0])) {
        std::fprintf(stderr, "%s: kiln's gradient is not finite\n", id.c_str());
        std::exit(1);
      }
    check_s = since(t0);
    ms = kiln_bench::cuda_time_ms([&] { std::tie(value, dq, dk, dv) = step(q, kk, v, g); }, reps);
    flops *= 3.5;
  }
  std::printf("{\"id\": \"%s\", \"impl\": \"kiln\", \"ms\": %.4f, \"tflops\": %.1f}\n", id.c_str(), ms,
              flops / ms * 1e-9);
  std::fprintf(stderr, "%s: inputs %.2f s, first call %.2f s, check %.2f s\n", id.c_str(), inputs_s, first_s, check_s);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> Ts{1024, 4096, 8192}, Ds{64, 128}, bwd_Ts{1024};
  int reps = 30;
  float softcap = 0;
  bool mods_only = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--T") Ts = ints(argv[i + 1]);
    else if (a == "--D") Ds = ints(argv[i + 1]);
    else if (a == "--bwd-T") bwd_Ts = ints(argv[i + 1]);
    else if (a == "--reps") reps = std::atoi(argv[i + 1]);
    else if (a == "--B")
      batch = std::atoi(argv[i + 1]);
    else if (a == "--H")
      heads = std::atoi(argv[i + 1]);
    else if (a == "--softcap") softcap = std::strtof(argv[i + 1], nullptr);
    else if (a == "--softcap-only")
      softcap = std::strtof(argv[i + 1], nullptr), mods_only = true;
  }
  if (!k::driver::available()) {
    std::fprintf(stderr, "attention: no CUDA device\n");
    return 1;
  }
  std::vector<float> caps{0};
  if (softcap > 0) caps = mods_only ? std::vector<float>{softcap} : std::vector<float>{0, softcap};
  for (float cap : caps)
    for (int D : Ds) {
      for (int T : Ts) run<false>(T, D, false, reps, cap), run<true>(T, D, false, reps, cap);
      for (int T : bwd_Ts) run<false>(T, D, true, reps, cap), run<true>(T, D, true, reps, cap);
    }
}
