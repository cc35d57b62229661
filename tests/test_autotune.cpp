// options.autotune: the candidates of each kernel (written and compiled by NVRTC here, no GPU
// needed), and on a GPU the tuned functions against the f64 reference: pointwise, rows, columns,
// a GEMM, several kernels, and an in-place update that must happen once, not once per timing.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "gradient_oracle.hpp"
#include "have_gpu.hpp"
#include "scoped_env.hpp"

namespace k = kiln;
namespace rt = kiln::runtime;

namespace {

// The program of an expression over CPU tensors for a device (no GPU needed to plan a CUDA one),
// with its autotuning candidates by default.
template <class E>
std::shared_ptr<rt::Program> plan_tuned(const E& e, k::Device device = k::Device(k::cuda), bool autotune = true,
                                        bool dynamic = false) {
  k::graph::Graph g = k::graph::flatten_result(0, e);
  k::graph::Captured cap;
  k::graph::gather(e, cap);
  std::vector<k::Tensor> args;
  for (int i = 0; i < cap.nt; ++i) args.push_back(*cap.tensors[static_cast<std::size_t>(i)]);
  auto arg = [&](int s) -> const k::Tensor& { return args.at(static_cast<std::size_t>(s)); };
  rt::LoweringStats stats;
  g = rt::lower_graph(
      g, arg, [](k::graph::Graph x) { return x; }, stats);
  k::ir::ShapeEnv env =
      dynamic ? k::ir::make_shape_env(g, [](int, int) { return true; }) : k::ir::make_static_shape_env(g);
  return rt::plan_program(std::move(g), std::move(env), device, arg, autotune, stats.tuning);
}

// Collects the autotune channel's lines while alive.
struct AutotuneLog {
  static std::string& text() {
    static std::string t;
    return t;
  }
  k::debug::LogSink old;
  AutotuneLog() {
    text().clear();
    k::debug::set_log_channels("autotune");
    old = k::debug::set_log_sink([](k::debug::Channel c, std::string_view s) {
      if (c == k::debug::Channel::autotune) text() += s;
    });
  }
  ~AutotuneLog() {
    k::debug::set_log_sink(old);
    k::debug::set_log_channels("");
  }
};

}  // namespace

TEST_CASE("autotune: each kernel's candidates are distinct sources, the rules' choice first, and all compile") {
  auto x = k::randn({96, 1000}, k::f32, k::cpu, 1), w = k::randn({1000}, k::f32, k::cpu, 2);
  auto big = k::randn({1 << 22}, k::f32, k::cpu, 3);
  auto col = k::randn({5000, 64}, k::f32, k::cpu, 4);
  for (auto p : {plan_tuned(k::layer_norm(x, w, w)), plan_tuned(k::sigmoid(big * 0.5f) * big),
                 plan_tuned(k::sum(col, 0)), plan_tuned(k::softmax(x, -1) + k::sum(k::sum(col * 2.0f, 0)))}) {
    REQUIRE(p->candidates.size() == p->kernels.size());
    for (std::size_t kk = 0; kk < p->kernels.size(); ++kk) {
      const auto& list = p->candidates[kk];
      if (p->kernels[kk].extern_node >= 0) {
        CHECK(list.empty());
        continue;
      }
      INFO(p->kernels[kk].src.name);
      REQUIRE(list.size() >= 3);
      CHECK(list[0].src.source == p->kernels[kk].src.source);
      std::set<std::string> sources;
      for (std::size_t i = 0; i < list.size(); ++i) {
        CHECK(list[i].variant == static_cast<int>(i));
        sources.insert(list[i].src.source);
        // Every candidate compiles as a translation unit of its own (sm_90a, as on an H100/H200).
        rt::Program unit;
        unit.kernels.push_back(list[i]);
        CHECK_NOTHROW(
            rt::compile_cubin(rt::cuda_translation_unit(unit, rt::program_body(unit)), list[i].src.name, "sm_90a"));
      }
      CHECK(sources.size() == list.size());
    }
  }
}

TEST_CASE("autotune: the candidates cover block shapes, loads and where weights live") {
  auto x = k::randn({64, 4096}, k::f32, k::cpu, 5), w = k::randn({4096}, k::f32, k::cpu, 6);
  auto p = plan_tuned(k::layer_norm(x, w, w));
  std::set<std::string> tunings;
  std::set<int> threads;
  for (const auto& c : p->candidates.at(0))
    tunings.insert(c.src.tuning.str()), threads.insert(c.src.config.row_threads);
  CHECK(tunings.count("default") == 1);
  CHECK(tunings.count("row_elems=8") == 1);
  CHECK(tunings.count("hoist=1") == 1);  // the rules reload w and b in blocks of one row
  CHECK(tunings.count("loads=1") == 1);
  CHECK(threads.size() >= 3);  // 32, 64, 128, 256 or 512 threads a row
}

// Column partials (schedule/partials.hpp): a CPU program needs the row held (where it is not, the
// program is planned without them, no error); a GPU row kernel keeps them in registers where it
// holds the row and in their buffer where it loops, so every candidate keeps them.
TEST_CASE("autotune: column partials only where the row stays in registers") {
  auto has_partials = [](const rt::Program& p) {
    for (const auto& kern : p.kernels)
      if (kern.src.source.find("KILN_ROW_GROUP") != std::string::npos) return true;
    return false;
  };
  // 6144 f32 columns: registers on the GPU (16 tiles at most a thread), not on the CPU (256 vectors).
  auto x = k::empty({16384, 6144}, k::f32, k::cpu), dy = k::empty({16384, 6144}, k::f32, k::cpu);
  auto expr = k::sum(dy * (x - k::mean(x, -1, true)), 0);
  CHECK(has_partials(*plan_tuned(expr, k::Device(k::cuda), false)));
  CHECK_FALSE(has_partials(*plan_tuned(expr, k::cpu, false)));
  // f64 rows of 2048: the 64-elements-a-thread candidate cannot hold them; it loops its rows and
  // keeps the partials in their buffer (it was left out while partials needed a held row).
  auto x64 = k::empty({16384, 2048}, k::f64, k::cpu), dy64 = k::empty({16384, 2048}, k::f64, k::cpu);
  auto p = plan_tuned(k::sum(dy64 * (x64 - k::mean(x64, -1, true)), 0));
  CHECK(has_partials(*p));
  bool looped = false;
  for (const auto& c : p->candidates.at(0)) {
    CHECK(c.src.partial_groups > 0);
    looped = looped || c.src.config.riters == 0;
  }
  CHECK(looped);
}

// Row kernels with column partials over narrow rows also try other row slots a block (the rule's
// count is a prediction from bytes in flight: NOTES item 154); each such candidate still folds its
// slots' sums and compiles.
TEST_CASE("autotune: column partials of narrow rows try other row slots a block") {
  auto x = k::empty({8192, 768}, k::bf16, k::cpu), dy = k::empty({8192, 768}, k::bf16, k::cpu);
  auto xf = k::cast(x, k::f32), g = k::cast(dy, k::f32);
  auto p = plan_tuned(std::make_tuple(k::sum(g * (xf - k::mean(xf, -1, true)), -1), k::sum(g * xf, 0)));
  REQUIRE(p->kernels.at(0).src.partial_groups > 0);
  std::set<int> slots;
  for (const auto& c : p->candidates.at(0)) {
    if (c.src.partial_groups == 0) continue;
    slots.insert(c.src.config.rows);
    if (c.src.config.rows > 1) CHECK(c.src.source.find("fold_row_slots") != std::string::npos);
    rt::Program unit;
    unit.kernels.push_back(c);
    CHECK_NOTHROW(rt::compile_cubin(rt::cuda_translation_unit(unit, rt::program_body(unit)), c.src.name, "sm_90a"));
  }
  CHECK(slots.count(1) == 1);
  CHECK(slots.count(2) == 1);
  CHECK(slots.count(8) == 1);
}

TEST_CASE("autotune: a second-round neighbour is the winner with one change on top") {
  k::codegen::Tuning won{.row_elems = 16, .waves = 64};
  CHECK(won.merged({.loads = 1}).str() == "row_elems=16 loads=1 waves=64");
  CHECK(won.merged({.row_elems = 8}).str() == "row_elems=8 waves=64");
  CHECK(won.merged({}) == won);
  CHECK(k::codegen::Tuning{}.str() == "default");
}

// KILN_TUNE_* variables are read when a program is lowered, not once per process: a test (or a
// process) may change one between compiles, and an autotuning candidate's choice wins over it.
TEST_CASE("tuning: KILN_TUNE_* variables are read at each compile, under a candidate's choices") {
  auto x = k::empty({1 << 23}, k::f32, k::cpu), y = k::empty({1 << 23}, k::f32, k::cpu);
  auto threads = [&] { return plan_tuned(x * y + x, k::Device(k::cuda), false)->kernels.at(0).src.config.threads; };
  CHECK(threads() == 128);
  {
    ScopedEnv e("KILN_TUNE_POI_THREADS", "256");
    CHECK(k::Tuning::from_environment().poi_threads == 256);
    CHECK(threads() == 256);
    CHECK(k::Tuning::from_environment().merged({.poi_threads = 64}).poi_threads == 64);
  }
  CHECK(threads() == 128);
  {
    ScopedEnv e("KILN_TUNE_ROW_UNROLL", "99");  // clamped to its range
    CHECK(k::Tuning::from_environment().row_unroll == 8);
    CHECK(k::Tuning::from_environment().str() == "unroll=8");
  }
  {
    ScopedEnv e("KILN_TUNE_POI_THREADS", "");  // empty is unset
    CHECK(k::Tuning::from_environment() == k::Tuning{});
  }
  // A graph-level knob: without column partials, the row kernel computes none of the column sum.
  // (A shape where the rule places partials: rows held in registers, enough rows for 256 groups.)
  auto a = k::empty({16384, 2048}, k::f32, k::cpu), dy = k::empty({16384, 2048}, k::f32, k::cpu);
  auto expr = std::make_tuple(k::sum(dy * (a - k::mean(a, -1, true)), -1), k::sum(dy, 0));
  auto groups = [&] { return plan_tuned(expr, k::Device(k::cuda), false)->kernels.at(0).src.partial_groups; };
  CHECK(groups() > 0);
  ScopedEnv e("KILN_TUNE_PARTIALS", "0");
  CHECK(groups() == 0);
}

TEST_CASE("autotune: CPU programs run the rules' choices and stay correct") {
  auto x = k::randn({33, 257}, k::f32, k::cpu, 7), w = k::randn({257}, k::f32, k::cpu, 8);
  auto f = k::compile([](auto a, auto b) { return k::layer_norm(a, b, b); }, {.autotune = true});
  auto r = k::testing::allclose(f(x, w), k::reference::eval(k::layer_norm(x, w, w)), 1e-4, 1e-4);
  CHECK_MESSAGE(bool(r), r);
  for (const auto& e : f.cache().entries()) CHECK(e->program->candidates.empty());
}

TEST_CASE("autotune: tuned functions on the GPU equal the reference, and the choice is stored" * needs_gpu()) {
  AutotuneLog log;
  auto check = [](const k::Tensor& got, const k::Tensor& expected, double rtol, double atol) {
    auto r = k::testing::allclose(got, expected, rtol, atol);
    CHECK_MESSAGE(bool(r), r);
  };
  auto x = k::randn({1031, 4096}, k::f32, k::cpu, 9), w = k::randn({4096}, k::f32, k::cpu, 10);
  auto ln = [](auto a, auto b) { return k::layer_norm(a, b, b); };
  auto f = k::compile(ln, {.autotune = true});
  check(f(x.to(k::cuda), w.to(k::cuda)), k::reference::eval(ln(x, w)), 1e-4, 1e-4);
  CHECK((log.text().find("tuned:") != std::string::npos || log.text().find("stored choice") != std::string::npos));
  for (const auto& e : f.cache().entries()) CHECK(e->program->candidates.empty());
  // Fresh inputs through the tuned program.
  auto x2 = k::randn({1031, 4096}, k::f32, k::cpu, 11);
  check(f(x2.to(k::cuda), w.to(k::cuda)), k::reference::eval(ln(x2, w)), 1e-4, 1e-4);
  // Another function of the same code reads the stored choice instead of timing again.
  log.text().clear();
  auto f2 = k::compile(ln, {.autotune = true});
  check(f2(x.to(k::cuda), w.to(k::cuda)), k::reference::eval(ln(x, w)), 1e-4, 1e-4);
  if (k::runtime::default_disk_cache().enabled()) CHECK(log.text().find("stored choice") != std::string::npos);

  // Pointwise with an odd size, special functions; a column sum; softmax with its grad.
  auto big = k::randn({(1 << 22) + 5}, k::f32, k::cpu, 12);
  auto poi = [](auto a) { return k::sigmoid(k::tanh(a * 0.5f + 0.1f) * a) * k::exp(-a * a); };
  check(k::compile(poi, {.autotune = true})(big.to(k::cuda)), k::reference::eval(poi(big)), 1e-5, 1e-6);
  auto cols = k::randn({3001, 77}, k::f32, k::cpu, 13);
  auto colsum = [](auto a) { return k::sum(a * 2.0f, 0); };
  check(k::compile(colsum, {.autotune = true})(cols.to(k::cuda)), k::reference::eval(colsum(cols)), 1e-4, 1e-3);
  k::Tensor t = k::cast(k::rand({513}, k::f32, k::cpu, 14) * 999.0f, k::i64);
  auto logits = k::randn({513, 1000}, k::f32, k::cpu, 15);
  auto dce = k::grad([](auto l, auto tt) { return k::cross_entropy(l, tt); }, k::wrt<0>);
  auto ce = k::compile(dce, {.autotune = true});
  check(ce(logits.to(k::cuda), t.to(k::cuda)), k::compile(dce)(logits, t), 1e-4, 1e-7);  // the CPU's, untuned

  // A GEMM with a bias and gelu: cuBLASLt's algorithms are timed too.
  auto a = k::randn({257, 512}, k::bf16, k::cpu, 16), bm = k::randn({512, 384}, k::bf16, k::cpu, 17);
  auto bias = k::randn({384}, k::bf16, k::cpu, 18);
  auto mlp = [](auto p, auto q, auto r) { return k::gelu(k::matmul(p, q) + r); };
  log.text().clear();
  auto g = k::compile(mlp, {.autotune = true});
  check(g(a.to(k::cuda), bm.to(k::cuda), bias.to(k::cuda)), k::reference::eval(mlp(a, bm, bias)), 2e-2, 2e-2);
  CHECK(log.text().find("matmul") != std::string::npos);
}

TEST_CASE("autotune: an in-place update is applied once by the first call, however often it was timed" * needs_gpu()) {
  auto p0 = k::randn({(1 << 20) + 3}, k::f32, k::cpu, 19), g0 = k::randn({(1 << 20) + 3}, k::f32, k::cpu, 20);
  auto step = k::compile([](auto p, auto g) { return k::assign(p, p - g * 0.25f); }, {.autotune = true});
  auto p = p0.to(k::cuda), g = g0.to(k::cuda);
  step(p, g);
  auto r = k::testing::allclose(p, k::reference::eval(p0 - g0 * 0.25f), 1e-6, 1e-6);
  CHECK_MESSAGE(bool(r), r);
  step(p, g);
  r = k::testing::allclose(p, k::reference::eval(p0 - g0 * 0.5f), 1e-6, 1e-6);
  CHECK_MESSAGE(bool(r), r);
}

TEST_CASE("autotune: CUDA graphs replay the tuned kernels" * needs_gpu()) {
  auto x = k::randn({300, 2048}, k::f32, k::cpu, 21);
  auto sm = [](auto a) { return k::softmax(a * 2.0f, -1); };
  auto f = k::compile(sm, {.cuda_graphs = true, .autotune = true});
  for (int i = 0; i < 3; ++i) {
    auto r = k::testing::allclose(f(x.to(k::cuda)), k::reference::eval(sm(x)), 1e-5, 1e-7);
    CHECK_MESSAGE(bool(r), r);
  }
}

// NOTES 175: a held row's live tiles counted from the compiling call's length (the default) narrow
// the lengths its kernel serves to those tiles' end up; the held kernel of the rule before
// (KILN_TUNE_LIVE_TILES=4) serves the lengths between, before the looped twin. Planned for CUDA from CPU
// tensors; which kernel a call launches (rt::kernel_for) at lengths in each range.
TEST_CASE("a held row of symbolic length with live tiles from the compiling length keeps the lengths below") {
  auto x = k::randn({37, 3073}, k::bf16, k::cpu, 3);
  auto e = k::softmax(x, -1);
  auto held_kernel = [](const rt::Program& p) -> const rt::CompiledKernel* {
    for (const auto& kern : p.kernels)
      if (kern.extern_node < 0 && kern.src.held_max > 0) return &kern;
    return nullptr;
  };
  auto launched = [](const rt::Program& p, const rt::CompiledKernel& kern, std::int64_t n) {
    std::vector<std::int64_t> sizes = p.env.example;
    sizes.at(static_cast<std::size_t>(kern.src.held_rnumel.symbol_id())) = n;
    return &rt::kernel_for(kern, k::Bindings(sizes.data(), sizes.size()));
  };
  std::shared_ptr<rt::Program> before;
  {
    ScopedEnv four("KILN_TUNE_LIVE_TILES", "4");
    before = plan_tuned(e, k::Device(k::cuda), false, true);
  }
  const rt::CompiledKernel* plain = held_kernel(*before);
  REQUIRE(plain);
  REQUIRE(plain->looped);
  CHECK_FALSE(k::codegen::specialised(plain->looped->src));  // the rule before: held, then looped
  std::shared_ptr<rt::Program> p = plan_tuned(e, k::Device(k::cuda), false, true);
  const rt::CompiledKernel* held = held_kernel(*p);
  REQUIRE(held);
  INFO(held->src.source);
  const std::int64_t tile = std::int64_t{held->src.config.row_threads} * held->src.config.rvec;
  CHECK(held->src.held_min == 3073 / tile * tile);  // the whole tiles inside 3073
  REQUIRE(held->looped);
  const rt::CompiledKernel& middle = *held->looped;
  CHECK(middle.src.held_min == plain->src.held_min);  // the rule before's range
  CHECK(middle.src.held_max == held->src.held_max);
  CHECK(middle.src.source != held->src.source);
  REQUIRE(middle.looped);
  CHECK_FALSE(k::codegen::specialised(middle.looped->src));
  CHECK(launched(*p, *held, 3073) == held);
  CHECK(launched(*p, *held, held->src.held_min) == held);
  CHECK(launched(*p, *held, held->src.held_min - 1) == &middle);
  CHECK(launched(*p, *held, middle.src.held_min) == &middle);
  CHECK(launched(*p, *held, middle.src.held_min - 1) == middle.looped.get());
  CHECK(launched(*p, *held, held->src.held_max + 1) == middle.looped.get());
  // Every kernel of the chain is in the program's source, each compiled as a unit of its own.
  CHECK(rt::program_body(*p).find(middle.src.source) != std::string::npos);
}

TEST_CASE("autotune: a row of symbolic length is held with a looped twin by the rules, looped in every candidate") {
  // Planned for CUDA from CPU tensors (no GPU needed). The rules hold a row of 3000 f32 values as
  // at that length and keep the kernel written looped for the lengths the held one does not serve;
  // candidates are timed at one length only, so none of them holds a row of symbolic length.
  auto x = k::randn({37, 3000}, k::f32, k::cpu, 1);
  auto e = k::softmax(x, -1) * 3.0f;
  auto rows_kernel = [](const rt::Program& p) -> const rt::CompiledKernel* {
    for (const auto& kern : p.kernels)
      if (kern.extern_node < 0 && kern.src.kind != k::schedule::Kind::poi) return &kern;
    return nullptr;
  };
  auto p = plan_tuned(e, k::Device(k::cuda), false, true);
  const rt::CompiledKernel* held = rows_kernel(*p);
  REQUIRE(held);
  INFO(held->src.source);
  CHECK(held->src.config.riters > 0);
  CHECK(held->src.held_min <= 3000);
  CHECK(held->src.held_max >= 3000);
  CHECK(held->src.held_multiple == 4);
  // Its chain of twins (a held one serving the shorter lengths first, NOTES 175) ends looped.
  REQUIRE(held->looped);
  const rt::CompiledKernel* last = held;
  rt::each_twin(*held, [&](const rt::CompiledKernel& t) { last = &t; });
  CHECK(last != held);
  CHECK(last->src.config.riters == 0);
  CHECK(last->src.held_max == 0);
  REQUIRE(held->src.held_rnumel.kind() == k::SymKind::symbol);
  std::vector<std::int64_t> sizes = p->env.example;
  auto served = [&](std::int64_t n) {
    sizes.at(static_cast<std::size_t>(held->src.held_rnumel.symbol_id())) = n;
    return k::codegen::serves(held->src, k::Bindings(sizes.data(), sizes.size()));
  };
  const std::int64_t lo = held->src.held_min, hi = held->src.held_max;
  CHECK(served(3000));
  CHECK(served(hi));
  CHECK(served(lo + (4 - lo % 4) % 4));
  CHECK_FALSE(served(hi + 4));
  CHECK_FALSE(served(lo - 4));
  CHECK_FALSE(served(3002));  // not whole vectors
  CHECK_FALSE(served(100));

  auto tuned = plan_tuned(e, k::Device(k::cuda), true, true);
  REQUIRE(rows_kernel(*tuned));
  for (const auto& kern : tuned->kernels) {
    CHECK_FALSE(k::codegen::specialised(kern.src));
    CHECK_FALSE(kern.looped);
  }
  int candidates = 0;
  for (const auto& list : tuned->candidates)
    for (const auto& c : list) {
      ++candidates;
      CHECK_FALSE(k::codegen::specialised(c.src));
    }
  CHECK(candidates > 1);
}

TEST_CASE("autotune: a permute over symbolic sizes moves whole vectors where its sizes are multiples of them") {
  // Planned for CUDA from CPU tensors. The head dim (64) is a multiple of the 8-lane bf16 vector at
  // the compiling call: the kernel takes it as one (a tile of the output then reads one contiguous
  // run of the input, its index computed once a tile), and the program keeps the kernel written
  // without that assumption for calls where it fails.
  auto h = k::randn({2, 16, 3, 64}, k::bf16, k::cpu, 5);
  auto p = plan_tuned(k::permute(h, {0, 2, 1, 3}) * 2.0f, k::Device(k::cuda), false, true);
  const rt::CompiledKernel* kern = nullptr;
  for (const auto& c : p->kernels)
    if (c.extern_node < 0) kern = &c;
  REQUIRE(kern);
  INFO(kern->src.source);
  CHECK(kern->src.source.find("kiln::load_contig<XVEC") != std::string::npos);
  REQUIRE_FALSE(kern->src.assumed_multiples.empty());
  CHECK(kern->src.assumed_by == 8);
  REQUIRE(kern->looped);
  CHECK(kern->looped->src.assumed_multiples.empty());
  CHECK(kern->looped->src.source.find("kiln::load(in_ptr0") != std::string::npos);
  std::vector<std::int64_t> sizes = p->env.example;
  CHECK(k::codegen::serves(kern->src, k::Bindings(sizes.data(), sizes.size())));
  for (auto& v : sizes)
    if (v == 64) v = 65;  // a head dim of 65: the unassuming twin
  CHECK_FALSE(k::codegen::serves(kern->src, k::Bindings(sizes.data(), sizes.size())));
}

TEST_CASE(
    "autotune: with KILN_TUNE_GEMM_TEMPLATE=1 a training step's GEMMs may take kiln's template, and "
    "the values hold" *
    needs_gpu()) {
  // A bf16 MLP's value and gradients: the forward's GEMMs with bias and with bias + tanh-gelu kept
  // for the backward (GELU_AUX), the backward's with DGELU and plain ones, some of them over
  // transposed operands (the loss a sum, so the gradients are not small next to the tolerance).
  // Each GEMM step times cuBLASLt against the template's blockings at its
  // first call; the tuning call and the call after it (the kept choices) match the unfused f64
  // oracle either way.
  ScopedEnv on("KILN_TUNE_GEMM_TEMPLATE", "1");
  auto loss = [](auto x, auto w1, auto b1, auto w2, auto b2) {
    auto h = k::gelu(k::matmul(x, w1) + b1, k::approximate::tanh);
    return k::sum(k::square(k::matmul(h, w2) + b2));
  };
  const k::Tensor x = k::randn({300, 256}, k::bf16, k::cpu, 31);
  const k::Tensor w1 = k::Tensor(k::randn({256, 520}, k::bf16, k::cpu, 32) * 0.05f);
  const k::Tensor b1 = k::randn({520}, k::bf16, k::cpu, 33);
  const k::Tensor w2 = k::Tensor(k::randn({520, 136}, k::bf16, k::cpu, 34) * 0.05f);
  const k::Tensor b2 = k::randn({136}, k::bf16, k::cpu, 35);
  auto step = k::value_and_grad(loss, k::wrt<1, 2, 3, 4>);
  auto f64 = [](const k::Tensor& t) { return k::Tensor(k::cast(t, k::f64)); };
  const auto want = oracle_outputs(step, f64(x), f64(w1), f64(b1), f64(w2), f64(b2));
  AutotuneLog log;
  auto tuned = k::compile(step, {.autotune = true});
  for (int call = 0; call < 2; ++call) {  // the tuning call, then the kept choices
    CAPTURE(call);
    auto got = tuned(x.to(k::cuda), w1.to(k::cuda), b1.to(k::cuda), w2.to(k::cuda), b2.to(k::cuda));
    std::size_t i = 0;
    std::apply(
        [&](const auto&... g) {
          (
              [&](const k::Tensor& t) {
                CAPTURE(i);
                // bf16 intermediates (h, dy) summed over 300 rows: 5% of each value, and 2% of the
                // output's largest one for elements whose sums cancel.
                const k::reference::Value& w = want[i++];
                double largest = 0;
                for (double v : w.data) largest = std::max(largest, std::abs(v));
                auto r = k::testing::allclose(t.to(k::f64), k::reference::to_tensor(w), 5e-2, 2e-2 * largest);
                CHECK_MESSAGE(bool(r), r);
              }(g),
              ...);
        },
        got);
  }
  MESSAGE(log.text());
  CHECK(log.text().find("kiln_mm_") != std::string::npos);  // the template's blockings were timed
}
