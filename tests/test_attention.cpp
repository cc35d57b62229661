// k::attention (API.md "attention"): against the oracle's naive f64 softmax(q k^T * scale) v and a
// composition written here, causal and not, grouped-query heads, Tq != Tk, odd sizes, a given scale,
// bf16; gradients by gradcheck; typed errors naming the shapes; on the CPU and the GPU.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <ostream>

#include <limits>
#include <vector>

#include <kiln/codegen/attention_backward_kernel_sm90.hpp>
#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "gradient_oracle.hpp"
#include "have_gpu.hpp"
#include "scoped_env.hpp"

namespace k = kiln;

namespace {

void check_values(k::Device dev, k::dtype dt, double tol) {
  for (bool causal : {false, true})
    for (auto [H, Hkv] : {std::pair{4, 4}, std::pair{6, 2}}) {
      INFO("causal " << causal << " H " << H << " Hkv " << Hkv << " " << k::name(dt) << " on " << dev);
      k::Tensor q = k::randn({2, H, 7, 5}, dt, dev, 1), kk = k::randn({2, Hkv, 11, 5}, dt, dev, 2);
      k::Tensor v = k::randn({2, Hkv, 11, 3}, dt, dev, 3);
      auto a = k::attention(q, kk, v, {.causal = causal});
      k::Tensor got = a;
      CHECK(got.shape() == std::vector<std::int64_t>{2, H, 7, 3});
      CHECK(got.dtype() == dt);
      auto r = k::testing::allclose(got, k::reference::eval(a), tol, tol);
      CHECK_MESSAGE(r, r);
      auto scaled = k::attention(q, kk, v, {.causal = causal, .scale = 0.3});
      auto rs = k::testing::allclose(k::Tensor(scaled), k::reference::eval(scaled), tol, tol);
      CHECK_MESSAGE(rs, rs);
    }
  // Equal heads, no mask: the composition softmax(q k^T / sqrt(D)) v written with k::matmul.
  k::Tensor q = k::randn({3, 9, 16}, dt, dev, 4), kk = k::randn({3, 13, 16}, dt, dev, 5);
  k::Tensor v = k::randn({3, 13, 8}, dt, dev, 6);
  auto mine = k::matmul(k::softmax(k::matmul(q, k::transpose(kk, 1, 2)) * 0.25, -1), v);
  auto theirs = k::reshape(
      k::attention(k::reshape(q, {1, 3, 9, 16}), k::reshape(kk, {1, 3, 13, 16}), k::reshape(v, {1, 3, 13, 8})),
      {3, 9, 8});
  auto r = k::testing::allclose(k::Tensor(theirs), k::reference::eval(mine), tol, tol);
  CHECK_MESSAGE(r, r);
}

}  // namespace

namespace {
std::string& autotune_text() {  // the autotune channel's lines, collected by a test's log sink
  static std::string t;
  return t;
}
}  // namespace

TEST_CASE("attention: against the oracle, causal and not, grouped-query heads, Tq != Tk (cpu)") {
  check_values(k::cpu, k::f32, 1e-5);
  check_values(k::cpu, k::bf16, 3e-2);
}
TEST_CASE("attention: against the oracle (cuda)" * needs_gpu()) {
  check_values(k::cuda, k::f32, 1e-5);
  check_values(k::cuda, k::bf16, 3e-2);
}

namespace {

// A case of the fused kernels' tests: sizes, mask and dtype, printed as INFO shows it; its q, k and
// v on the CPU, each from the next seed.
struct FusedCase {
  int B, H, Hkv, Tq, Tk, D;
  bool causal;
  k::dtype dt;
  std::array<k::Tensor, 3> operands(int& seed) const {
    return {k::randn({B, H, Tq, D}, dt, k::cpu, ++seed), k::randn({B, Hkv, Tk, D}, dt, k::cpu, ++seed),
            k::randn({B, Hkv, Tk, D}, dt, k::cpu, ++seed)};
  }
};
std::ostream& operator<<(std::ostream& os, const FusedCase& c) {
  return os << "B " << c.B << " H " << c.H << " Hkv " << c.Hkv << " Tq " << c.Tq << " Tk " << c.Tk << " D " << c.D
            << " causal " << c.causal << " " << k::name(c.dt);
}

}  // namespace

// 16-bit q, k, v with a head dim the fused kernel takes (a multiple of 16 up to 128) run it
// (runtime/extern/attention.hpp); its gradients come from the rule that recomputes the
// probabilities. Odd lengths, Tq != Tk both ways, grouped heads, a given scale, both 16-bit dtypes.
TEST_CASE("attention: the fused kernel against the oracle, and its gradients (cuda)" * needs_gpu()) {
  const FusedCase cases[] = {{2, 4, 4, 100, 100, 64, false, k::bf16}, {2, 4, 4, 100, 100, 64, true, k::bf16},
                             {1, 8, 2, 77, 130, 128, false, k::bf16}, {1, 8, 2, 130, 77, 128, true, k::bf16},
                             {2, 3, 1, 65, 200, 80, true, k::f16},    {1, 2, 2, 33, 16, 32, false, k::f16},
                             {1, 2, 1, 300, 300, 128, true, k::f16}};
  int seed = 40;
  for (const FusedCase& c : cases) {
    INFO(c);
    const std::array<k::Tensor, 3> ops = c.operands(seed);
    const k::Tensor &q = ops[0], &kk = ops[1], &v = ops[2];
    auto plain = [&](auto q, auto k, auto v) { return k::attention(q, k, v, {.causal = c.causal}); };
    auto scaled = [&](auto q, auto k, auto v) { return k::attention(q, k, v, {.causal = c.causal, .scale = 0.11}); };
    auto gq = q.to(k::cuda), gk = kk.to(k::cuda), gv = v.to(k::cuda);
    auto r = k::testing::allclose(k::Tensor(plain(gq, gk, gv)), k::reference::eval(plain(q, kk, v)), 2e-2, 2e-2);
    CHECK_MESSAGE(bool(r), r);
    auto rs = k::testing::allclose(k::Tensor(scaled(gq, gk, gv)), k::reference::eval(scaled(q, kk, v)), 2e-2, 2e-2);
    CHECK_MESSAGE(bool(rs), rs);
    auto report = k::explain(k::compile(plain), gq, gk, gv);
    bool fused = false;
    for (const auto& kernel : report.kernels)
      for (const auto& op : kernel.fused_ops) fused = fused || op == "attention_flash";
    CHECK_MESSAGE(fused, report);
    // Gradients of sum(attention * w) against the oracle's (reference/eval_attention.hpp: the f64
    // definition), given the cotangent the output receives, w in the output's dtype.
    k::Tensor w = k::randn({c.B, c.H, c.Tq, c.D}, k::f32, k::cpu, ++seed);
    auto loss = [&](auto q, auto k, auto v, auto w) { return k::sum(k::cast(plain(q, k, v), k::f32) * w); };
    auto vg = k::value_and_grad(loss, k::wrt<0, 1, 2>);
    auto wc = w.to(k::cuda);
    auto got = vg(gq, gk, gv, wc);
    // dk and dv come from one kernel at every head dim the fused kernels take (D <= 128), on Hopper
    // with dq too where q, k and v have one shape and the registers hold it (D 64).
    // The forward's kernel writes the rows' log-sum-exp the backward reads: no kernel of its own.
    bool joined = false, lse_in_forward = false, lse_alone = false;
    for (const auto& kernel : k::explain(vg, gq, gk, gv, wc).kernels) {
      joined = joined || kernel.source.find("kiln_attention_bwd_dkv_") != std::string::npos ||
               kernel.source.find("kiln_attention_bwd_dqkv_") != std::string::npos;
      const auto& ops = kernel.fused_ops;
      bool lse = std::find(ops.begin(), ops.end(), "attention_lse") != ops.end();
      lse_in_forward = lse_in_forward || (lse && ops.front() == "attention_flash");
      lse_alone = lse_alone || (lse && ops.front() == "attention_lse");
    }
    CHECK(joined == (c.D <= 128));
    CHECK(lse_in_forward);
    CHECK(!lse_alone);
    const k::Tensor grads[3] = {std::get<1>(got), std::get<2>(got), std::get<3>(got)};
    k::Attrs at;
    at.a = c.causal;
    auto g = k::cast(w, c.dt);
    auto stats = k::expr::make<k::Op::attention_lse>(at, q, kk, 0.0);  // (the oracle's gradients do not read it)
    // Where no forward kernel writes it, a kernel of its own computes the log-sum-exp.
    auto lse_alone_r = k::testing::allclose(k::Tensor(k::expr::make<k::Op::attention_lse>(at, gq, gk, 0.0)),
                                            k::reference::eval(stats), 1e-3, 1e-3);
    CHECK_MESSAGE(bool(lse_alone_r), "attention_lse: " << lse_alone_r);
    for (int which = 0; which < 3; ++which) {  // dq, dk, dv
      at.c = which;
      auto want = k::reference::eval(k::expr::make<k::Op::attention_grad>(at, q, kk, v, g, stats, 0.0));
      auto r = k::testing::allclose(grads[which].to(k::f64), want, 3e-2, 3e-2);
      CHECK_MESSAGE(bool(r), "gradient " << which << ": " << r);
    }
  }
}

// On Hopper (compute capability 9.0) head dims 64 and 128 run the warpgroup-MMA forward
// (codegen/attention_kernel_sm90.hpp): 128 query rows a block, key tiles of 128 in two stages. Several
// tiles each way, lengths no multiple of a tile, Tq != Tk both ways, grouped heads, causal rows that
// see fewer keys than a tile, both 16-bit dtypes: the default kernels, KILN_TUNE_ATTENTION_WGMMA=2's
// forward of one warpgroup a block, =3's fed by a producer warpgroup
// (codegen/attention_kernel_sm90_pingpong.hpp), =4's three consumer warpgroups (at D 64), =5's looping
// forward (at D 64), =6's taking tiles from a counter, and =0's mma.sync kernels against the oracle, forward
// and gradients (Hopper's dq and dk/dv kernels, which read the forward's log-sum-exp).
TEST_CASE("attention: the Hopper kernels and the mma.sync ones against the oracle (cuda)" * needs_gpu()) {
  struct Case {
    int B, H, Hkv, Tq, Tk, D;
    bool causal;
    k::dtype dt;
  };
  const Case cases[] = {{1, 3, 1, 300, 517, 64, true, k::bf16},
                        {1, 4, 2, 517, 300, 128, false, k::bf16},
                        {2, 2, 2, 391, 391, 128, true, k::f16},
                        {1, 2, 2, 129, 129, 64, false, k::f16},
                        {1, 2, 1, 1, 260, 128, false, k::bf16},
                        {1, 2, 2, 257, 5, 64, true, k::bf16},
                        // past a producer's stages twice over (key tiles of 128 in three stages)
                        {1, 2, 2, 1000, 1100, 64, false, k::bf16},
                        {1, 2, 1, 1000, 1000, 128, true, k::bf16}};
  const bool hopper = k::driver::compute_capability(0) == 90;
  int seed = 90;
  for (const Case& c : cases)
    for (const char* wgmma : {"1", "2", "3", "4", "5", "6", "0"}) {
      ScopedEnv knob("KILN_TUNE_ATTENTION_WGMMA", wgmma);
      INFO("KILN_TUNE_ATTENTION_WGMMA=" << std::string(wgmma) << " B " << c.B << " H " << c.H << " Hkv " << c.Hkv
                                        << " Tq " << c.Tq << " Tk " << c.Tk << " D " << c.D << " causal " << c.causal
                                        << " " << k::name(c.dt));
      k::Tensor q = k::randn({c.B, c.H, c.Tq, c.D}, c.dt, k::cpu, ++seed);
      k::Tensor kk = k::randn({c.B, c.Hkv, c.Tk, c.D}, c.dt, k::cpu, ++seed);
      k::Tensor v = k::randn({c.B, c.Hkv, c.Tk, c.D}, c.dt, k::cpu, ++seed);
      k::Tensor w = k::randn({c.B, c.H, c.Tq, c.D}, k::f32, k::cpu, ++seed);
      auto f = [&](auto q, auto k, auto v) { return k::attention(q, k, v, {.causal = c.causal}); };
      auto gq = q.to(k::cuda), gk = kk.to(k::cuda), gv = v.to(k::cuda), gw = w.to(k::cuda);
      auto compiled = k::compile(f);
      auto r = k::testing::allclose(k::Tensor(compiled(gq, gk, gv)), k::reference::eval(f(q, kk, v)), 2e-2, 2e-2);
      CHECK_MESSAGE(bool(r), r);
      std::string source;
      for (const auto& kernel : k::explain(compiled, gq, gk, gv).kernels)
        if (kernel.source.find("kiln_attention_fwd_") != std::string::npos) source = kernel.source;
      const bool warpgroups = hopper && wgmma[0] != '0';
      CHECK((source.find("kiln_attention_fwd_wgmma_") != std::string::npos) == warpgroups);
      CHECK((source.find("_wg1_k128") != std::string::npos) == (warpgroups && wgmma[0] == '2'));
      const bool producer = warpgroups && wgmma[0] >= '3';
      CHECK((source.find("_pp") != std::string::npos) == producer);
      CHECK((source.find("_wg3_") != std::string::npos) == (producer && wgmma[0] >= '4' && c.D == 64));
      // (=5 loops where q's second buffer leaves three key stages: at D 64)
      CHECK((source.find("_pp_loop") != std::string::npos) == (producer && wgmma[0] == '5' && c.D == 64));
      // The gradients (Hopper: the warpgroup kernels for dq and dk/dv too) read the forward's
      // log-sum-exp: a wrong one shows there.
      auto loss = [&](auto q, auto k, auto v, auto w) { return k::sum(k::cast(f(q, k, v), k::f32) * w); };
      auto vg = k::value_and_grad(loss, k::wrt<0, 1, 2>);
      auto got = vg(gq, gk, gv, gw);
      const k::Tensor grads[3] = {std::get<1>(got), std::get<2>(got), std::get<3>(got)};
      bool wgmma_dq = false, wgmma_dkv = false;
      for (const auto& kernel : k::explain(vg, gq, gk, gv, gw).kernels) {
        const bool all = kernel.source.find("kiln_attention_bwd_dqkv_wgmma_") != std::string::npos;
        wgmma_dq = wgmma_dq || all || kernel.source.find("kiln_attention_bwd_dq_wgmma_") != std::string::npos;
        wgmma_dkv = wgmma_dkv || all || kernel.source.find("kiln_attention_bwd_dkv_wgmma_") != std::string::npos;
      }
      CHECK(wgmma_dq == warpgroups);
      CHECK(wgmma_dkv == warpgroups);
      k::Attrs at;
      at.a = c.causal;
      auto stats = k::expr::make<k::Op::attention_lse>(at, q, kk, 0.0);
      for (int which = 0; which < 3; ++which) {  // dq, dk, dv
        at.c = which;
        auto want =
            k::reference::eval(k::expr::make<k::Op::attention_grad>(at, q, kk, v, k::cast(w, c.dt), stats, 0.0));
        auto rg = k::testing::allclose(grads[which].to(k::f64), want, 3e-2, 3e-2);
        CHECK_MESSAGE(bool(rg), "gradient " << which << ": " << rg);
      }
    }
}

// KILN_TUNE_ATTENTION_WGMMA=5 on Hopper: the producer forward looping, one block an SM, over more
// query tiles than there are SMs (each block one to five: q's two buffers reused from a block's third
// tile, key stages and their phases counted across tiles, turns handed from one tile to the next),
// and =6 taking each block's next tile from a counter (NOTES item 188).
// Each tile's arithmetic is =4's, so the outputs match =4's bit for bit, and so do dk and dv (which
// read its log-sum-exp); dq to one bf16 rounding where the dk/dv kernel adds its sums atomically.
// The forward also against the oracle, and with no keys (every row empty: zeros) over 576 tiles.
// (D 128 does not loop: two q buffers would cost a key stage.)
TEST_CASE("attention: the looping Hopper forward over more query tiles than SMs (cuda)" * needs_gpu()) {
  if (k::driver::compute_capability(0) != 90) {
    MESSAGE("the looping forward is Hopper's: skipped on compute capability " << k::driver::compute_capability(0));
    return;
  }
  struct Case {
    int B, H, Hkv, Tq, Tk, D;
    bool causal;
  };
  // 168 to 576 query tiles of 192 rows on 132 SMs; Tq 1000: a last tile of 40 rows; Tk 100: one key
  // tile a query tile, so each block's tiles share its three stages.
  const Case cases[] = {{3, 16, 4, 1000, 1000, 64, true}, {3, 16, 16, 1000, 1000, 64, false},
                        {3, 16, 4, 700, 1300, 64, true},  {4, 21, 7, 333, 1100, 64, false},
                        {4, 24, 8, 1000, 600, 64, true},  {4, 24, 8, 1000, 100, 64, false}};
  int seed = 500;
  for (const Case& c : cases) {
    INFO("B " << c.B << " H " << c.H << " Hkv " << c.Hkv << " Tq " << c.Tq << " Tk " << c.Tk << " D " << c.D
              << " causal " << c.causal);
    k::Tensor q = k::randn({c.B, c.H, c.Tq, c.D}, k::bf16, k::cpu, ++seed);
    k::Tensor kk = k::randn({c.B, c.Hkv, c.Tk, c.D}, k::bf16, k::cpu, ++seed);
    k::Tensor v = k::randn({c.B, c.Hkv, c.Tk, c.D}, k::bf16, k::cpu, ++seed);
    k::Tensor w = k::randn({c.B, c.H, c.Tq, c.D}, k::f32, k::cpu, ++seed);
    auto gq = q.to(k::cuda), gk = kk.to(k::cuda), gv = v.to(k::cuda), gw = w.to(k::cuda);
    auto f = [&](auto q, auto k, auto v) { return k::attention(q, k, v, {.causal = c.causal}); };
    auto loss = [&](auto q, auto k, auto v, auto w) { return k::sum(k::cast(f(q, k, v), k::f32) * w); };
    k::Tensor out[3], grads[3][3];
    for (int run = 0; run < 3; ++run) {  // =4, =5, =6
      ScopedEnv knob("KILN_TUNE_ATTENTION_WGMMA", run == 0 ? "4" : run == 1 ? "5" : "6");
      auto compiled = k::compile(f);
      out[run] = k::Tensor(compiled(gq, gk, gv)).to(k::cpu);
      std::string source;
      for (const auto& kernel : k::explain(compiled, gq, gk, gv).kernels)
        if (kernel.source.find("kiln_attention_fwd_") != std::string::npos) source = kernel.source;
      CHECK((source.find("_pp_loop") != std::string::npos) == (run == 1 && c.D == 64));
      CHECK((source.find("_pp_dyn") != std::string::npos) == (run == 2 && c.D == 64));
      auto got = k::value_and_grad(loss, k::wrt<0, 1, 2>)(gq, gk, gv, gw);
      grads[run][0] = std::get<1>(got).to(k::cpu);
      grads[run][1] = std::get<2>(got).to(k::cpu);
      grads[run][2] = std::get<3>(got).to(k::cpu);
    }
    auto r = k::testing::allclose(out[1], k::reference::eval(f(q, kk, v)), 2e-2, 2e-2);
    CHECK_MESSAGE(bool(r), r);
    for (int run = 1; run < 3; ++run) {
      auto same = k::testing::allclose(out[run], out[0], 0, 0);
      CHECK_MESSAGE(bool(same), "=" << run + 4 << " against =4: " << same);
      for (int which = 0; which < 3; ++which) {
        // dq: one bf16 rounding apart (up to 2^-7 relative) where its atomic sums land in another order
        auto g = k::testing::allclose(grads[run][which], grads[0][which], which == 0 ? 1e-2 : 0, which == 0 ? 1e-6 : 0);
        CHECK_MESSAGE(bool(g), "gradient " << which << ", =" << run + 4 << " against =4: " << g);
      }
    }
  }
  for (const char* wgmma : {"5", "6"})
    for (bool causal : {false, true}) {  // no keys: each tile loads q and no key stage, its rows zeros
      INFO("no keys, 576 query tiles, causal " << causal << ", KILN_TUNE_ATTENTION_WGMMA=" << wgmma);
      ScopedEnv knob("KILN_TUNE_ATTENTION_WGMMA", wgmma);
      k::Tensor q = k::randn({4, 24, 1000, 64}, k::bf16, k::cpu, ++seed);
      k::Tensor kk = k::randn({4, 8, 0, 64}, k::bf16, k::cpu, ++seed);
      k::Tensor v = k::randn({4, 8, 0, 64}, k::bf16, k::cpu, ++seed);
      auto f = [&](auto q, auto k, auto v) { return k::attention(q, k, v, {.causal = causal}); };
      auto r = k::testing::allclose(k::Tensor(k::compile(f)(q.to(k::cuda), kk.to(k::cuda), v.to(k::cuda))),
                                    k::reference::eval(f(q, kk, v)), 0, 0);
      CHECK_MESSAGE(bool(r), r);
    }
}

// `.cuda_graphs` records a program on a private stream of its own: the looping forward's tile
// counter for that stream is first asked for inside the capture (the default on Hopper, =6, NOTES
// item 189). The program must still be captured (not fall back to plain launches) and each replay
// zero the counter again: three replays, each bit for bit the plain launch's output.
TEST_CASE("attention: the default forward replayed from a CUDA graph (cuda)" * needs_gpu()) {
  k::Tensor q = k::randn({2, 16, 1000, 64}, k::bf16, k::cpu, 611);
  k::Tensor kk = k::randn({2, 4, 900, 64}, k::bf16, k::cpu, 612);
  k::Tensor v = k::randn({2, 4, 900, 64}, k::bf16, k::cpu, 613);
  auto gq = q.to(k::cuda), gk = kk.to(k::cuda), gv = v.to(k::cuda);
  auto f = [](auto q, auto k, auto v) { return k::attention(q, k, v); };
  auto plain = k::compile(f);
  const k::Tensor expected = k::Tensor(plain(gq, gk, gv)).to(k::cpu);
  auto r = k::testing::allclose(expected, k::reference::eval(f(q, kk, v)), 2e-2, 2e-2);
  CHECK_MESSAGE(bool(r), r);
  if (k::driver::compute_capability(0) == 90) {
    std::string source;
    for (const auto& kernel : k::explain(plain, gq, gk, gv).kernels)
      if (kernel.source.find("kiln_attention_fwd_") != std::string::npos) source = kernel.source;
    CHECK(source.find("_pp_dyn") != std::string::npos);
  }
  auto replayed = k::compile(f, {.cuda_graphs = true});
  for (int call = 0; call < 3; ++call) {
    INFO("replay " << call);
    auto same = k::testing::allclose(k::Tensor(replayed(gq, gk, gv)).to(k::cpu), expected, 0, 0);
    CHECK_MESSAGE(bool(same), same);
  }
  auto entries = replayed.cache().entries();
  REQUIRE(entries.size() == 1);
  REQUIRE(entries[0]->graphs);
  CHECK_FALSE(entries[0]->graphs->disabled());
  CHECK(entries[0]->graphs->replays() == 3);
}

// options.autotune on Hopper: the first call times the producer forwards (warpgroups, looping or a
// counter, cp.async or TMA) on its operands and keeps the fastest; its output is the oracle's, a
// second call times nothing, and a graph-captured program runs the choice too.
TEST_CASE("attention: the autotuned forward (cuda)" * needs_gpu()) {
  if (k::driver::compute_capability(0) != 90) return;  // (elsewhere nothing is tuned: the rules' kernel)
  k::Tensor q = k::randn({2, 8, 777, 64}, k::bf16, k::cpu, 621);
  k::Tensor kk = k::randn({2, 4, 1003, 64}, k::bf16, k::cpu, 622);
  k::Tensor v = k::randn({2, 4, 1003, 64}, k::bf16, k::cpu, 623);
  auto gq = q.to(k::cuda), gk = kk.to(k::cuda), gv = v.to(k::cuda);
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    auto f = [causal](auto q, auto k, auto v) { return k::attention(q, k, v, {.causal = causal}); };
    std::string log;
    auto old = k::debug::set_log_sink([](k::debug::Channel c, std::string_view s) {
      if (c == k::debug::Channel::autotune) autotune_text() += s;
    });
    k::debug::set_log_channels("autotune");
    autotune_text().clear();
    auto tuned = k::compile(f, {.autotune = true});
    const k::Tensor got = k::Tensor(tuned(gq, gk, gv)).to(k::cpu);
    log = autotune_text();
    autotune_text().clear();
    const k::Tensor again = k::Tensor(tuned(gq, gk, gv)).to(k::cpu);
    const std::string second = autotune_text();
    k::debug::set_log_sink(old);
    k::debug::set_log_channels("");
    auto r = k::testing::allclose(got, k::reference::eval(f(q, kk, v)), 2e-2, 2e-2);
    CHECK_MESSAGE(bool(r), r);
    auto same = k::testing::allclose(again, got, 0, 0);
    CHECK_MESSAGE(bool(same), same);
    CHECK(log.find("forwards timed, fastest kiln_attention_fwd_wgmma_d64_") != std::string::npos);
    CHECK(log.find("_tma") != std::string::npos);  // (a TMA candidate was timed)
    CHECK(second.find("forwards timed") == std::string::npos);
    MESSAGE(log);
  }
}

// A caller's own capture of the default forward, after one call on its stream (the looping
// forward's tile counter for that stream is made then; each launch leaves it zero for the next):
// replays give the plain call's output bit for bit.
TEST_CASE("attention: the default forward inside a capture the caller started (cuda)" * needs_gpu()) {
  const auto& api = k::driver::api();
  k::driver::make_current(0);
  CUstream s = nullptr;
  k::driver::check(api.stream_create(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  auto gq = k::randn({2, 12, 1000, 64}, k::bf16, k::cuda, 631), gk = k::randn({2, 12, 1000, 64}, k::bf16, k::cuda, 632),
       gv = k::randn({2, 12, 1000, 64}, k::bf16, k::cuda, 633);
  auto f = k::compile([](auto q, auto k, auto v) { return k::attention(q, k, v, {.causal = true}); });
  k::Tensor out = k::empty({2, 12, 1000, 64}, k::bf16, k::cuda);
  k::synchronize();
  {  // warm: the forward compiled, its counter and buffers made on this stream
    k::Tensor y = f(k::Stream(s), gq, gk, gv);
    k::eval(out, y * 1.0f, s);
    k::eval(out, gq * 0.0f, s);
    k::eval(out, y * 1.0f, s);
    k::Stream(s).synchronize();
  }
  const k::Tensor expected = out.to(k::cpu);
  {  // the warm call against the oracle; the replays against it bit for bit below
    auto q = gq.to(k::cpu), kk = gk.to(k::cpu), v = gv.to(k::cpu);
    auto r = k::testing::allclose(expected, k::reference::eval(k::attention(q, kk, v, {.causal = true})), 2e-2, 2e-2);
    CHECK_MESSAGE(bool(r), r);
  }
  k::driver::check(api.stream_begin_capture(s, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
  {
    k::Tensor y = f(k::Stream(s), gq, gk, gv);  // captured, not run
    k::eval(out, y * 1.0f, s);
  }
  CUgraph graph = nullptr;
  k::driver::check(api.stream_end_capture(s, &graph), "cuStreamEndCapture");
  CUgraphExec exec = nullptr;
  k::driver::check(api.graph_instantiate(&exec, graph, 0), "cuGraphInstantiate");
  for (int i = 0; i < 3; ++i) {
    INFO("replay " << i);
    k::eval(out, gq * 0.0f, s);
    k::driver::check(api.graph_launch(exec, s), "cuGraphLaunch");
    k::Stream(s).synchronize();
    auto same = k::testing::allclose(out.to(k::cpu), expected, 0, 0);
    CHECK_MESSAGE(bool(same), same);
  }
  api.graph_exec_destroy(exec);
  api.graph_destroy(graph);
  k::Stream(s).synchronize();
  api.stream_destroy(s);
}

// options.autotune on Hopper, the backward: the first call times each backward kernel with cp.async
// and with TMA copies (logged) and keeps the faster; the gradients agree with the untuned program's.
TEST_CASE("attention: the autotuned backward (cuda)" * needs_gpu()) {
  if (k::driver::compute_capability(0) != 90) return;
  auto gq = k::randn({2, 4, 333, 64}, k::bf16, k::cuda, 651), gk = k::randn({2, 4, 333, 64}, k::bf16, k::cuda, 652),
       gv = k::randn({2, 4, 333, 64}, k::bf16, k::cuda, 653), gw = k::randn({2, 4, 333, 64}, k::f32, k::cuda, 654);
  auto loss = [](auto q, auto k, auto v, auto w) {
    return k::sum(k::cast(k::attention(q, k, v, {.causal = true}), k::f32) * w);
  };
  auto plain = k::compile(k::value_and_grad(loss, k::wrt<0, 1, 2>));
  auto want = plain(gq, gk, gv, gw);
  auto old = k::debug::set_log_sink([](k::debug::Channel c, std::string_view s) {
    if (c == k::debug::Channel::autotune) autotune_text() += s;
  });
  k::debug::set_log_channels("autotune");
  autotune_text().clear();
  auto tuned = k::compile(k::value_and_grad(loss, k::wrt<0, 1, 2>), {.autotune = true});
  auto got = tuned(gq, gk, gv, gw);
  const std::string log = autotune_text();
  k::debug::set_log_sink(old);
  k::debug::set_log_channels("");
  CHECK(log.find("attention backward kiln_attention_bwd_") != std::string::npos);
  CHECK(log.find("TMA") != std::string::npos);
  const k::Tensor w[3] = {std::get<1>(want), std::get<2>(want), std::get<3>(want)};
  const k::Tensor t[3] = {std::get<1>(got), std::get<2>(got), std::get<3>(got)};
  for (int i = 0; i < 3; ++i) {  // (dq's sums are atomic additions: equal up to their order)
    auto r = k::testing::allclose(t[i].to(k::cpu), w[i].to(k::cpu), 1e-2, 1e-2);
    CHECK_MESSAGE(bool(r), "gradient " << i << ": " << r);
  }
  MESSAGE(log);
}

// KILN_TUNE_ATTENTION_WAVE=1 on Hopper (read once a process): a problem whose 128-row query tiles fit
// one wave of blocks runs the two-warpgroup kernel, a tile a block; a larger one keeps the rules'
// looping three-warpgroup kernel. Both against the oracle.
TEST_CASE("attention: one wave of query tiles (cuda)" * needs_gpu()) {
  if (k::driver::compute_capability(0) != 90) return;
  const bool one_wave = k::Tuning::from_environment().attention_wave == 1;
  const int sms = k::driver::sm_count(0);
  struct Case {
    int B, H, T;
    bool fits;
  };
  for (Case c : {Case{1, 2, 777, true}, Case{2, 4, 128 * sms / 8 + 1, false}}) {
    INFO("B " << c.B << " H " << c.H << " T " << c.T);
    CHECK(((c.T + 127) / 128 * c.B * c.H <= sms) == c.fits);
    k::Tensor q = k::randn({c.B, c.H, c.T, 64}, k::bf16, k::cpu, 641);
    k::Tensor kk = k::randn({c.B, c.H, c.T, 64}, k::bf16, k::cpu, 642);
    k::Tensor v = k::randn({c.B, c.H, c.T, 64}, k::bf16, k::cpu, 643);
    auto gq = q.to(k::cuda), gk = kk.to(k::cuda), gv = v.to(k::cuda);
    for (bool causal : {false, true}) {
      INFO("causal " << causal);
      auto f = [causal](auto q, auto k, auto v) { return k::attention(q, k, v, {.causal = causal}); };
      auto compiled = k::compile(f);
      auto r =
          k::testing::allclose(k::Tensor(compiled(gq, gk, gv)).to(k::cpu), k::reference::eval(f(q, kk, v)), 2e-2, 2e-2);
      CHECK_MESSAGE(bool(r), r);
      // The function that ran, against the kernel the rule names.
      const CUfunction ran = k::runtime::attention_detail::last_forward();
      const bool two = one_wave && c.fits;
      k::codegen::AttentionKernel expected = k::runtime::attention_kernel_for(64, 4, 0, two ? 3 : 6, causal, k::bf16);
      CHECK(expected.warpgroups == (two ? 2 : 3));
      CHECK(expected.dynamic == !two);
      CHECK(ran == k::runtime::attention_detail::function(expected, 0));
    }
  }
}

// KILN_TUNE_ATTENTION_DQ=1 on Hopper: where q, k and v have one shape, one kernel computes dk, dv
// and dq (dq's sums added with atomic reductions: attention_backward_kernel_sm90.hpp's dqkv), with
// and without an inlined score_mod; its gradients against the oracle and against the two kernels'.
// Elsewhere (grouped heads, Tq != Tk) dq keeps its own kernel.
TEST_CASE("attention: dq, dk and dv from one Hopper kernel against the oracle (cuda)" * needs_gpu()) {
  struct Case {
    int B, H, Hkv, Tq, Tk, D;
    bool causal;
    k::dtype dt;
  };
  const Case cases[] = {{1, 3, 3, 300, 300, 64, true, k::bf16},     {2, 2, 2, 391, 391, 128, true, k::f16},
                        {1, 2, 2, 129, 129, 64, false, k::bf16},    {1, 4, 4, 1024, 1024, 64, true, k::bf16},
                        {1, 2, 2, 1000, 1000, 128, false, k::bf16}, {1, 4, 2, 200, 200, 64, true, k::bf16},
                        {1, 2, 2, 100, 170, 64, false, k::bf16}};
  const bool hopper = k::driver::compute_capability(0) == 90;
  int seed = 500;
  for (const Case& c : cases) {
    auto plain = [&](auto q, auto k, auto v, auto w) {
      return k::sum(k::cast(k::attention(q, k, v, {.causal = c.causal}), k::f32) * w);
    };
    auto capped = [&](auto q, auto k, auto v, auto w) {
      auto mod = [](auto s, auto, auto, auto, auto) { return k::tanh(s / 7.0f) * 7.0f; };
      return k::sum(k::cast(k::attention(q, k, v, mod, {.causal = c.causal}), k::f32) * w);
    };
    auto check = [&](auto loss, bool mod) {
      INFO("B " << c.B << " H " << c.H << " Hkv " << c.Hkv << " Tq " << c.Tq << " Tk " << c.Tk << " D " << c.D
                << " causal " << c.causal << " " << k::name(c.dt) << std::string(mod ? " soft-capped" : ""));
      k::Tensor q = k::randn({c.B, c.H, c.Tq, c.D}, c.dt, k::cpu, ++seed);
      k::Tensor kk = k::randn({c.B, c.Hkv, c.Tk, c.D}, c.dt, k::cpu, ++seed);
      k::Tensor v = k::randn({c.B, c.Hkv, c.Tk, c.D}, c.dt, k::cpu, ++seed);
      k::Tensor w = k::randn({c.B, c.H, c.Tq, c.D}, k::f32, k::cpu, ++seed);
      auto gq = q.to(k::cuda), gk = kk.to(k::cuda), gv = v.to(k::cuda), gw = w.to(k::cuda);
      auto f64 = [](const k::Tensor& t) { return k::Tensor(k::cast(t.to(k::cpu), k::f64)); };
      std::array<k::Tensor, 3> before, after;
      for (const char* dq : {"0", "1"}) {
        ScopedEnv knob("KILN_TUNE_ATTENTION_DQ", dq);
        auto vg = k::value_and_grad(loss, k::wrt<0, 1, 2>);
        auto got = vg(gq, gk, gv, gw);
        (dq[0] == '1' ? after : before) =
            std::array<k::Tensor, 3>{std::get<1>(got), std::get<2>(got), std::get<3>(got)};
        bool one = false, own_dq = false;
        for (const auto& kernel : k::explain(vg, gq, gk, gv, gw).kernels) {
          one = one || kernel.source.find("kiln_attention_bwd_dqkv_wgmma_") != std::string::npos;
          own_dq = own_dq || kernel.source.find("kiln_attention_bwd_dq_wgmma_") != std::string::npos;
        }
        const bool same_shapes = c.H == c.Hkv && c.Tq == c.Tk;
        CHECK(one == (hopper && dq[0] == '1' && same_shapes));
        CHECK(own_dq == (hopper && !one));
      }
      // The oracle: the loss's gradients in f64 on the CPU.
      auto want = k::value_and_grad(loss, k::wrt<0, 1, 2>)(f64(q), f64(kk), f64(v), f64(w));
      const k::Tensor wanted[3] = {std::get<1>(want), std::get<2>(want), std::get<3>(want)};
      for (int which = 0; which < 3; ++which) {
        auto r = k::testing::allclose(f64(after[which]), wanted[which], 3e-2, 3e-2);
        CHECK_MESSAGE(bool(r), "gradient " << which << ": " << r);
        auto rb = k::testing::allclose(f64(after[which]), f64(before[which]), 2e-2, 2e-2);  // one kernel against two
        CHECK_MESSAGE(bool(rb), "gradient " << which << " against dq's own kernel: " << rb);
      }
    };
    check(plain, false);
    check(capped, true);
  }
}

// Sizes at the edges, every kernel set (KILN_TUNE_ATTENTION_WGMMA 1-6 and 0) against the oracle: no
// keys (Tk = 0: every row empty, the output zeros) and no queries, causal grouped heads with
// Tq > Tk, and a batch past 2^31 elements with more than 65535 (batch, head) pairs (the grid's z;
// 64-bit offsets), checked on batches before and after element 2^31. The big inputs are drawn on
// the GPU (k::rand_like); the oracle sees single batches.
TEST_CASE("attention: no keys, no queries, and more than 2^31 elements on every kernel set (cuda)" * needs_gpu()) {
  struct Case {
    int B, H, Hkv, Tq, Tk;
    bool causal;
  };
  const Case small[] = {{1, 2, 2, 70, 0, false}, {1, 2, 1, 0, 70, true}, {2, 4, 2, 200, 70, true}};
  int seed = 300;
  // The big batch needs more memory than an 80 GB H100 has (it ran out there with 66 GB in use and
  // 17 GB more asked for; a 139 GB H200 runs it): a device with less than 96 GiB skips it, visibly.
  const bool big_fits = k::driver::memory_info(0).second >= (std::size_t{96} << 30);
  for (const char* wgmma : {"1", "2", "3", "4", "5", "6", "0"}) {
    // (a subcase each: --subcase='*=3' runs one kernel set)
    SUBCASE((std::string("KILN_TUNE_ATTENTION_WGMMA=") + wgmma).c_str()) {
      ScopedEnv knob("KILN_TUNE_ATTENTION_WGMMA", wgmma);
      for (const Case& c : small) {
        INFO("KILN_TUNE_ATTENTION_WGMMA=" << std::string(wgmma) << " B " << c.B << " H " << c.H << " Hkv " << c.Hkv
                                          << " Tq " << c.Tq << " Tk " << c.Tk << " causal " << c.causal);
        k::Tensor q = k::randn({c.B, c.H, c.Tq, 64}, k::bf16, k::cpu, ++seed);
        k::Tensor kk = k::randn({c.B, c.Hkv, c.Tk, 64}, k::bf16, k::cpu, ++seed);
        k::Tensor v = k::randn({c.B, c.Hkv, c.Tk, 64}, k::bf16, k::cpu, ++seed);
        auto f = [&](auto q, auto k, auto v) { return k::attention(q, k, v, {.causal = c.causal}); };
        auto r = k::testing::allclose(k::Tensor(k::compile(f)(q.to(k::cuda), kk.to(k::cuda), v.to(k::cuda))),
                                      k::reference::eval(f(q, kk, v)), 2e-2, 2e-2);
        CHECK_MESSAGE(bool(r), r);
      }
      if (!big_fits) {
        MESSAGE("the batch past 2^31 elements skipped: the device has less than 96 GiB of memory");
        continue;
      }
      // q [2100, 128, 128, 64]: 2^31 + 2^25 elements, batch 2048 on past element 2^31; k, v of 32
      // heads and 130 keys.
      const std::int64_t B = 2100, H = 128, Hkv = 32, Tq = 128, Tk = 130, D = 64;
      INFO("KILN_TUNE_ATTENTION_WGMMA=" << std::string(wgmma) << " q [" << B << ", " << H << ", " << Tq << ", " << D
                                        << "]");
      auto draw = k::compile([](auto x) { return (k::rand_like(x, 5) - 0.5) * 3.0; });
      k::Tensor q = draw(k::Tensor::empty({B, H, Tq, D}, k::bf16, k::cuda));
      k::Tensor kk = draw(k::Tensor::empty({B, Hkv, Tk, D}, k::bf16, k::cuda));
      k::Tensor v = draw(k::Tensor::empty({B, Hkv, Tk, D}, k::bf16, k::cuda));
      k::Tensor w = draw(k::Tensor::empty({B, H, Tq, D}, k::bf16, k::cuda));
      auto f = [](auto q, auto k, auto v) { return k::attention(q, k, v, {.causal = true}); };
      auto loss = [&](auto q, auto k, auto v, auto w) { return k::sum(k::cast(f(q, k, v) * w, k::f32)); };
      k::Tensor o = k::compile(f)(q, kk, v);
      auto got = k::value_and_grad(loss, k::wrt<0, 1, 2>)(q, kk, v, w);
      const k::Tensor grads[3] = {std::get<1>(got), std::get<2>(got), std::get<3>(got)};
      for (std::int64_t b : {std::int64_t{0}, std::int64_t{2047}, std::int64_t{2048}, B - 1}) {
        INFO("batch " << b);
        auto one = [&](const k::Tensor& t) { return k::Tensor(k::slice(t, 0, b, b + 1)).to(k::cpu); };
        k::Tensor qb = one(q), kb = one(kk), vb = one(v), wb = one(w);
        auto r = k::testing::allclose(one(o), k::reference::eval(f(qb, kb, vb)), 2e-2, 2e-2);
        CHECK_MESSAGE(bool(r), r);
        k::Attrs at;
        at.a = true;
        auto stats = k::expr::make<k::Op::attention_lse>(at, qb, kb, 0.0);
        for (int which = 0; which < 3; ++which) {  // dq, dk, dv
          at.c = which;
          auto want = k::reference::eval(k::expr::make<k::Op::attention_grad>(at, qb, kb, vb, wb, stats, 0.0));
          auto rg = k::testing::allclose(one(grads[which]).to(k::f64), want, 3e-2, 3e-2);
          CHECK_MESSAGE(bool(rg), "gradient " << which << ": " << rg);
        }
      }
    }
  }
}

// The Hopper kernels' sources, on any machine: head dims 64 and 128 get warpgroup MMA (two
// warpgroups, 128-key tiles, the shared memory an H100/H200 block may have), other head dims keep
// the mma.sync kernel, and a kernel the Hopper writers do not take is an error, not bad source.
TEST_CASE("attention: the Hopper kernels' sources") {
  namespace cg = k::codegen;
  for (int D : {64, 128}) {
    INFO("D " << D);
    cg::AttentionKernel a = cg::AttentionKernel::hopper(cg::AttentionKernel::for_head_dim(D));
    CHECK(a.warpgroups == 2);
    CHECK(a.threads() == 256);
    CHECK(a.query_rows() == 128);
    CHECK(a.shared_bytes() <= 227 * 1024);
    const std::string fwd = cg::attention_forward_kernel_source(a);
    CHECK(fwd.find("kiln_attention_fwd_wgmma_d" + std::to_string(D) + "_wg2_k128_bf16") != std::string::npos);
    CHECK(fwd.find("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") != std::string::npos);
    CHECK(fwd.find("wgmma.mma_async.sync.aligned.m64n" + std::to_string(D) + "k16.f32.bf16.bf16") != std::string::npos);
    // The softmax scales inside the exponent's FFMA where the scale is positive (the default); a
    // kernel for another scale is named apart and scales every score first.
    CHECK(fwd.find("#define KILN_SOFTMAX_FMA 1") != std::string::npos);
    cg::AttentionKernel scaled = a;
    scaled.raw_max = false;
    const std::string scaled_fwd = cg::attention_forward_kernel_source(scaled);
    CHECK(scaled_fwd.find("#define KILN_SOFTMAX_FMA") == std::string::npos);
    CHECK(scaled.name() == "kiln_attention_fwd_wgmma_d" + std::to_string(D) + "_wg2_k128_scaled_bf16");
    // Fed by a producer: three consumer warpgroups at D 64 without a score_mod (192 query rows,
    // 512 threads), two at D 128 and with a mod.
    cg::AttentionKernel pp = cg::AttentionKernel::hopper(cg::AttentionKernel::for_head_dim(D), 3, true);
    CHECK(pp.warpgroups == (D == 64 ? 3 : 2));
    CHECK(pp.threads() == 128 * (pp.warpgroups + 1));
    CHECK(pp.shared_bytes() <= 227 * 1024);
    CHECK(cg::attention_forward_kernel_source(pp).find(D == 64 ? "setmaxnreg.inc.sync.aligned.u32 %0" : "_wg2_") !=
          std::string::npos);
    const std::string pp_fwd = cg::attention_forward_kernel_source(pp);
    // Warpgroups whose rows all lie past Tq keep only their turns and releases, unless
    // KILN_TUNE_ATTENTION_IDLE_WARPGROUPS=0 (NOTES item 182; read once a process, where the source is
    // written: its GPU check is a whole-process run of this file).
    CHECK((pp_fwd.find("#define KILN_IDLE_WARPGROUPS 1") != std::string::npos) ==
          (k::Tuning::from_environment().attention_idle_warpgroups != 0));
    {
      ScopedEnv knob("KILN_TUNE_ATTENTION_IDLE_WARPGROUPS", "2");  // clamped to its range
      CHECK(k::Tuning::from_environment().attention_idle_warpgroups == 1);
    }
    CHECK(pp_fwd.find("w0 >= Tq ? 0 :") != std::string::npos);
    // Looping (=5): q in two buffers and mbarriers for each, where that leaves three key stages.
    cg::AttentionKernel loop = cg::AttentionKernel::hopper(cg::AttentionKernel::for_head_dim(D), 3, true, true);
    CHECK(loop.persistent == (D == 64));
    CHECK(loop.q_buffers() == (D == 64 ? 2 : 1));
    CHECK(loop.shared_bytes() == (D == 64 ? (2 * 192 + 6 * 128) * 64 * 2 + 1024 + 128 : pp.shared_bytes()));
    CHECK((cg::attention_forward_kernel_source(loop).find("#define KILN_PERSISTENT 1") != std::string::npos) ==
          (D == 64));
    // The warpgroup index from lane 0 (NOTES item 184; read once a process): in the forwards unless
    // KILN_TUNE_ATTENTION_UNIFORM=0, in the backwards only under =1.
    const int uniform = k::Tuning::from_environment().attention_uniform;
    CHECK((pp_fwd.find("#define KILN_UNIFORM_WARPGROUP 1") != std::string::npos) == (uniform != 0));
    CHECK(pp_fwd.find("const int wg = KILN_WARPGROUP_INDEX") != std::string::npos);
    // The lean copies (NOTES item 190; read once a process): by default (not under
    // KILN_TUNE_ATTENTION_COPIES=0), where the looping three-warpgroup producer does not unroll them.
    const bool lean = k::Tuning::from_environment().attention_copies != 0;
    const std::string loop_fwd = cg::attention_forward_kernel_source(loop);
    CHECK((pp_fwd.find("#define KILN_LEAN_COPIES 1") != std::string::npos) == lean);
    CHECK((loop_fwd.find("#define KILN_PRODUCE_UNROLL 1\n") != std::string::npos) == (lean && D == 64));
    // The producer's copies by TMA (NOTES item 191; read once a process): by default (not under
    // KILN_TUNE_ATTENTION_TMA=0), named apart, and in the producer kernels only.
    const bool tma = k::Tuning::from_environment().attention_tma != 0;
    CHECK(pp.tma == tma);
    CHECK(!a.tma);
    CHECK((pp.name().find("_tma") != std::string::npos) == tma);
    CHECK((pp_fwd.find("#define KILN_TMA 1") != std::string::npos) == tma);
    CHECK(pp_fwd.find("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes") !=
          std::string::npos);
    // The default forward (tiles from a counter at D 64) with each kind of copies compiles for sm_90a
    // (NVRTC, no GPU needed): the launcher takes the cp.async kernel where a tensor map cannot be made.
    for (bool by_tma : {true, false}) {
      INFO("tma " << by_tma);
      cg::AttentionKernel dyn = cg::AttentionKernel::hopper(cg::AttentionKernel::for_head_dim(D), 3, true, true, true);
      dyn.causal = true;
      dyn.tma = by_tma;
      CHECK(dyn.dynamic == (D == 64));
      CHECK(!k::runtime::compile_cubin(cg::attention_forward_kernel_source(dyn), dyn.name(), "sm_90a").empty());
    }
    cg::AttentionKernel with_mod = cg::AttentionKernel::for_head_dim(D);
    with_mod.score_mod = "float kiln_score_mod(float s) { return s; }";
    with_mod.score_mod_tag = "t";
    CHECK(cg::AttentionKernel::hopper(with_mod, 3, true).warpgroups == 2);
    for (auto part : {cg::AttentionBackwardKernel::Part::dq, cg::AttentionBackwardKernel::Part::dkv}) {
      cg::AttentionBackwardKernel b;
      b.part = part;
      b.head_dim = D;
      b.dt = k::f16;
      b.hopper = true;
      CHECK(b.block_rows() == 128);
      CHECK(b.shared_bytes() <= 227 * 1024);
      const std::string bwd = cg::attention_backward_kernel_source(b);
      CHECK(bwd.find(b.name()) != std::string::npos);
      CHECK(bwd.find("_wgmma_d" + std::to_string(D) + "_f16") != std::string::npos);
      CHECK((bwd.find("#define KILN_UNIFORM_WARPGROUP 1") != std::string::npos) == (uniform == 1));
      CHECK(bwd.find("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16") != std::string::npos);
    }
    // The backwards by TMA (NOTES item 193; KILN_TUNE_ATTENTION_BACKWARD_TMA=1, read once a process):
    // named apart, 64 bytes more of shared memory for their mbarriers, and each part compiles for
    // sm_90a (NVRTC, no GPU needed).
    using Part = cg::AttentionBackwardKernel::Part;
    for (auto part : {Part::dq, Part::dkv, Part::dqkv}) {
      const bool knob = k::Tuning::from_environment().attention_bwd_tma == 1;
      cg::AttentionBackwardKernel b = k::runtime::attention_backward_kernel_for(part, D, true, true, k::bf16);
      CHECK(b.tma == knob);
      b.tma = true;
      CHECK(b.name().find("_tma") != std::string::npos);
      CHECK(b.shared_bytes() <= 227 * 1024);
      const std::string bwd = cg::attention_backward_kernel_source(b);
      CHECK(bwd.find("#define KILN_BWD_TMA 1") != std::string::npos);
      CHECK(!k::runtime::compile_cubin(bwd, b.name(), "sm_90a").empty());
    }
    cg::AttentionBackwardKernel one;  // dq, dk and dv: dq's sums by atomic reductions, Hopper only
    one.part = cg::AttentionBackwardKernel::Part::dqkv;
    one.head_dim = D;
    one.hopper = true;
    CHECK(one.shared_bytes() <= 227 * 1024);
    CHECK(cg::attention_backward_kernel_source(one).find("red.global.add.v2.f32") != std::string::npos);
    one.hopper = false;
    CHECK_THROWS_AS(cg::attention_backward_kernel_source(one), k::error);
  }
  cg::AttentionKernel other = cg::AttentionKernel::hopper(cg::AttentionKernel::for_head_dim(96));
  CHECK(other.warpgroups == 0);
  CHECK(cg::attention_forward_kernel_source(other).find("wgmma") == std::string::npos);
  other.warpgroups = 2;
  CHECK_THROWS_AS(cg::attention_forward_source_sm90(other), k::error);
  cg::AttentionBackwardKernel stats;
  stats.part = cg::AttentionBackwardKernel::Part::stats;
  stats.hopper = true;
  CHECK_THROWS_AS(cg::attention_backward_kernel_source(stats), k::error);
}

// Keys scaled up along the sequence: each row's max passes the fused kernel's base (the running max
// it exponentiates against) by more than 2^8 at several key tiles, so o is rescaled there; scaled
// down, the first tile sets it for good. Both against the oracle, causal and not, on Hopper's
// kernels with and without the producer warpgroup (whose o is rescaled a step later).
TEST_CASE("attention: the fused forward where each row's max keeps growing along the keys (cuda)" * needs_gpu()) {
  const int T = 333, D = 64;
  std::vector<float> up(T), down(T);
  for (int j = 0; j < T; ++j) up[j] = 0.2f + 0.05f * static_cast<float>(j);
  for (int j = 0; j < T; ++j) down[j] = up[T - 1 - j];
  int seed = 70;
  for (const char* wgmma : {"1", "3", "4", "5", "6"})
    for (bool causal : {false, true})
      for (const std::vector<float>* ramp : {&up, &down}) {
        ScopedEnv knob("KILN_TUNE_ATTENTION_WGMMA", wgmma);
        INFO("KILN_TUNE_ATTENTION_WGMMA=" << std::string(wgmma) << " causal " << causal
                                          << std::string(ramp == &up ? " growing" : " shrinking"));
        k::Tensor q = k::randn({1, 2, T, D}, k::bf16, k::cpu, ++seed);
        k::Tensor kk =
            k::cast(k::randn({1, 2, T, D}, k::f32, k::cpu, ++seed) * k::from_vector(*ramp, {1, 1, T, 1}), k::bf16);
        k::Tensor v = k::randn({1, 2, T, D}, k::bf16, k::cpu, ++seed);
        auto f = [&](auto q, auto k, auto v) { return k::attention(q, k, v, {.causal = causal, .scale = 1.0}); };
        auto r = k::testing::allclose(k::Tensor(f(q.to(k::cuda), kk.to(k::cuda), v.to(k::cuda))),
                                      k::reference::eval(f(q, kk, v)), 2e-2, 2e-2);
        CHECK_MESSAGE(bool(r), r);
      }
}

TEST_CASE("attention: gradients of q, k and v pass gradcheck (causal, grouped-query heads)") {
  k::Tensor q = k::randn({1, 4, 5, 3}, k::f64, k::cpu, 7), kk = k::randn({1, 2, 6, 3}, k::f64, k::cpu, 8);
  k::Tensor v = k::randn({1, 2, 6, 2}, k::f64, k::cpu, 9);
  CHECK(
      k::testing::gradcheck([](auto q, auto k, auto v) { return k::attention(q, k, v, {.causal = true}); }, q, kk, v));
  CHECK(k::testing::gradcheck([](auto q, auto k, auto v) { return k::attention(q, k, v, {.scale = 0.7}); }, q, kk, v));
}

// The oracle of the one-kernel backward's node (attention_grad, attrs.c = 4): dk, dv and dq stacked
// as [5, B, H, T, D] (the last two slots the kernel's f32 sums of dq), each of the first three the
// oracle's own gradient; q, k and v of other shapes are an error naming them.
TEST_CASE("attention: dq, dk and dv stacked by one node, against each gradient's own (cpu)") {
  k::Tensor q = k::randn({2, 3, 37, 16}, k::bf16, k::cpu, 41), kk = k::randn({2, 3, 37, 16}, k::bf16, k::cpu, 42);
  k::Tensor v = k::randn({2, 3, 37, 16}, k::bf16, k::cpu, 43), g = k::randn({2, 3, 37, 16}, k::bf16, k::cpu, 44);
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    k::Attrs at;
    at.a = causal;
    auto stats = k::expr::make<k::Op::attention_lse>(at, q, kk, 0.0);
    at.c = 4;
    k::Tensor all = k::reference::eval(k::expr::make<k::Op::attention_grad>(at, q, kk, v, g, stats, 0.0));
    CHECK(all.shape() == k::Dims{5, 2, 3, 37, 16});
    const int third_of[3] = {2, 0, 1};  // dq, dk, dv
    for (int which = 0; which < 3; ++which) {
      at.c = which;
      k::Tensor want = k::reference::eval(k::expr::make<k::Op::attention_grad>(at, q, kk, v, g, stats, 0.0));
      k::Tensor got = k::reshape(k::slice(all, 0, third_of[which], third_of[which] + 1), want.shape());
      auto r = k::testing::allclose(got, want, 1e-12, 1e-12);
      CHECK_MESSAGE(bool(r), "gradient " << which << ": " << r);
    }
  }
  k::Attrs at;
  at.c = 4;
  k::Tensor k2 = k::randn({2, 1, 37, 16}, k::bf16, k::cpu, 45);
  auto stats = k::expr::make<k::Op::attention_lse>(at, q, k2, 0.0);
  CHECK_THROWS_WITH_AS(k::reference::eval(k::expr::make<k::Op::attention_grad>(at, q, k2, k2, g, stats, 0.0)),
                       doctest::Contains("one shape"), k::shape_error);
}

TEST_CASE("attention: mismatched shapes and dtypes are errors naming them") {
  k::Tensor q = k::randn({1, 4, 5, 3}), kk = k::randn({1, 3, 6, 3}), v = k::randn({1, 3, 6, 2});
  CHECK_THROWS_WITH_AS(k::Tensor(k::attention(q, kk, v)),
                       doctest::Contains("k and v need the same number of heads, dividing q's (q [1, 4, 5, 3]"),
                       k::shape_error);
  k::Tensor k2 = k::randn({1, 2, 6, 4}), v2 = k::randn({1, 2, 6, 2});
  CHECK_THROWS_WITH_AS(k::Tensor(k::attention(q, k2, v2)), doctest::Contains("same head dimension"), k::shape_error);
  CHECK_THROWS_WITH_AS(k::Tensor(k::attention(k::randn({4, 5, 3}), k2, v2)), doctest::Contains("[B, H, T, D]"),
                       k::shape_error);
  k::Tensor k3 = k::randn({1, 2, 6, 3}, k::f64, k::cpu, 1);
  CHECK_THROWS_WITH_AS(k::Tensor(k::attention(q, k3, k::randn({1, 2, 6, 2}))), doctest::Contains("one floating dtype"),
                       k::dtype_error);
}

namespace {

void check_score_mod(k::Device dev) {
  const float inf = std::numeric_limits<float>::infinity();
  k::Tensor q = k::randn({2, 4, 9, 8}, k::f32, dev, 11), kk = k::randn({2, 2, 12, 8}, k::f32, dev, 12);
  k::Tensor v = k::randn({2, 2, 12, 5}, k::f32, dev, 13);
  // ALiBi: a per-head slope times the distance; soft-capping; a relative bias read from a tensor.
  auto alibi = [](auto s, auto, auto h, auto i, auto j) {
    return s - k::exp2(k::cast(h + 1, k::f32) * -2.0f) * k::cast(i - j, k::f32);
  };
  auto softcap = [](auto s, auto, auto, auto, auto) { return k::tanh(s / 5.0f) * 5.0f; };
  k::Tensor bias = k::randn({4, 9, 12}, k::f32, dev, 14);
  auto relative = [&bias](auto s, auto, auto, auto, auto) { return s + bias; };
  // A mask that empties query row 3 (its output is zeros, not NaN) and keeps keys j >= 2 elsewhere.
  auto masked = [inf](auto s, auto, auto, auto i, auto j) { return k::where(i == 3, -inf, k::where(j < 2, -inf, s)); };
  for (bool causal : {false, true}) {
    INFO("causal " << causal << " on " << dev);
    for (auto e : {k::expression(k::attention(q, kk, v, alibi, {.causal = causal})),
                   k::expression(k::attention(q, kk, v, softcap, {.causal = causal, .scale = 0.5})),
                   k::expression(k::attention(q, kk, v, relative, {.causal = causal}))}) {
      auto r = k::testing::allclose(k::Tensor(e), k::reference::eval(e), 1e-5, 1e-5);
      CHECK_MESSAGE(r, r);
    }
    k::Tensor got = k::attention(q, kk, v, masked, {.causal = causal});
    auto r =
        k::testing::allclose(got, k::reference::eval(k::attention(q, kk, v, masked, {.causal = causal})), 1e-5, 1e-5);
    CHECK_MESSAGE(r, r);
    auto values = k::reference::read(got).data;
    for (std::int64_t bh = 0; bh < 8; ++bh)
      for (int d = 0; d < 5; ++d) CHECK(values[static_cast<std::size_t>((bh * 9 + 3) * 5 + d)] == 0.0);
  }
  // The identity score_mod is plain attention.
  auto same = k::testing::allclose(k::Tensor(k::attention(q, kk, v, [](auto s, auto...) { return s; })),
                                   k::Tensor(k::attention(q, kk, v)), 1e-6, 1e-6);
  CHECK_MESSAGE(same, same);
}

}  // namespace

TEST_CASE(
    "attention: score_mod (ALiBi, soft-capping, a captured bias, a mask emptying a row) against the oracle (cpu)") {
  check_score_mod(k::cpu);
}
TEST_CASE("attention: score_mod against the oracle (cuda)" * needs_gpu()) { check_score_mod(k::cuda); }

TEST_CASE("attention: gradients flow through a score_mod to q, k, v and the tensors it reads (gradcheck)") {
  k::Tensor q = k::randn({1, 2, 4, 3}, k::f64, k::cpu, 21), kk = k::randn({1, 2, 5, 3}, k::f64, k::cpu, 22);
  k::Tensor v = k::randn({1, 2, 5, 2}, k::f64, k::cpu, 23), bias = k::randn({2, 4, 5}, k::f64, k::cpu, 24);
  auto fn = [](auto q, auto k, auto v, auto bias) {
    return k::attention(
        q, k, v,
        [&bias](auto s, auto, auto, auto i, auto j) { return k::tanh(s + bias) - 0.1 * k::cast(i - j, k::f64); },
        {.causal = true});
  };
  CHECK(k::testing::gradcheck(fn, q, kk, v, bias));
}

// A pointwise score_mod is inlined into the fused kernels (autodiff/score_mod.hpp): forward,
// log-sum-exp, dq and dk/dv apply it to each scaled score and send dS back through its derivative,
// with no [Tq, Tk] buffer. Soft-capping, ALiBi and a sliding window in one mod, a mask that empties
// a row, causal and not, grouped heads, odd lengths, both 16-bit dtypes; against the oracle
// (values) and the f64 CPU program (gradients). The cap is a C++ scalar: a new value is a kernel
// argument, not a recompile. Tensors the mod reads are loaded at each score; the bias's gradient
// comes from materialised probabilities.
TEST_CASE("attention: score_mods inlined into the fused kernels, forward and gradients (cuda)" * needs_gpu()) {
  const float inf = std::numeric_limits<float>::infinity();
  const FusedCase cases[] = {{2, 4, 4, 100, 100, 64, false, k::bf16},
                             {1, 8, 2, 77, 130, 128, true, k::bf16},
                             {2, 3, 1, 65, 200, 80, true, k::f16},
                             {1, 2, 2, 33, 16, 32, false, k::f16}};
  float cap = 20.f;
  auto capped = [&](auto s, auto, auto h, auto i, auto j) {
    return k::where(i - j < 48,
                    k::tanh(s / cap) * cap - k::exp2(k::cast(h + 1, k::f32) * -1.0f) * k::cast(i - j, k::f32), -inf);
  };
  auto emptied = [inf](auto s, auto, auto, auto i, auto) { return k::where(i == 3, -inf, s * 1.5f); };
  int seed = 90;
  for (const FusedCase& c : cases) {
    INFO(c);
    const std::array<k::Tensor, 3> ops = c.operands(seed);
    const k::Tensor &q = ops[0], &kk = ops[1], &v = ops[2];
    k::Tensor w = k::randn({c.B, c.H, c.Tq, c.D}, k::f32, k::cpu, ++seed);
    auto gq = q.to(k::cuda), gk = kk.to(k::cuda), gv = v.to(k::cuda), gw = w.to(k::cuda);
    auto f = [&](auto q, auto k, auto v) { return k::attention(q, k, v, capped, {.causal = c.causal}); };
    auto fe = [&](auto q, auto k, auto v) { return k::attention(q, k, v, emptied, {.causal = c.causal}); };
    auto cf = k::compile(f);
    for (float value : {20.f, 7.f}) {
      cap = value;
      INFO("cap " << cap);
      auto r = k::testing::allclose(k::Tensor(cf(gq, gk, gv)), k::reference::eval(f(q, kk, v)), 2e-2, 2e-2);
      CHECK_MESSAGE(bool(r), r);
    }
    CHECK(cf.cache().compiles() == 1);
    // Replayed from a CUDA graph, a new value of the mod's scalar is a new graph, not a stale one.
    auto replayed = k::compile(f, {.cuda_graphs = true});
    for (float value : {20.f, 7.f, 20.f}) {
      cap = value;
      INFO("cap " << cap << " from a CUDA graph");
      auto r = k::testing::allclose(k::Tensor(replayed(gq, gk, gv)), k::reference::eval(f(q, kk, v)), 2e-2, 2e-2);
      CHECK_MESSAGE(bool(r), r);
    }
    cap = 20.f;
    k::Tensor empty_rows = fe(gq, gk, gv);
    auto re = k::testing::allclose(empty_rows, k::reference::eval(fe(q, kk, v)), 2e-2, 2e-2);
    CHECK_MESSAGE(bool(re), re);
    auto values = k::to_vector<double>(k::Tensor(k::cast(empty_rows.to(k::cpu), k::f64)));
    for (std::int64_t bh = 0; bh < c.B * c.H; ++bh)
      for (int d = 0; d < c.D; ++d) CHECK(values[static_cast<std::size_t>((bh * c.Tq + 3) * c.D + d)] == 0.0);
    // The kernels inline the mod: no scores buffer, the mod's functions in each source, and explain
    // says so (fused ops "attention_flash", "score_mod").
    bool fused = false;
    for (const auto& kernel : k::explain(cf, gq, gk, gv).kernels) {
      const auto& ops = kernel.fused_ops;
      fused = fused || (!ops.empty() && ops.front() == "attention_flash" &&
                        std::find(ops.begin(), ops.end(), "score_mod") != ops.end() &&
                        kernel.source.find("kiln_score_mod(") != std::string::npos);
    }
    CHECK(fused);
    // Gradients of sum(attention * w) against the same function's f64 program on the CPU.
    auto loss = [&](auto q, auto k, auto v, auto w) { return k::sum(k::cast(f(q, k, v), k::f32) * w); };
    auto vg = k::value_and_grad(loss, k::wrt<0, 1, 2>);
    auto got = vg(gq, gk, gv, gw);
    auto loss64 = [&](auto q, auto k, auto v, auto w) { return k::sum(f(q, k, v) * w); };
    auto want =
        k::value_and_grad(loss64, k::wrt<0, 1, 2>)(k::Tensor(k::cast(q, k::f64)), k::Tensor(k::cast(kk, k::f64)),
                                                   k::Tensor(k::cast(v, k::f64)), k::Tensor(k::cast(w, k::f64)));
    int mod_kernels = 0;
    for (const auto& kernel : k::explain(vg, gq, gk, gv, gw).kernels)
      mod_kernels += kernel.source.find("kiln_score_mod_vjp(") != std::string::npos &&
                     kernel.source.find("_mod") != std::string::npos;
    CHECK(mod_kernels >= 2);  // forward, dq, dk/dv (or dk and dv; on Hopper at D 64 one kernel for the three)
    const k::Tensor g[3] = {std::get<1>(got), std::get<2>(got), std::get<3>(got)};
    const k::Tensor g64[3] = {std::get<1>(want), std::get<2>(want), std::get<3>(want)};
    for (int which = 0; which < 3; ++which) {
      auto r = k::testing::allclose(k::Tensor(k::cast(g[which].to(k::cpu), k::f64)), g64[which], 3e-2, 3e-2);
      CHECK_MESSAGE(bool(r), "gradient " << which << ": " << r);
    }
    // Tensors the mod reads, loaded by the kernels at each score: a relative bias [H, Tq, Tk] with
    // its gradient (from materialised probabilities), and document ids [Tq, 1] and [Tk] (i64) masking
    // keys of other documents.
    k::Tensor bias = k::randn({c.H, c.Tq, c.Tk}, k::f32, k::cpu, ++seed), gbias = bias.to(k::cuda);
    std::vector<std::int64_t> qd, kd;
    for (int i = 0; i < c.Tq; ++i) qd.push_back(3 * i / c.Tq);
    for (int j = 0; j < c.Tk; ++j) kd.push_back(3 * j / c.Tk);
    k::Tensor qdoc = k::from_vector(qd, {c.Tq, 1}), kdoc = k::from_vector(kd, {c.Tk});
    k::Tensor gqdoc = qdoc.to(k::cuda), gkdoc = kdoc.to(k::cuda);
    auto read = [&](auto q, auto k, auto v, auto bias, auto qdoc, auto kdoc) {
      return k::attention(
          q, k, v, [&](auto s, auto...) { return k::where(qdoc == kdoc, s + bias, -inf); }, {.causal = c.causal});
    };
    auto rr = k::testing::allclose(k::Tensor(read(gq, gk, gv, gbias, gqdoc, gkdoc)),
                                   k::reference::eval(read(q, kk, v, bias, qdoc, kdoc)), 2e-2, 2e-2);
    CHECK_MESSAGE(bool(rr), "reading tensors: " << rr);
    auto read_loss = [&](auto q, auto k, auto v, auto bias, auto qdoc, auto kdoc, auto w) {
      return k::sum(k::cast(read(q, k, v, bias, qdoc, kdoc), k::f32) * w);
    };
    auto rg = k::value_and_grad(read_loss, k::wrt<0, 1, 2, 3>)(gq, gk, gv, gbias, gqdoc, gkdoc, gw);
    auto rw = k::value_and_grad(read_loss, k::wrt<0, 1, 2, 3>)(
        k::Tensor(k::cast(q, k::f64)), k::Tensor(k::cast(kk, k::f64)), k::Tensor(k::cast(v, k::f64)),
        k::Tensor(k::cast(bias, k::f64)), qdoc, kdoc, k::Tensor(k::cast(w, k::f64)));
    const k::Tensor rgot[4] = {std::get<1>(rg), std::get<2>(rg), std::get<3>(rg), std::get<4>(rg)};
    const k::Tensor rwant[4] = {std::get<1>(rw), std::get<2>(rw), std::get<3>(rw), std::get<4>(rw)};
    for (int which = 0; which < 4; ++which) {
      auto r = k::testing::allclose(k::Tensor(k::cast(rgot[which].to(k::cpu), k::f64)), rwant[which], 3e-2, 3e-2);
      CHECK_MESSAGE(bool(r), "reading tensors, gradient " << which << ": " << r);
    }
    bool inlined = false;  // the bias and the ids are inputs of the fused kernels, not a scores buffer
    for (const auto& kernel : k::explain(k::compile(read), gq, gk, gv, gbias, gqdoc, gkdoc).kernels)
      inlined = inlined || kernel.source.find("S.t[1]") != std::string::npos;
    CHECK(inlined);
  }
}

// A scale that is not positive (a user's choice the softmax must still honour): Hopper's forwards
// then take the kernel that scales every score before its max (named _scaled), on every producer
// kernel set, against the oracle, forward and gradients.
TEST_CASE("attention: a negative scale on the Hopper kernels (cuda)" * needs_gpu()) {
  int seed = 800;
  for (const char* wgmma : {"1", "3", "4", "5", "6"})
    for (bool causal : {false, true}) {
      ScopedEnv knob("KILN_TUNE_ATTENTION_WGMMA", wgmma);
      INFO("KILN_TUNE_ATTENTION_WGMMA=" << std::string(wgmma) << " causal " << causal);
      k::Tensor q = k::randn({1, 2, 200, 64}, k::bf16, k::cpu, ++seed);
      k::Tensor kk = k::randn({1, 2, 300, 64}, k::bf16, k::cpu, ++seed);
      k::Tensor v = k::randn({1, 2, 300, 64}, k::bf16, k::cpu, ++seed);
      k::Tensor w = k::randn({1, 2, 200, 64}, k::f32, k::cpu, ++seed);
      auto f = [&](auto q, auto k, auto v) { return k::attention(q, k, v, {.causal = causal, .scale = -0.2}); };
      auto r = k::testing::allclose(k::Tensor(k::compile(f)(q.to(k::cuda), kk.to(k::cuda), v.to(k::cuda))),
                                    k::reference::eval(f(q, kk, v)), 2e-2, 2e-2);
      CHECK_MESSAGE(bool(r), r);
      // explain names the kernel this scale's sign picks (the scale is a call's scalar: the report
      // adds the _scaled name to the warpgroup kernels' source).
      std::string source;
      for (const auto& kernel : k::explain(k::compile(f), q.to(k::cuda), kk.to(k::cuda), v.to(k::cuda)).kernels)
        if (kernel.source.find("kiln_attention_fwd_") != std::string::npos) source = kernel.source;
      CHECK(!source.empty());
      CHECK((source.find("_scaled") != std::string::npos) ==
            (source.find("kiln_attention_fwd_wgmma_") != std::string::npos));
      auto loss = [&](auto q, auto k, auto v, auto w) { return k::sum(k::cast(f(q, k, v), k::f32) * w); };
      auto [dq, dk, dv] = k::grad(loss, k::wrt<0, 1, 2>)(q.to(k::cuda), kk.to(k::cuda), v.to(k::cuda), w.to(k::cuda));
      auto f64 = [](const k::Tensor& x) { return k::Tensor(k::cast(x, k::f64)); };
      const auto want = oracle_outputs(k::grad(loss, k::wrt<0, 1, 2>), f64(q), f64(kk), f64(v), f64(w));  // unfused f64
      int i = 0;
      for (const k::Tensor& got : {dq, dk, dv}) {
        CAPTURE(i);
        auto r = k::testing::allclose(got.to(k::f64), k::reference::to_tensor(want[i++]), 5e-2, 5e-2);
        CHECK_MESSAGE(bool(r), r);
      }
    }
}
