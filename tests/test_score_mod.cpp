// A k::attention score_mod as the fused kernels inline it (autodiff/score_mod.hpp,
// codegen/score_mod_source.hpp): which mods are functions of one score, the C written for them and
// their derivative, compiled here by the host compiler and evaluated against values computed in the
// test; the kernels' sources with a mod pass NVRTC for sm_80 and sm_90a (no GPU needed).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>

namespace k = kiln;

namespace {

// attention(q, k, v, mod)'s captured graph with shapes, the attention node's id and the scalars.
struct Captured {
  k::graph::Graph g;
  int attention = -1;
  std::vector<double> scalars;
  std::vector<k::Tensor> tensors;  // bound to each argument slot
};
// As lowering asks (eager tensors captured twice are two argument nodes).
std::optional<k::autodiff::ScoreMod> extract(const Captured& c) {
  return k::autodiff::extract_score_mod(c.g, c.attention, [&](int x, int y) {
    if (x == y) return true;
    if (c.g[x].op != k::Op::arg || c.g[y].op != k::Op::arg) return false;
    const k::Tensor &a = c.tensors.at(static_cast<std::size_t>(c.g[x].slot)),
                    &b = c.tensors.at(static_cast<std::size_t>(c.g[y].slot));
    return a.data_ptr() == b.data_ptr() && a.shape() == b.shape();
  });
}
template <class Mod>
Captured capture(const Mod& mod) {
  static k::Tensor q = k::randn({2, 3, 5, 8}, k::f32, k::cpu, 1), kk = k::randn({2, 3, 6, 8}, k::f32, k::cpu, 2),
                   v = k::randn({2, 3, 6, 8}, k::f32, k::cpu, 3);
  Captured c;
  auto e = k::attention(q, kk, v, mod, {.scale = 0.25});
  c.g = k::graph::flatten(e);
  k::graph::Captured cap;
  k::graph::gather(e, cap);
  c.scalars.assign(cap.scalars.begin(), cap.scalars.begin() + cap.ns);
  for (int t = 0; t < cap.nt; ++t) c.tensors.push_back(*cap.tensors[static_cast<std::size_t>(t)]);
  k::graph::infer_shapes(c.g,
                         [&](int slot) -> const k::Tensor& { return *cap.tensors.at(static_cast<std::size_t>(slot)); });
  for (int i = 0; i < c.g.size(); ++i)
    if (c.g[i].op == k::Op::attention) c.attention = i;
  return c;
}

// The mod and its derivative (given cotangent ct) at n points, through the C the kernels inline,
// compiled as a host shared object.
struct Points {
  std::vector<float> s, ct;
  std::vector<std::int64_t> idx;  // b, h, i, j a point
};
std::pair<std::vector<float>, std::vector<float>> run(const k::autodiff::ScoreMod& m, const Captured& c,
                                                      const Points& p) {
  std::string src = k::codegen::prelude + k::codegen::score_mod_source(m);
  src += R"(
extern "C" void kiln_score_mod_points(int n, const float* s, const long long* idx, const double* sc, const float* ct,
                                      float* out, float* d) {
  kiln_score_scalars S;
  for (int k = 0; k < (int)(sizeof S.v / sizeof S.v[0]); ++k) S.v[k] = sc[k];
  for (int t = 0; t < n; ++t) {
    const long long* x = idx + 4 * t;
    out[t] = kiln_score_mod(s[t], x[0], x[1], x[2], x[3], S);
    d[t] = kiln_score_mod_vjp(s[t], x[0], x[1], x[2], x[3], S, ct[t]);
  }
}
)";
  auto so = k::runtime::compile_shared_object(src, "score_mod_points");
  using Fn = void (*)(int, const float*, const long long*, const double*, const float*, float*, float*);
  auto fn = reinterpret_cast<Fn>(so->symbol("kiln_score_mod_points"));
  std::vector<double> sc(std::max<std::size_t>(m.slots.size(), 1), 0.0);
  for (std::size_t i = 0; i < m.slots.size(); ++i) sc[i] = c.scalars.at(static_cast<std::size_t>(m.slots[i]));
  const int n = static_cast<int>(p.s.size());
  std::vector<float> out(p.s.size()), d(p.s.size());
  std::vector<long long> idx(p.idx.begin(), p.idx.end());
  fn(n, p.s.data(), idx.data(), sc.data(), p.ct.data(), out.data(), d.data());
  return {out, d};
}

Points random_points(int n) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 3.f);
  std::uniform_int_distribution<int> index(0, 6);
  Points p;
  for (int t = 0; t < n; ++t) {
    p.s.push_back(normal(rng));
    p.ct.push_back(normal(rng));
    for (int d = 0; d < 4; ++d) p.idx.push_back(index(rng));
  }
  return p;
}

}  // namespace

TEST_CASE("score_mod: pointwise mods become functions of one score; their value and derivative against the test's") {
  const float inf = std::numeric_limits<float>::infinity();
  const Points p = random_points(200);
  struct Case {
    const char* name;
    Captured c;
    std::size_t scalars;
    double (*value)(double s, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j);
    double (*slope)(double s, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j);  // d value / ds
  };
  std::vector<Case> cases;
  // ALiBi: a per-head slope times the distance (two C++ scalars: 1 and -2.0f).
  cases.push_back({"alibi", capture([](auto s, auto, auto h, auto i, auto j) {
                     return s - k::exp2(k::cast(h + 1, k::f32) * -2.0f) * k::cast(i - j, k::f32);
                   }),
                   2,
                   [](double s, std::int64_t, std::int64_t h, std::int64_t i, std::int64_t j) {
                     return s - std::exp2(-2.0 * double(h + 1)) * double(i - j);
                   },
                   [](double, std::int64_t, std::int64_t, std::int64_t, std::int64_t) { return 1.0; }});
  // Soft-capping.
  cases.push_back(
      {"softcap", capture([](auto s, auto, auto, auto, auto) { return k::tanh(s / 5.0f) * 5.0f; }), 2,
       [](double s, std::int64_t, std::int64_t, std::int64_t, std::int64_t) { return std::tanh(s / 5) * 5; },
       [](double s, std::int64_t, std::int64_t, std::int64_t, std::int64_t) {
         return 1 - std::tanh(s / 5) * std::tanh(s / 5);
       }});
  // A mask: -inf where i == 3 or j < 2 (the score passes elsewhere).
  cases.push_back(
      {"mask",
       capture([inf](auto s, auto, auto, auto i, auto j) { return k::where(i == 3, -inf, k::where(j < 2, -inf, s)); }),
       4,
       [](double s, std::int64_t, std::int64_t, std::int64_t i, std::int64_t j) {
         return i == 3 || j < 2 ? -std::numeric_limits<double>::infinity() : s;
       },
       [](double, std::int64_t, std::int64_t, std::int64_t i, std::int64_t j) { return i == 3 || j < 2 ? 0.0 : 1.0; }});
  // A pointwise composite (decomposed in the mod's graph) and the batch index.
  cases.push_back({"silu",
                   capture([](auto s, auto b, auto, auto, auto) { return k::silu(s) + k::cast(b, k::f32) * 0.5f; }), 1,
                   [](double s, std::int64_t b, std::int64_t, std::int64_t, std::int64_t) {
                     return s / (1 + std::exp(-s)) + 0.5 * double(b);
                   },
                   [](double s, std::int64_t, std::int64_t, std::int64_t, std::int64_t) {
                     const double sg = 1 / (1 + std::exp(-s));
                     return sg + s * sg * (1 - sg);
                   }});
  for (const Case& c : cases) {
    INFO(c.name);
    REQUIRE(c.c.attention >= 0);
    std::optional<k::autodiff::ScoreMod> m = extract(c.c);
    REQUIRE(m.has_value());
    CHECK(m->slots.size() == c.scalars);
    auto [out, d] = run(*m, c.c, p);
    for (std::size_t t = 0; t < p.s.size(); ++t) {
      const std::int64_t* x = p.idx.data() + 4 * t;
      const double want = c.value(p.s[t], x[0], x[1], x[2], x[3]);
      const double want_d = c.slope(p.s[t], x[0], x[1], x[2], x[3]) * p.ct[t];
      INFO("s " << p.s[t] << " at " << x[0] << ", " << x[1] << ", " << x[2] << ", " << x[3]);
      if (std::isinf(want))
        CHECK(out[t] == static_cast<float>(want));
      else
        CHECK(out[t] == doctest::Approx(want).epsilon(1e-5).scale(1));
      CHECK(d[t] == doctest::Approx(want_d).epsilon(1e-5).scale(1));
    }
  }
}

TEST_CASE("score_mod: a mod that reads a tensor or reduces the scores is not inlined") {
  k::Tensor bias = k::randn({3, 5, 6}, k::f32, k::cpu, 9);
  Captured relative = capture([&bias](auto s, auto, auto, auto, auto) { return s + bias; });
  CHECK_FALSE(extract(relative).has_value());
  Captured centred = capture([](auto s, auto, auto, auto, auto) { return s - k::amax(s, -1, true); });
  CHECK_FALSE(extract(centred).has_value());
  Captured plain = capture([](auto s, auto, auto, auto, auto) { return s * 2.0f; });
  REQUIRE(extract(plain).has_value());
  // Equal mods share one registry id; another mod gets its own.
  auto& mods = k::autodiff::ScoreMods::instance();
  auto m = *extract(plain);
  const int a = mods.add(m), b = mods.add(m);
  CHECK(a == b);
  Captured softcap = capture([](auto s, auto, auto, auto, auto) { return k::tanh(s / 5.0f) * 5.0f; });
  CHECK(mods.add(*extract(softcap)) != a);
  CHECK_THROWS_AS(mods.get(1 << 30), k::error);
}

TEST_CASE("score_mod: the fused kernels' sources with a mod compile under NVRTC (sm_80, sm_90a)") {
  Captured c = capture([](auto s, auto, auto h, auto i, auto j) {
    return k::where(j <= i, k::tanh(s / 20.0f) * 20.0f - k::cast(h, k::f32) * 0.1f * k::cast(i - j, k::f32),
                    -std::numeric_limits<float>::infinity());
  });
  auto m = *extract(c);
  const std::string mod = k::codegen::score_mod_source(m);
  namespace cg = k::codegen;
  for (int D : {64, 128}) {
    INFO("D " << D);
    cg::AttentionKernel fwd = cg::AttentionKernel::for_head_dim(D);
    fwd.score_mod = mod;
    CHECK(fwd.name().find("_mod") != std::string::npos);
    using Part = cg::AttentionBackwardKernel::Part;
    std::vector<std::pair<std::string, std::string>> sources = {{fwd.name(), cg::attention_forward_kernel_source(fwd)}};
    for (Part part : {Part::stats, Part::dq, Part::dk, Part::dv, Part::dkv}) {
      cg::AttentionBackwardKernel b;
      b.part = part;
      b.head_dim = D;
      b.causal = part == Part::dq;
      b.score_mod = mod;
      sources.emplace_back(b.name(), cg::attention_backward_kernel_source(b));
    }
    for (const auto& [name, source] : sources)
      for (const char* arch : {"sm_80", "sm_90a"}) {
        INFO(name << " for " << arch);
        CHECK(!k::runtime::compile_cubin(source, name, arch).empty());
      }
  }
}
