// k::cond under `.cuda_graphs` (issue 22): a conditional graph node, so a step with a data-dependent
// branch replays as one CUDA graph with no host synchronisation. The branch is decided on the device
// at every replay: the tests change a buffer's values in place (same addresses, so the same graph)
// and check that both branches are taken, against the f64 oracle or a host simulation. The set-handle
// kernel's build (NVRTC -rdc, nvJitLink with libcudadevrt.a) and the CPU training loop run in CI.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "have_gpu.hpp"

namespace k = kiln;

namespace {

void check_close(const k::Tensor& got, const k::Tensor& want, double rtol = 1e-5, double atol = 1e-5) {
  auto r = k::testing::allclose(got, want, rtol, atol);
  CHECK_MESSAGE(bool(r), r);
}

double sum_of_squares(const k::Tensor& t) {
  double s = 0;
  for (double v : k::reference::read(t).data) s += v * v;
  return s;
}

// The one program a compiled function made, which must replay as a CUDA graph (not plain launches).
const k::runtime::GraphReplay& replay_of(const auto& f) {
  auto entries = f.cache().entries();
  REQUIRE(entries.size() == 1);
  REQUIRE(entries[0]->graphs);
  CHECK_FALSE(entries[0]->graphs->disabled());
  return *entries[0]->graphs;
}

doctest::skip needs_nvjitlink() { return doctest::skip(!k::runtime::nvjitlink::unavailable().empty()); }

// Linear regression, its gradient written out, clipped to norm 2 when it is longer.
constexpr int N = 67, D = 13;
auto clip_norm2 = [](auto g) {
  return k::cond(
      k::sum(g * g) > 4.0f, [](auto u) { return u * (2.0f / k::sqrt(k::sum(u * u))); }, [](auto u) { return u; }, g);
};
auto train_step = [](auto w, auto x, auto y) {
  auto g = k::matmul(k::transpose(x, 0, 1), k::matmul(x, w) - y) * (2.0f / N);  // [D, 1]
  return k::assign(w, w - 0.2f * clip_norm2(g));
};
auto train_step_item = [](auto w, auto x, auto y) {
  auto g = k::matmul(k::transpose(x, 0, 1), k::matmul(x, w) - y) * (2.0f / N);
  float sq = k::item<float>(k::sum(g * g));  // a graph break: the host decides
  float scale = sq > 4.0f ? 2.0f / std::sqrt(sq) : 1.0f;
  return k::assign(w, w - 0.2f * (g * scale));
};

// The same loop in f64 on the host; returns the final weights and counts the clipped steps.
std::vector<double> simulate(std::vector<double> w, const std::vector<double>& x, const std::vector<double>& y,
                             int steps, int& clipped) {
  clipped = 0;
  for (int s = 0; s < steps; ++s) {
    std::vector<double> r(N), g(D, 0.0);
    for (int i = 0; i < N; ++i) {
      r[i] = -y[i];
      for (int j = 0; j < D; ++j) r[i] += x[i * D + j] * w[j];
    }
    double sq = 0;
    for (int j = 0; j < D; ++j) {
      for (int i = 0; i < N; ++i) g[j] += x[i * D + j] * r[i] * (2.0 / N);
      sq += g[j] * g[j];
    }
    double scale = sq > 4.0 ? 2.0 / std::sqrt(sq) : 1.0;
    clipped += sq > 4.0;
    for (int j = 0; j < D; ++j) w[j] -= 0.2 * g[j] * scale;
  }
  return w;
}

struct Problem {
  k::Tensor w, x, y;
  explicit Problem(k::Device dev)
      : w(k::randn({D, 1}, k::f32, dev, 501)), x(k::randn({N, D}, k::f32, dev, 502)),
        y(k::Tensor(k::matmul(x, k::randn({D, 1}, k::f32, dev, 503)))) {}  // w converges to that
};

// Runs `steps` of a compiled step on a fresh problem and checks it against the host simulation;
// both branches must have been taken.
template <class F>
void check_training(const F& step, k::Device dev, int steps) {
  Problem p(dev);
  auto w0 = k::reference::read(p.w).data, x = k::reference::read(p.x).data, y = k::reference::read(p.y).data;
  for (int s = 0; s < steps; ++s) (void)step(p.w, p.x, p.y);
  int clipped = 0;
  auto want = simulate(w0, x, y, steps, clipped);
  CHECK(clipped > 0);
  CHECK(clipped < steps);
  MESSAGE("clipped " << clipped << " of " << steps << " steps");
  check_close(p.w, k::from_vector(std::vector<double>(want), {D, 1}), 1e-3, 1e-4);
}

}  // namespace

TEST_CASE("cond graph: the set-handle kernel compiles with -rdc and links with libcudadevrt (no GPU)" *
          needs_nvjitlink()) {
  for (const char* arch : {"sm_80", "sm_90a"}) {
    std::vector<char> cubin = k::runtime::cond_node::set_kernel_cubin(arch);
    REQUIRE(cubin.size() > 4);
    CHECK(std::string(cubin.data() + 1, 3) == "ELF");  // a linked CUBIN
  }
}

TEST_CASE("cond graph: a training loop with clipping on the CPU (host-read cond, and with k::item)") {
  check_training(k::compile(train_step), k::cpu, 30);
  check_training(k::compile(train_step_item), k::cpu, 30);
  Problem p(k::cpu);
  k::report with_cond = k::explain(k::compile(train_step), p.w, p.x, p.y);
  CHECK(with_cond.graph_breaks.size() == 1);  // on the CPU the predicate is read on the host
  k::report with_item = k::explain(k::compile(train_step_item), p.w, p.x, p.y);
  CHECK(with_item.graphs == 2);
  REQUIRE(with_item.graph_breaks.size() == 1);
  CHECK(with_item.graph_breaks[0].find("k::item") != std::string::npos);
}

TEST_CASE("cond graph (cuda): one graph replay takes either branch, decided on the device" * needs_gpu()) {
  auto step = k::compile([](auto w, auto g) { return w - 0.5f * clip_norm2(g); }, {.cuda_graphs = true});
  k::Tensor w = k::randn({37, 129}, k::f32, k::cuda, 511);
  k::Tensor g = k::Tensor(k::randn({37, 129}, k::f32, k::cuda, 512) * 0.001f);  // norm < 2: not clipped
  int taken[2] = {0, 0};
  for (int i = 0; i < 12; ++i) {
    // The same buffer each call (so the same graph), its values scaled in place: the norm crosses
    // 2 one way and the other.
    k::eval(g, g * (i % 3 == 2 ? 0.0005f : 40.0f));
    double norm = std::sqrt(sum_of_squares(g)), scale = norm > 2 ? 2 / norm : 1.0;
    ++taken[norm > 2];
    check_close(step(w, g), k::reference::eval(w - 0.5 * (g * scale)), 1e-5, 1e-6);
  }
  CHECK(taken[0] > 0);
  CHECK(taken[1] > 0);
  const auto& replay = replay_of(step);
  CHECK(replay.replays() == 12);
  CHECK(replay.captures() <= 3);  // output buffers alternate; never a capture per branch
  k::report r = k::explain(step, w, g);
  CHECK(r.graphs == 1);
  CHECK(r.graph_breaks.empty());
}

TEST_CASE("cond graph (cuda): two IF nodes (the path of drivers before 12.8) take either branch too" *
          needs_gpu()) {
  k::runtime::cond_node::two_if_nodes() = true;
  struct Reset {
    ~Reset() { k::runtime::cond_node::two_if_nodes() = false; }
  } reset;
  auto step = k::compile([](auto w, auto g) { return w * 2.0f + clip_norm2(g); }, {.cuda_graphs = true});
  k::Tensor w = k::randn({3, 333}, k::f32, k::cuda, 517), g = k::randn({3, 333}, k::f32, k::cuda, 518);
  for (int i = 0; i < 6; ++i) {
    k::eval(g, g * (i % 2 == 0 ? 0.001f : 1000.0f));  // norm ~0.03, then ~30
    double norm = std::sqrt(sum_of_squares(g)), scale = norm > 2 ? 2 / norm : 1.0;
    CHECK((norm > 2) == (i % 2 == 1));
    check_close(step(w, g), k::reference::eval(w * 2.0 + g * scale), 1e-5, 1e-6);
  }
  CHECK(replay_of(step).replays() == 6);
}

TEST_CASE("cond graph (cuda): a predicate argument, two operands, odd sizes, f16 results" *
          needs_gpu()) {
  auto f = k::compile(
      [](auto p, auto a, auto b) {
        return k::cond(
            p, [](auto u, auto v) { return k::cast(k::exp(u) * v, k::f16); },
            [](auto u, auto) { return k::cast(u, k::f16); }, a, b);
      },
      {.cuda_graphs = true});
  k::Tensor a = k::randn({5, 3, 41}, k::f32, k::cuda, 513), b = k::randn({5, 3, 41}, k::f32, k::cuda, 514);
  k::Tensor p = k::Tensor(k::sum(a) > -1e9f);  // one boolean element on the device
  for (int i = 0; i < 6; ++i) {
    bool on = i % 2 == 0;
    k::eval(p, k::sum(a) > (on ? -1e9f : 1e9f));
    auto want = on ? k::reference::eval(k::cast(k::exp(a) * b, k::f16)) : k::reference::eval(k::cast(a, k::f16));
    check_close(f(p, a, b), want, 2e-3, 2e-3);
  }
  CHECK(replay_of(f).replays() == 6);
}

TEST_CASE("cond graph (cuda): gradients through the cond under .cuda_graphs follow the taken branch" * needs_gpu()) {
  auto fn = [](auto x, auto y) {
    return k::sum(k::cond(
        k::mean(x) > 0.0f, [](auto u, auto v) { return k::tanh(u) * v; }, [](auto u, auto v) { return u * u + v; },
        x, y));
  };
  auto df = k::compile(k::grad(fn, k::wrt<0, 1>), {.cuda_graphs = true});
  k::Tensor x = k::Tensor(k::abs(k::randn({19, 71}, k::f32, k::cuda, 515)) + 0.1f);
  k::Tensor y = k::randn({19, 71}, k::f32, k::cuda, 516);
  for (int i = 0; i < 6; ++i) {
    if (i > 0) k::eval(x, -x);  // the mean changes sign in place: the other branch, the same graph
    k::Tensor xh = x.to(k::cpu), yh = y.to(k::cpu);
    bool positive = i % 2 == 0;
    auto [dx, dy] = df(x, y);
    if (positive) {
      check_close(dx, k::reference::eval((1.0f - k::square(k::tanh(xh))) * yh));
      check_close(dy, k::reference::eval(k::tanh(xh)));
    } else {
      check_close(dx, k::reference::eval(2.0f * xh));
      check_close(dy, k::reference::eval(k::full({19, 71}, 1.0f, k::f32, k::cpu)));
    }
  }
  const auto& replay = replay_of(df);
  CHECK(replay.replays() == 6);
  CHECK(replay.captures() <= 3);
}

TEST_CASE("cond graph (cuda): a training loop with clipping replays as one CUDA graph a step" * needs_gpu()) {
  auto step = k::compile(train_step, {.cuda_graphs = true});
  check_training(step, k::cuda, 40);
  const auto& replay = replay_of(step);
  CHECK(replay.replays() == 40);
  CHECK(replay.captures() == 1);  // w is updated in place: every step is the same graph
  Problem p(k::cuda);
  k::report r = k::explain(step, p.w, p.x, p.y);
  CHECK(r.graphs == 1);
  CHECK(r.graph_breaks.empty());
}

TEST_CASE("cond graph (cuda): the same loop with k::item runs as two segments" * needs_gpu()) {
  auto step = k::compile(train_step_item, {.cuda_graphs = true});
  check_training(step, k::cuda, 40);
  Problem p(k::cuda);
  k::report r = k::explain(step, p.w, p.x, p.y);
  CHECK(r.graphs == 2);
  REQUIRE(r.graph_breaks.size() == 1);
  CHECK(r.graph_breaks[0].find("k::item<f32>") != std::string::npos);
}
