// <kiln/distributed.hpp> (issue 24): process groups, the collectives as expressions and
// data-parallel gradients. On any machine: world size 1 (the collectives are copies, on the CPU
// too, and never load NCCL), the errors, the launch by environment, and a missing NCCL through
// KILN_NCCL_LIBRARY. With two GPUs: every collective against a host computation (in rank order,
// along dim 0 and another dim), inside compiled functions and CUDA graphs, their gradients, and
// data-parallel gradients equal to the full batch's on one GPU.
#include <doctest/doctest.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include <kiln/distributed.hpp>
#include <kiln/testing.hpp>

#include "have_gpu.hpp"

namespace k = kiln;

namespace {

std::vector<double> values(const k::Tensor& t) { return k::reference::read(t.to(k::cpu)).data; }

void check_close(const k::Tensor& got, const k::Tensor& want, double tol = 1e-5) {
  auto r = k::testing::allclose(got.to(k::cpu), want.to(k::cpu), tol, tol);
  CHECK_MESSAGE(bool(r), r);
}

template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<no exception>";
}

// Sets an environment variable for one scope.
struct ScopedEnv {
  std::string name;
  std::string old;
  bool had;
  ScopedEnv(const char* n, const char* v) : name(n), had(std::getenv(n) != nullptr) {
    if (had) old = std::getenv(n);
    if (v)
      setenv(n, v, 1);
    else
      unsetenv(n);
  }
  ~ScopedEnv() {
    if (had)
      setenv(name.c_str(), old.c_str(), 1);
    else
      unsetenv(name.c_str());
  }
};

doctest::skip needs_two_gpus() { return doctest::skip(!k::driver::available() || k::driver::device_count() < 2); }

}  // namespace

TEST_CASE("world size 1: every collective is the identity, eagerly and compiled, on the CPU") {
  auto g = k::dist::init({.rank = 0, .world_size = 1, .device = k::cpu});
  CHECK(g.rank() == 0);
  CHECK(g.world_size() == 1);
  CHECK(g.native() == nullptr);
  auto x = k::randn({37, 129}, k::f32, k::cpu, 3);
  k::Tensor twice = x * 2.0f;
  check_close(k::all_reduce(x * 2.0f, g), twice);
  check_close(k::all_reduce(x, g, k::reduce_op::max), x);
  check_close(k::all_gather(x, g, 1), x);
  check_close(k::all_gather(x, g, -2), x);
  check_close(k::reduce_scatter(x, g, -1, k::reduce_op::avg), x);
  check_close(k::broadcast(x, g, 0), x);
  k::Tensor y = k::all_gather(x, g, 0);
  CHECK(y.shape() == std::vector<std::int64_t>{37, 129});

  float bias = 0.5f;
  auto f = k::compile([&](auto a) { return k::all_reduce(k::exp(a), g) + bias; });
  k::Tensor want = k::exp(x) + 0.5f;
  check_close(f(x), want);
  bias = -1.25f;  // a scalar change: same program, new value
  k::Tensor want2 = k::exp(x) - 1.25f;
  check_close(f(x), want2);
  CHECK(k::explain(f, x).kernels.size() >= 2);  // the exp, the collective (extern), the add
}

TEST_CASE("world size 1: gradients flow through the collectives (gradcheck)") {
  auto g = k::dist::init({.rank = 0, .world_size = 1, .device = k::cpu});
  auto x = k::randn({5, 7}, k::f64, k::cpu, 11);
  auto w = k::randn({5, 7}, k::f64, k::cpu, 12);
  auto loss = [&](auto a, auto b) {
    return k::sum(k::sigmoid(k::all_gather(a, g, 1)) * k::reduce_scatter(k::all_reduce(b, g), g, 0) *
                  k::broadcast(a, g, 0));
  };
  auto r = k::testing::gradcheck(loss, x, w);
  CHECK_MESSAGE(bool(r), r);
  k::Tensor dx = k::grad([&](auto a) { return k::sum(k::all_reduce(a, g, k::reduce_op::avg) * 3.0); }, k::wrt<0>)(x);
  for (double v : values(dx)) CHECK(v == doctest::Approx(3.0));
  // max has no gradient: a typed error that names the collective.
  auto bad = k::grad([&](auto a) { return k::sum(k::all_reduce(a, g, k::reduce_op::max)); }, k::wrt<0>);
  CHECK(message_of<k::error>([&] { bad(x); }).find("k::all_reduce(max) has no gradient") != std::string::npos);
}

TEST_CASE("collectives: shape and dtype errors name the collective") {
  auto g = k::dist::init({.rank = 0, .world_size = 1, .device = k::cpu});
  auto s = k::full({}, 2.0, k::f32, k::cpu);
  CHECK(message_of<k::shape_error>([&] { k::Tensor y = k::all_gather(s, g, 0); }).find("k::all_gather(dim 0)") !=
        std::string::npos);
  auto x = k::randn({4, 6}, k::f32, k::cpu, 1);
  CHECK(message_of<k::shape_error>([&] { k::Tensor y = k::reduce_scatter(x, g, 2); }).find("out of range for rank 2") !=
        std::string::npos);
  auto b = k::from_vector(std::vector<bool>{true, false, true}, {3});
  CHECK(message_of<k::dtype_error>([&] { k::Tensor y = k::all_reduce(b, g); }).find("bool") != std::string::npos);
  k::Tensor m = k::all_reduce(b, g, k::reduce_op::max);  // max of bools is fine
  CHECK(values(m) == std::vector<double>{1, 0, 1});
  CHECK(message_of<k::error>([&] { k::Tensor y = k::broadcast(x, g, 1); }).find("root 1 is outside 0..0") !=
        std::string::npos);
}

TEST_CASE("k::dist::init: bad ranks, world sizes without an id or a GPU, and the launch by environment") {
  CHECK(message_of<k::error>([] { k::dist::init({.rank = 2, .world_size = 2}); }).find("rank 2 is outside 0..1") !=
        std::string::npos);
  CHECK(message_of<k::error>([] { k::dist::init({.rank = 0, .world_size = 0}); }).find("at least 1") !=
        std::string::npos);
  CHECK(message_of<k::device_error>([] {
          k::dist::init({.rank = 0, .world_size = 2, .device = k::cpu});
        }).find("NCCL needs a CUDA device per rank") != std::string::npos);
  {
    ScopedEnv r("KILN_RANK", nullptr), w("KILN_WORLD_SIZE", "1");
    CHECK(message_of<k::error>([] { k::dist::init(); }).find("KILN_RANK is not set") != std::string::npos);
  }
  {
    ScopedEnv r("KILN_RANK", "0"), w("KILN_WORLD_SIZE", "1");
    auto g = k::dist::init();
    CHECK(g.world_size() == 1);
    auto x = k::randn({3, 4}, k::f32, g.device(), 5);
    check_close(k::all_reduce(x, g), x);
  }
  {
    ScopedEnv r("KILN_RANK", "1"), w("KILN_WORLD_SIZE", "2"), f("KILN_DIST_ID_FILE", nullptr);
    CHECK(message_of<k::error>([] { k::dist::init(); }).find("KILN_DIST_ID_FILE") != std::string::npos);
  }
  CHECK(message_of<k::error>([] { k::dist::group().rank(); }).find("never initialised") != std::string::npos);
}

TEST_CASE("comm_id: 256 hex digits both ways") {
  k::dist::comm_id id;
  for (std::size_t i = 0; i < id.bytes.size(); ++i) id.bytes[i] = static_cast<char>((i * 37 + 11) & 0xff);
  const std::string hex = id.hex();
  CHECK(hex.size() == 256);
  CHECK(k::dist::comm_id::from_hex(hex) == id);
  CHECK(message_of<k::error>([] { k::dist::comm_id::from_hex("12"); }).find("256 hex digits") != std::string::npos);
}

TEST_CASE("a missing NCCL is a device_error naming the library (KILN_NCCL_LIBRARY)") {
  ScopedEnv lib("KILN_NCCL_LIBRARY", "/nonexistent/kiln-test/libnccl.so.2");
  std::string what = message_of<k::device_error>([] { k::dist::unique_id(); });
  CHECK(what.find("NCCL is not available") != std::string::npos);
  CHECK(what.find("/nonexistent/kiln-test/libnccl.so.2") != std::string::npos);
  CHECK_FALSE(k::runtime::nccl::available());
}

TEST_CASE("spawn(1) and data_parallel at world size 1 give the plain gradients") {
  k::dist::spawn(1, [](k::dist::group& g) {
    CHECK(g.world_size() == 1);
    auto x = k::randn({64, 9}, k::f32, g.device(), 21);
    auto w = k::randn({9, 3}, k::f32, g.device(), 22);
    auto loss = [](auto x, auto w) { return k::mean(k::square(k::tanh(k::matmul(x, w)))); };
    auto plain = k::compile(k::value_and_grad(loss, k::wrt<1>));
    auto dp = k::dist::data_parallel(k::value_and_grad(loss, k::wrt<1>), g, {.bucket_mb = 0.001});
    auto [l0, dw0] = plain(x, w);
    auto [l1, dw1] = dp(x, w);
    check_close(l1, l0);
    check_close(dw1, dw0);
  });
  CHECK(message_of<k::error>([] { k::dist::spawn(0, [](k::dist::group&) {}); }).find("at least 1") !=
        std::string::npos);
}

// ---- two GPUs ----------------------------------------------------------------------------------

namespace {

// Rank r's input: the same numbers on the host for the check.
k::Tensor input_of(int r, std::vector<std::int64_t> shape, k::dtype dt = k::f32) {
  return k::randn(shape, dt, k::cpu, 100 + static_cast<std::uint64_t>(r));
}

}  // namespace

TEST_CASE("cuda: two ranks: all_reduce, all_gather, reduce_scatter, broadcast against the host" * needs_two_gpus()) {
  const std::vector<std::int64_t> shape{6, 10, 33};
  k::Tensor a0 = input_of(0, shape), a1 = input_of(1, shape);
  k::Tensor sum = a0 + a1, mx = k::maximum(a0, a1);
  k::Tensor avg = (a0 + a1) * 0.5f;
  std::mutex m;
  k::dist::spawn(2, [&](k::dist::group& g) {
    const int r = g.rank();
    CHECK(g.device() == k::cuda(r));
    k::Tensor x = (r == 0 ? a0 : a1).to(g.device());
    k::Tensor s = k::all_reduce(x, g), v = k::all_reduce(x, g, k::reduce_op::avg),
              xm = k::all_reduce(x, g, k::reduce_op::max);
    k::Tensor g0 = k::all_gather(x, g, 0), g1 = k::all_gather(x, g, 1), gl = k::all_gather(x, g, -1);
    k::Tensor s0 = k::reduce_scatter(x, g, 0), s1 = k::reduce_scatter(x, g, 1);
    k::Tensor b = k::broadcast(x, g, 1);
    // A collective inside a compiled function, fused work around it, replayed as a CUDA graph.
    auto f = k::compile([&](auto y) { return k::all_reduce(y * 2.0f, g) + 1.0f; }, {.cuda_graphs = true});
    k::Tensor c1 = f(x), c2 = f(x);
    std::lock_guard lock(m);
    check_close(s, sum);
    check_close(v, avg);
    check_close(xm, mx);
    check_close(g0, k::Tensor(k::cat(0, a0, a1)));
    check_close(g1, k::Tensor(k::cat(1, a0, a1)));
    check_close(gl, k::Tensor(k::cat(2, a0, a1)));
    check_close(s0, k::Tensor(k::slice(sum, 0, 3 * r, 3 * r + 3)));
    check_close(s1, k::Tensor(k::slice(sum, 1, 5 * r, 5 * r + 5)));
    check_close(b, a1);
    k::Tensor want = sum * 2.0f + 1.0f;
    check_close(c1, want, 1e-4);
    check_close(c2, want, 1e-4);
  });
}

TEST_CASE("cuda: two ranks: gradients of all_gather are reduce_scatters of the cotangents" * needs_two_gpus()) {
  k::Tensor w0 = input_of(2, {4, 12}), w1 = input_of(3, {4, 12});
  k::Tensor sum_w = w0 + w1;
  std::mutex m;
  k::dist::spawn(2, [&](k::dist::group& g) {
    const int r = g.rank();
    k::Tensor x = input_of(r, {4, 6}).to(g.device());
    k::Tensor w = (r == 0 ? w0 : w1).to(g.device());
    auto dx = k::compile(k::grad([&](auto x, auto w) { return k::sum(k::all_gather(x, g, 1) * w); }, k::wrt<0>))(x, w);
    std::lock_guard lock(m);
    check_close(dx, k::Tensor(k::slice(sum_w, 1, 6 * r, 6 * r + 6)));
  });
}

TEST_CASE("cuda: data_parallel on two GPUs gives the full batch's gradients of one GPU" * needs_two_gpus()) {
  const std::int64_t n = 512, d = 48, h = 96, classes = 10;
  k::Tensor x = k::randn({n, d}, k::f32, k::cpu, 7);
  std::vector<std::int64_t> labels(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int64_t>((i * 7 + 3) % classes);
  k::Tensor y = k::from_vector(labels, {n});
  std::vector<k::Tensor> params = {
      k::Tensor(k::randn({h, d}, k::f32, k::cpu, 8) * 0.1f), k::randn({h}, k::f32, k::cpu, 9),
      k::Tensor(k::randn({classes, h}, k::f32, k::cpu, 10) * 0.1f), k::randn({classes}, k::f32, k::cpu, 11)};
  auto loss = [](auto x, auto y, auto p) {
    return k::cross_entropy(k::linear(k::gelu(k::linear(x, p[0], p[1])), p[2], p[3]), y);
  };
  // The reference: the whole batch on cuda:0.
  std::vector<k::Tensor> p0;
  for (auto& p : params) p0.push_back(p.to(k::cuda(0)));
  auto full = k::compile(k::value_and_grad(loss, k::wrt<2>));
  auto [l_full, g_full] = full(x.to(k::cuda(0)), y.to(k::cuda(0)), p0);
  std::vector<k::Tensor> want;
  for (auto& t : g_full) want.push_back(t.to(k::cpu));
  std::mutex m;
  k::dist::spawn(2, [&](k::dist::group& g) {
    const int r = g.rank();
    std::vector<k::Tensor> p;
    for (auto& t : params) p.push_back(t.to(g.device()));
    k::Tensor xs = k::Tensor(k::slice(x, 0, r * n / 2, (r + 1) * n / 2)).to(g.device());
    k::Tensor ys = k::Tensor(k::slice(y, 0, r * n / 2, (r + 1) * n / 2)).to(g.device());
    // Small buckets (several a step); the first call checks, later ones overlap the backward.
    for (bool overlap : {true, false}) {
      auto step =
          k::dist::data_parallel(k::value_and_grad(loss, k::wrt<2>), g, {.bucket_mb = 0.01, .overlap = overlap});
      for (int call = 0; call < 3; ++call) {
        auto [l, grads] = step(xs, ys, p);
        std::lock_guard lock(m);
        CAPTURE(overlap);
        CAPTURE(call);
        CHECK(step.overlapping() == (overlap && call > 0));
        REQUIRE(grads.size() == want.size());
        for (std::size_t i = 0; i < grads.size(); ++i) check_close(grads[i], want[i], 2e-5);
      }
    }
  });
}

TEST_CASE("cuda: data_parallel overlapping the backward: a gradient that is an argument, and graph replays" *
          needs_two_gpus()) {
  // d(sum(w * x))/dw is x itself: the program returns its argument, which must be copied, not
  // averaged in place; the other gradient is averaged during the run.
  const std::int64_t n = 37, d = 129;
  k::Tensor x0 = k::randn({n, d}, k::f32, k::cpu, 21), x1 = k::randn({n, d}, k::f32, k::cpu, 22);
  k::Tensor w = k::randn({n, d}, k::f32, k::cpu, 23);
  auto f = [](auto w, auto x) { return k::sum(w * x) + k::sum(k::exp(x * 0.1f) * w); };
  // The expectations, computed once here: CPU programs compiled inside the lock below would
  // serialise the ranks for seconds each.
  const k::Tensor want_gw = (x0 + x1) * 0.5f;
  const k::Tensor want_dw = (x0 + k::exp(x0 * 0.1f) + x1 + k::exp(x1 * 0.1f)) * 0.5f;
  const k::Tensor want_dx = (w + k::exp(x0 * 0.1f) * w * 0.1f + w + k::exp(x1 * 0.1f) * w * 0.1f) * 0.5f;
  std::mutex m;
  k::dist::spawn(2, [&](k::dist::group& g) {
    k::Tensor x = (g.rank() == 0 ? x0 : x1).to(g.device()), x_before = x.to(k::cpu);
    k::Tensor wd = w.to(g.device());
    for (bool graphs : {false, true}) {
      auto step = k::dist::data_parallel(k::grad([](auto w, auto x) { return k::sum(w * x); }, k::wrt<0>), g, {},
                                         {.cuda_graphs = graphs});
      auto both = k::dist::data_parallel(k::grad(f, k::wrt<0, 1>), g, {}, {.cuda_graphs = graphs});
      for (int call = 0; call < 3; ++call) {
        k::Tensor gw = step(wd, x);
        auto [dw, dx] = both(wd, x);
        std::lock_guard lock(m);
        CAPTURE(graphs);
        CAPTURE(call);
        check_close(gw, want_gw);
        check_close(x, x_before);  // the argument itself is untouched
        check_close(dw, want_dw);
        check_close(dx, want_dx, 1e-4);
        if (call > 0) CHECK(both.overlapping() == !graphs);  // a graph replay reduces after the program
      }
    }
  });
}
