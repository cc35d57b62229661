// kiln inside an existing CUDA codebase: work ordered on the caller's streams without device
// synchronisation, wrapped buffers with strides and offsets, the reduce-overhead mode
// (.cuda_graphs) against plain launches, and kiln calls inside a capture the caller started.
// Skipped, visibly, on machines without a CUDA device.
#include <doctest/doctest.h>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "have_gpu.hpp"

namespace k = kiln;

namespace {

// A stream the test owns, non-blocking: nothing orders it with the legacy default stream.
struct OwnStream {
  CUstream s = nullptr;
  OwnStream() {
    k::driver::make_current(0);
    k::driver::check(k::driver::api().stream_create(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  }
  ~OwnStream() {
    k::driver::api().stream_synchronize(s);
    k::driver::api().stream_destroy(s);
  }
  operator k::Stream() const { return k::Stream(s); }
};

void check_close(const k::Tensor& got, const k::Tensor& want, double rtol = 1e-5, double atol = 1e-5) {
  auto r = k::testing::allclose(got, want, rtol, atol);
  CHECK_MESSAGE(bool(r), r);
}

bool bitwise_equal(const k::Tensor& a, const k::Tensor& b) { return k::to_vector<float>(a) == k::to_vector<float>(b); }

}  // namespace

TEST_CASE("interop: a chain of calls on a non-blocking stream needs no synchronisation between them" * needs_gpu()) {
  OwnStream s;
  auto step = k::compile([](auto x, auto w) { return k::rms_norm(x + 0.5f, w) * 0.9f; });
  auto x0 = k::randn({37, 129}, k::f32, k::cpu, 3), w0 = k::rand({129}, k::f32, k::cpu, 4);
  k::Tensor x = x0.to(k::cuda), w = w0.to(k::cuda);
  k::synchronize();
  for (int i = 0; i < 20; ++i) x = step(k::Stream(s), x, w);  // each step reads the previous one's output
  k::Tensor want = x0;
  for (int i = 0; i < 20; ++i) want = k::reference::eval(k::rms_norm(want + 0.5f, w0) * 0.9f);
  k::Stream(s).synchronize();
  check_close(x, want, 1e-4, 1e-4);
}

TEST_CASE("interop: a kiln call on one stream does not wait for another stream's work" * needs_gpu()) {
  OwnStream busy, mine;
  auto heavy = k::compile([](auto x) { return k::exp(k::sin(x) * 0.5f) + k::cos(x); });
  auto light = k::compile([](auto x) { return x * 2.0f; });
  auto big = k::randn({1 << 26}, k::f32, k::cuda, 5);
  auto small = k::randn({1000}, k::f32, k::cuda, 6);
  k::synchronize();
  k::Tensor hb = heavy(k::Stream(busy), big), ls = light(k::Stream(mine), small);  // compile both first
  k::Stream(busy).synchronize();
  k::Stream(mine).synchronize();
  for (int i = 0; i < 200; ++i) hb = heavy(k::Stream(busy), big);  // tens of milliseconds queued
  ls = light(k::Stream(mine), small);
  k::Stream(mine).synchronize();
  // Had kiln synchronised the device, the busy stream would be drained by now.
  CHECK(k::driver::api().stream_query(busy.s) == CUDA_ERROR_NOT_READY);
  auto got = k::to_vector<float>(ls), xs = k::to_vector<float>(small);
  for (int i = 0; i < 1000; ++i) CHECK(got[i] == doctest::Approx(xs[i] * 2.0f));
}

TEST_CASE("interop: wrapped device buffers with strides and offsets, in and out" * needs_gpu()) {
  OwnStream s;
  const std::int64_t rows = 19, cols = 33, pad = 7;
  // A host matrix of rows x (cols + pad), copied to a buffer the test owns (cudaMalloc'd in a real codebase).
  auto host = k::randn({rows, cols + pad}, k::f32, k::cpu, 9);
  std::size_t bytes = host.nbytes();
  void* buf = k::driver::allocate(bytes, 0, s.s);
  k::driver::copy_async(buf, host.data_ptr(), bytes, s.s);
  // The view starts 3 elements in and skips the padding at the end of each row.
  auto* base = static_cast<float*>(buf) + 3;
  k::Tensor x = k::Tensor::wrap(base, {rows, cols}, k::f32, k::cuda, {cols + pad, 1});
  k::Tensor xt = k::Tensor::wrap(base, {cols, rows}, k::f32, k::cuda, {1, cols + pad});  // transposed view
  k::Tensor xc =
      k::Tensor::wrap(static_cast<float*>(host.data_ptr()) + 3, {rows, cols}, k::f32, k::cpu, {cols + pad, 1});
  k::Tensor xtc =
      k::Tensor::wrap(static_cast<float*>(host.data_ptr()) + 3, {cols, rows}, k::f32, k::cpu, {1, cols + pad});

  void* out_buf = k::driver::allocate(rows * cols * 4, 0, s.s);
  k::Tensor out = k::Tensor::wrap(out_buf, {rows, cols}, k::f32, k::cuda);
  k::eval(out, k::softmax(x * 1.5f, -1) + k::transpose(xt, 0, 1), s);
  k::Stream(s).synchronize();
  check_close(out, k::reference::eval(k::softmax(xc * 1.5f, -1) + k::transpose(xtc, 0, 1)));

  auto f = k::compile([](auto a, auto b) { return k::sum(a * k::transpose(b, 0, 1), 1); });
  k::Tensor y = f(k::Stream(s), x, xt);
  k::Stream(s).synchronize();
  check_close(y, k::reference::eval(k::sum(xc * k::transpose(xtc, 0, 1), 1)), 1e-5, 1e-4);
  // Output rows inside the padded buffer itself (row pitch cols + pad, starting 3 elements in).
  k::Tensor padded = k::Tensor::wrap(base, {rows, cols}, k::f32, k::cuda, {cols + pad, 1});
  k::eval(padded, k::unsqueeze(k::sigmoid(y), 1) * x, s);
  k::Stream(s).synchronize();
  std::vector<float> all(static_cast<std::size_t>(rows * (cols + pad)));
  k::driver::copy_async(all.data(), buf, bytes, s.s);
  k::Stream(s).synchronize();
  auto yc = y.to(k::cpu);
  auto want = k::to_vector<float>(k::reference::eval(k::unsqueeze(k::sigmoid(yc), 1) * xc));
  auto host_before = k::to_vector<float>(host);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols + pad; ++c) {
      bool inside = c >= 3 && c < 3 + cols;
      float expect = inside ? want[r * cols + c - 3] : host_before[r * (cols + pad) + c];
      CHECK(all[r * (cols + pad) + c] == doctest::Approx(expect).epsilon(1e-5));
    }
  k::driver::deallocate(out_buf, rows * cols * 4, 0, s.s);
  k::driver::deallocate(buf, bytes, 0, s.s);
}

TEST_CASE("interop: buffers that are not 16-byte aligned take the kernels' tested path" * needs_gpu()) {
  // Kernels vectorise without per-access tests when their pointers are 16-byte aligned; a wrapped
  // buffer 4 bytes in is not, in and out, for a pointwise kernel (whole tiles) and a row kernel.
  OwnStream s;
  const std::int64_t rows = 64, cols = 4096, n = rows * cols;
  auto host = k::randn({n + 1}, k::f32, k::cpu, 21), w = k::randn({cols}, k::f32, k::cpu, 22);
  void* in_buf = k::driver::allocate(host.nbytes(), 0, s.s);
  void* out_buf = k::driver::allocate(host.nbytes(), 0, s.s);
  k::driver::copy_async(in_buf, host.data_ptr(), host.nbytes(), s.s);
  auto* in_f = static_cast<float*>(in_buf) + 1;
  auto* out_f = static_cast<float*>(out_buf) + 1;
  k::Tensor x = k::Tensor::wrap(in_f, {rows, cols}, k::f32, k::cuda),
            out = k::Tensor::wrap(out_f, {rows, cols}, k::f32, k::cuda);
  k::Tensor xc = k::Tensor::wrap(static_cast<float*>(host.data_ptr()) + 1, {rows, cols}, k::f32, k::cpu);
  k::Tensor wg = w.to(k::cuda);
  k::synchronize();
  k::eval(out, k::relu(x * 2.0f + 1.0f), s);
  k::Stream(s).synchronize();
  check_close(out.to(k::cpu), k::reference::eval(k::relu(xc * 2.0f + 1.0f)));
  k::eval(out, k::rms_norm(x, wg), s);
  k::Stream(s).synchronize();
  check_close(out.to(k::cpu), k::reference::eval(k::rms_norm(xc, w)), 1e-5, 1e-5);
  // The same kernels on aligned buffers (the vector path) agree.
  k::Tensor xa = xc.contiguous().to(k::cuda);
  check_close(k::eval(k::rms_norm(xa, wg)).to(k::cpu), k::reference::eval(k::rms_norm(xc, w)), 1e-5, 1e-5);
  k::driver::deallocate(out_buf, host.nbytes(), 0, s.s);
  k::driver::deallocate(in_buf, host.nbytes(), 0, s.s);
}

TEST_CASE("cuda graphs: replay equals plain launches and the reference over 100 steps with changing inputs" *
          needs_gpu()) {
  OwnStream s;
  float scale = 1.0f;
  auto body = [&scale](auto x, auto w, auto b) {
    auto h = k::layer_norm(x * scale, w, b);
    return std::make_tuple(k::softmax(h, -1), k::sum(k::gelu(h), 0));
  };
  auto plain = k::compile(body);
  auto graphed = k::compile(body, {.cuda_graphs = true});
  auto w = k::rand({257}, k::f32, k::cuda, 1), b = k::randn({257}, k::f32, k::cuda, 2);
  k::Tensor x = k::randn({45, 257}, k::f32, k::cuda, 3);
  k::synchronize();  // factories work on the default stream, which does not order non-blocking streams
  for (int step = 0; step < 100; ++step) {
    if (step % 3 == 0) {  // a new buffer (made on the default stream: wait for it)
      x = k::randn({45, 257}, k::f32, k::cuda, 100 + step);
      k::synchronize();
    } else
      k::eval(x, x * 0.75f + 0.25f, s);                   // same buffer, new values
    scale = 1.0f + 0.01f * static_cast<float>(step % 7);  // a captured scalar changes
    auto [p1, s1] = plain(k::Stream(s), x, w, b);
    auto [p2, s2] = graphed(k::Stream(s), x, w, b);
    k::Stream(s).synchronize();
    REQUIRE(bitwise_equal(p1, p2));
    REQUIRE(bitwise_equal(s1, s2));
    if (step % 10 == 0 || step == 99) {  // both equal, and both right: against the f64 oracle
      auto [want_p, want_s] = k::reference::eval(body(x.to(k::cpu), w.to(k::cpu), b.to(k::cpu)));
      check_close(p1, want_p, 1e-4, 1e-4);
      check_close(s1, want_s, 1e-4, 1e-4);
    }
  }
  auto entries = graphed.cache().entries();
  REQUIRE(entries.size() == 1);
  REQUIRE(entries[0]->graphs);
  CHECK(entries[0]->graphs->replays() == 100);
  CHECK(entries[0]->graphs->graphs() <= k::runtime::GraphReplay::max_graphs);
  MESSAGE("graph captures over 100 steps: " << entries[0]->graphs->captures());
}

TEST_CASE("cuda graphs: a steady loop replays without capturing again" * needs_gpu()) {
  auto f = k::compile([](auto x) { return k::relu(k::softmax(x, -1) - 0.01f) * 2.0f; }, {.cuda_graphs = true});
  auto x = k::randn({64, 1000}, k::f32, k::cuda, 4);
  k::Tensor y;
  for (int i = 0; i < 50; ++i) y = f(x);  // outputs alternate between two cached buffers
  k::synchronize();
  auto e = f.cache().entries().at(0);
  CHECK(e->graphs->captures() <= 3);
  check_close(y, k::reference::eval(k::relu(k::softmax(x.to(k::cpu), -1) - 0.01f) * 2.0f));
}

TEST_CASE("cuda graphs: matmul programs and replays alternating between two streams" * needs_gpu()) {
  OwnStream s1, s2;
  auto f = k::compile([](auto x, auto w, auto b) { return k::gelu(k::matmul(x, w) + b); }, {.cuda_graphs = true});
  auto x = k::randn({33, 64}, k::f32, k::cuda, 7), w = k::randn({64, 48}, k::f32, k::cuda, 8),
       b = k::randn({48}, k::f32, k::cuda, 9);
  auto want = k::reference::eval(k::gelu(k::matmul(x.to(k::cpu), w.to(k::cpu)) + b.to(k::cpu)));
  k::synchronize();
  for (int i = 0; i < 10; ++i) {
    k::Tensor y = f(k::Stream(i % 2 ? s1 : s2), x, w, b);
    k::Stream(i % 2 ? s1 : s2).synchronize();
    check_close(y, want, 2e-3, 2e-3);  // TF32-free f32 GEMM, but a different summation order
  }
}

TEST_CASE("cuda graphs: kiln calls inside a capture the caller started" * needs_gpu()) {
  OwnStream s;
  const auto& api = k::driver::api();
  auto f = k::compile([](auto x, auto w) { return k::rms_norm(x, w) * 2.0f; });
  auto x = k::randn({29, 130}, k::f32, k::cuda, 11), w = k::rand({130}, k::f32, k::cuda, 12);
  k::Tensor out = k::empty({29, 130}, k::f32, k::cuda);
  k::synchronize();
  {  // warm: both calls compiled and their buffers cached on this stream
    k::Tensor y = f(k::Stream(s), x, w);
    k::eval(out, y + x, s);
    k::Stream(s).synchronize();
  }

  k::driver::check(api.stream_begin_capture(s.s, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
  k::Tensor yc = f(k::Stream(s), x, w);  // captured, not run
  k::eval(out, yc + x, s);
  CUgraph graph = nullptr;
  k::driver::check(api.stream_end_capture(s.s, &graph), "cuStreamEndCapture");
  CUgraphExec exec = nullptr;
  k::driver::check(api.graph_instantiate(&exec, graph, 0), "cuGraphInstantiate");

  for (int i = 0; i < 5; ++i) {
    k::eval(x, x * 0.5f + 0.1f, s);  // new values in the captured buffer
    k::driver::check(api.graph_launch(exec, s.s), "cuGraphLaunch");
    k::Stream(s).synchronize();
    auto xc = x.to(k::cpu), wc = w.to(k::cpu);
    check_close(out, k::reference::eval(k::rms_norm(xc, wc) * 2.0f + xc), 1e-5, 1e-5);
  }
  api.graph_exec_destroy(exec);
  api.graph_destroy(graph);
}

TEST_CASE("cuda graphs: a call that would compile during a capture asks to warm the function first" * needs_gpu()) {
  OwnStream s;
  const auto& api = k::driver::api();
  auto cold = k::compile([](auto x) { return k::tanh(x) * 3.0f; });
  auto x = k::randn({100}, k::f32, k::cuda, 13);
  k::synchronize();  // (also: factories run on the default stream)
  k::driver::check(api.stream_begin_capture(s.s, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
  std::string message;
  try {
    cold(k::Stream(s), x);
  } catch (const k::cuda_error& e) {
    message = e.what();
  }
  CUgraph graph = nullptr;
  CUresult ended = api.stream_end_capture(s.s, &graph);
  CHECK(ended == CUDA_SUCCESS);  // kiln refused before doing anything that breaks the capture
  if (graph) api.graph_destroy(graph);
  CHECK(message.find("warm") != std::string::npos);
  CHECK(message.find("capture") != std::string::npos);
  // Afterwards the function compiles and runs normally.
  k::Tensor y = cold(k::Stream(s), x);
  k::Stream(s).synchronize();
  check_close(y, k::reference::eval(k::tanh(x.to(k::cpu)) * 3.0f));
}

TEST_CASE("cuda graphs: replays go on after the stream of the last one was destroyed" * needs_gpu()) {
  auto f = k::compile([](auto x) { return k::softmax(x * 3.0f, -1); }, {.cuda_graphs = true});
  auto x = k::randn({17, 300}, k::f32, k::cuda, 21);
  k::synchronize();
  auto want = k::reference::eval(k::softmax(x.to(k::cpu) * 3.0f, -1));
  {
    OwnStream first;  // a per-request stream, destroyed after use
    k::Tensor y = f(k::Stream(first), x);
    k::Stream(first).synchronize();
    check_close(y, want);
  }
  OwnStream second;
  k::Tensor y = f(k::Stream(second), x);
  k::Stream(second).synchronize();
  check_close(y, want);
}

TEST_CASE("cuda graphs: intermediates of a run recorded in the caller's capture are not handed out again" *
          needs_gpu()) {
  OwnStream s;
  const auto& api = k::driver::api();
  // A column sum of this size splits in two stages: an intermediate buffer of partial sums.
  auto f = k::compile([](auto x) { return k::sum(x, 0) * 2.0f; });
  auto g = k::compile([](auto x) { return k::sum(x, 0) + 1.0f; });
  auto x = k::randn({16384, 256}, k::f32, k::cuda, 31);
  k::Tensor out = k::empty({256}, k::f32, k::cuda);
  k::synchronize();
  {
    k::Tensor w = f(k::Stream(s), x);
    k::eval(out, w + 0.0f, s);
    k::Stream(s).synchronize();
  }
  k::driver::check(api.stream_begin_capture(s.s, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
  k::Tensor yc = f(k::Stream(s), x);
  k::eval(out, yc + 0.0f, s);
  CUgraph graph = nullptr;
  k::driver::check(api.stream_end_capture(s.s, &graph), "cuStreamEndCapture");
  CUgraphExec exec = nullptr;
  k::driver::check(api.graph_instantiate(&exec, graph, 0), "cuGraphInstantiate");
  k::Tensor z = g(k::Stream(s), x);  // allocates after the capture: must not get f's partial sums
  k::Stream(s).synchronize();
  auto z_before = k::to_vector<float>(z);
  k::driver::check(api.graph_launch(exec, s.s), "cuGraphLaunch");
  k::Stream(s).synchronize();
  CHECK(k::to_vector<float>(z) == z_before);
  check_close(out, k::reference::eval(k::sum(x.to(k::cpu), 0) * 2.0f), 1e-4, 1e-3);
  api.graph_exec_destroy(exec);
  api.graph_destroy(graph);
}

namespace {

// Whether cuda_matmul pads a bf16 [m, kk] @ [kk, n] into bf16 (the plan reads shapes and strides only).
bool padded(std::int64_t m, std::int64_t kk, std::int64_t n) {
  auto view = [](const k::Dims& shape) {
    return k::Tensor::empty({1}, k::bf16, k::cpu).as_strided(shape, k::contiguous_strides(shape), 0);
  };
  namespace rt = k::runtime;
  rt::GemmPlan p = rt::plan_gemm(rt::matmul_geometry(view({m, kk}), view({kk, n}), view({m, n}), "matmul"), true, true,
                                 true);
  return rt::plan_padding(p, 2, 2).pad;
}

}  // namespace

TEST_CASE("cuda graphs: padded 16-bit GEMMs are recorded with their temporaries and replayed" * needs_gpu()) {
  // Sizes off multiples of 8: cuda_matmul copies the operands into padded temporaries, which the
  // graph must keep (two products of one program share them in the capture).
  REQUIRE(padded(301, 1003, 517));
  auto body = [](auto a, auto b, auto c) { return k::matmul(a, b) + k::matmul(c, b) * 0.5f; };
  auto graphed = k::compile(body, {.cuda_graphs = true});
  auto plain = k::compile(body);
  auto a = k::randn({301, 1003}, k::bf16, k::cuda, 41), b = k::randn({1003, 517}, k::bf16, k::cuda, 42),
       c = k::randn({301, 1003}, k::bf16, k::cuda, 43);
  k::synchronize();
  OwnStream s;
  for (int i = 0; i < 6; ++i) {
    k::eval(a, a * 0.75f + 0.125f, s);  // new values each step
    k::Tensor y = graphed(k::Stream(s), a, b, c), want = plain(k::Stream(s), a, b, c);
    k::Tensor z = plain(k::Stream(s), c, b, a);  // allocations between replays: must not get the graph's blocks
    k::Stream(s).synchronize();
    CHECK(k::to_vector<float>(y) == k::to_vector<float>(want));
    if (i == 5) {
      auto ac = a.to(k::cpu), bc = b.to(k::cpu), cc = c.to(k::cpu);
      // Each product is rounded to bf16 at magnitudes near 32 (half a unit: 0.125) before the sum.
      check_close(y, k::reference::eval(body(ac, bc, cc)), 2e-2, 0.5);
      check_close(z, k::reference::eval(body(cc, bc, ac)), 2e-2, 0.5);
    }
  }
  auto e = graphed.cache().entries().at(0);
  REQUIRE(e->graphs);
  CHECK(!e->graphs->disabled());
  CHECK(e->graphs->replays() == 6);
  CHECK(e->graphs->captures() <= 3);
}

TEST_CASE("cuda graphs: a padded GEMM inside the caller's capture keeps its temporaries" * needs_gpu()) {
  REQUIRE(padded(301, 1003, 517));
  OwnStream s;
  const auto& api = k::driver::api();
  auto f = k::compile([](auto a, auto b) { return k::matmul(a, b) * 2.0f; });
  auto a = k::randn({301, 1003}, k::bf16, k::cuda, 44), b = k::randn({1003, 517}, k::bf16, k::cuda, 45),
       c = k::randn({301, 1003}, k::bf16, k::cuda, 46);
  k::Tensor out = k::empty({301, 517}, k::bf16, k::cuda);
  k::synchronize();
  {  // warm: compiled, and its temporaries cached on this stream
    k::Tensor y = f(k::Stream(s), a, b);
    k::eval(out, y + 0.0f, s);
    k::Stream(s).synchronize();
  }
  k::driver::check(api.stream_begin_capture(s.s, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
  k::Tensor yc = f(k::Stream(s), a, b);
  k::eval(out, yc + 0.0f, s);
  CUgraph graph = nullptr;
  k::driver::check(api.stream_end_capture(s.s, &graph), "cuStreamEndCapture");
  CUgraphExec exec = nullptr;
  k::driver::check(api.graph_instantiate(&exec, graph, 0), "cuGraphInstantiate");
  k::Tensor z = f(k::Stream(s), c, b);  // allocates after the capture: must not get the graph's temporaries
  k::Stream(s).synchronize();
  auto z_before = k::to_vector<float>(z);
  k::driver::check(api.graph_launch(exec, s.s), "cuGraphLaunch");
  k::Stream(s).synchronize();
  CHECK(k::to_vector<float>(z) == z_before);
  check_close(out, k::reference::eval(k::matmul(a.to(k::cpu), b.to(k::cpu)) * 2.0f), 2e-2, 2e-1);
  api.graph_exec_destroy(exec);
  api.graph_destroy(graph);
}
