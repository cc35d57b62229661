// No recompile cliffs (issue 19 item 2): a k::shapes::dynamic program of each common gradient and
// view, called at four sizes where every dim changes (no size 1, and no two dims equal at the first
// call, which duck sizing would tie), compiles once and matches the oracle at each call (the derived
// graph evaluated unfused in f64: tests/gradient_oracle.hpp). A size that a rule names (an iota, a view's attributes, a
// step's row count) fails the next call's inference and shows here as a second compile.
#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/testing.hpp>

#include "gradient_oracle.hpp"
#include "guarded_memory.hpp"

namespace k = kiln;

namespace {

using Args = std::vector<k::Tensor>;

// Calls fn (of A tensors) with the dynamic program and the f64 oracle at each of four argument sets.
template <int A, class Fn>
void compiles_once(const char* name, Fn fn, const std::function<Args(int)>& make) {
  const std::string label = name;  // doctest prints a char pointer as an address
  INFO(label);
  auto f = k::compile(fn, {.shapes = k::shapes::dynamic, .on_limit = k::on_limit::raise});
  // h(v[0], ..., v[A - 1]) as tensors: a compiled function's tensor or tuple of them, or the
  // oracle's values.
  auto call = [](auto&& h, const Args& v) {
    auto r = [&] {
      if constexpr (A == 1)
        return h(v[0]);
      else if constexpr (A == 2)
        return h(v[0], v[1]);
      else
        return h(v[0], v[1], v[2]);
    }();
    Args out;
    if constexpr (std::is_same_v<decltype(r), std::vector<k::reference::Value>>)
      for (const auto& x : r) out.push_back(k::reference::to_tensor(x));
    else if constexpr (requires { std::tuple_size<decltype(r)>::value; })
      std::apply([&](auto&... t) { (out.push_back(k::Tensor(t)), ...); }, r);
    else
      out.push_back(k::Tensor(r));
    return out;
  };
  auto oracle = [&](const auto&... t) { return oracle_outputs(fn, t...); };
  for (int i = 0; i < 4; ++i) {
    CAPTURE(i);
    // Each input against a guard page, past its end or before its start by turns: a kernel reading
    // outside an input (a padded split's last chunk) crashes the test.
    std::vector<std::unique_ptr<GuardedHost>> guarded;
    Args a;
    for (const auto& t : make(i)) {
      guarded.push_back(std::make_unique<GuardedHost>(t, guarded.size() % 2 ? Guard::before : Guard::after));
      a.push_back(guarded.back()->tensor);
    }
    Args a64;
    for (const auto& t : a) a64.push_back(k::is_floating(t.dtype()) ? k::Tensor(k::cast(t, k::f64)) : t);
    const Args got = call(f, a), want = call(oracle, a64);
    REQUIRE(got.size() == want.size());
    for (std::size_t j = 0; j < got.size(); ++j) {
      auto r = k::testing::allclose(got[j], want[j], 1e-4, 1e-5);
      CHECK_MESSAGE(bool(r), "output " << j << ": " << r);
    }
  }
  CHECK(f.cache().compiles() == 1);
}

}  // namespace

TEST_CASE("dynamic: gradients and views over four sizes compile once, each against the f64 oracle") {
  const std::int64_t N[] = {37, 13, 101, 22}, C[] = {11, 29, 7, 64}, T[] = {9, 17, 5, 33};
  auto randn = [](k::Dims s, int seed) { return k::randn(s, k::f32, k::cpu, static_cast<std::uint64_t>(seed)); };
  auto ids = [](k::Dims s, std::int64_t hi, int seed) {
    return k::Tensor(
        k::cast(k::rand(s, k::f32, k::cpu, static_cast<std::uint64_t>(seed)) * static_cast<float>(hi - 1), k::i64));
  };
  compiles_once<3>(
      "layer_norm's gradient, weight and bias",
      k::grad([](auto x, auto w, auto b) { return k::sum(k::square(k::layer_norm(x, w, b))); }, k::wrt<0, 1, 2>),
      [&](int i) {
        return Args{randn({N[i], C[i]}, 1), randn({C[i]}, 2), randn({C[i]}, 3)};
      });
  compiles_once<2>("rms_norm's gradient",
                   k::grad([](auto x, auto w) { return k::sum(k::exp(k::rms_norm(x, w, 1e-6))); }, k::wrt<0, 1>),
                   [&](int i) {
                     return Args{randn({N[i], C[i]}, 4), randn({C[i]}, 5)};
                   });
  compiles_once<1>("softmax over dim 0, its gradient",
                   k::grad([](auto x) { return k::sum(k::square(k::softmax(x, 0))); }, k::wrt<0>), [&](int i) {
                     return Args{randn({N[i], C[i]}, 6)};
                   });
  compiles_once<3>(
      "an MLP's weight gradients (batch and hidden change)",
      k::grad([](auto x, auto w1, auto w2) { return k::mean(k::gelu(k::matmul(k::gelu(k::matmul(x, w1)), w2))); },
              k::wrt<1, 2>),
      [&](int i) {
        return Args{randn({N[i], 8}, 7), randn({8, C[i]}, 8), randn({C[i], 6}, 9)};
      });
  compiles_once<3>("a linear over [B, T, C], its gradients",
                   k::grad([](auto x, auto w, auto b) { return k::sum(k::tanh(k::linear(x, w, b))); }, k::wrt<0, 1, 2>),
                   [&](int i) {
                     return Args{randn({2, T[i], C[i]}, 10), randn({5, C[i]}, 11), randn({5}, 12)};
                   });
  compiles_once<2>("mse_loss's gradient", k::grad([](auto x, auto y) { return k::mse_loss(x, y); }, k::wrt<0>),
                   [&](int i) {
                     return Args{randn({N[i], C[i]}, 13), randn({N[i], C[i]}, 14)};
                   });
  compiles_once<2>("an embedding's gradient (vocabulary and sequence change)",
                   k::grad([](auto w, auto t) { return k::sum(k::exp(k::embedding(w, t))); }, k::wrt<0>), [&](int i) {
                     return Args{randn({C[i] + 3, 6}, 15), ids({2, T[i]}, C[i] + 3, 16)};
                   });
  compiles_once<1>("logsumexp's gradient", k::grad([](auto x) { return k::sum(k::logsumexp(x, 1)); }, k::wrt<0>),
                   [&](int i) {
                     return Args{randn({N[i], C[i]}, 17)};
                   });
  compiles_once<2>(
      "a transposed operand", [](auto x, auto y) { return k::transpose(x, 0, 1) + y; },
      [&](int i) {
        return Args{randn({C[i], N[i]}, 18), randn({N[i], C[i]}, 19)};
      });
  compiles_once<2>("stack's gradient",
                   k::grad([](auto x, auto y) { return k::sum(k::exp(k::stack(0, x, y))); }, k::wrt<0, 1>), [&](int i) {
                     return Args{randn({N[i], C[i]}, 20), randn({N[i], C[i]}, 21)};
                   });
  compiles_once<1>(
      "unsqueeze, expand and a sum",
      [](auto x) {
        return k::sum(k::expand(k::unsqueeze(x, 1), {-1, 3, -1}), 1) * 2.0f;
      },
      [&](int i) {
        return Args{randn({N[i], C[i]}, 22)};
      });
  compiles_once<1>("var over dim 0, its gradient", k::grad([](auto x) { return k::sum(k::var(x, 0)); }, k::wrt<0>),
                   [&](int i) {
                     return Args{randn({N[i], C[i]}, 23)};
                   });
  compiles_once<1>("amax's gradient", k::grad([](auto x) { return k::sum(k::amax(x, 1)); }, k::wrt<0>), [&](int i) {
    return Args{randn({N[i], C[i]}, 24)};
  });
  compiles_once<2>("cat along dim 0 (both parts change), its gradient",
                   k::grad([](auto x, auto y) { return k::sum(k::exp(k::cat(0, x, y))); }, k::wrt<0, 1>), [&](int i) {
                     return Args{randn({N[i], 6}, 26), randn({T[i], 6}, 27)};
                   });
  compiles_once<1>("a strided slice's gradient",
                   k::grad([](auto x) { return k::sum(k::square(k::slice(x, 0, 2, 1000, 3))); }, k::wrt<0>),
                   [&](int i) {
                     return Args{randn({N[i], C[i]}, 28)};
                   });
  compiles_once<3>(
      "grouped-query causal attention's gradients (Tq != Tk)",
      k::grad(
          [](auto q, auto kk, auto v) {
            auto o = k::attention(q, kk, v, {.causal = true});
            return k::sum(o * o);
          },
          k::wrt<0, 1, 2>),
      [&](int i) {
        return Args{randn({2, 4, T[i], 8}, 29), randn({2, 2, T[i] + 3, 8}, 30), randn({2, 2, T[i] + 3, 8}, 31)};
      });
}

// Long reductions over few outputs split in two stages; with symbolic sizes the chunks are padded,
// and a padded chunk's positions past the input must read nothing (the inputs lie against guard
// pages). Row counts of 16K-33K, none a multiple of the chunk count, change at each call.
TEST_CASE("dynamic: split reductions over changing row counts read only their inputs, against the oracle") {
  const std::int64_t R[] = {16411, 33331, 20011, 17389};
  auto randn = [](k::Dims s, int seed) { return k::randn(s, k::f32, k::cpu, static_cast<std::uint64_t>(seed)); };
  compiles_once<3>(
      "layer_norm's weight and bias gradients (column sums over the rows)",
      k::grad([](auto x, auto w, auto b) { return k::sum(k::square(k::layer_norm(x, w, b))); }, k::wrt<1, 2>),
      [&](int i) {
        return Args{randn({R[i], 12}, 40), randn({12}, 41), randn({12}, 42)};
      });
  const std::int64_t C[] = {12, 29, 7, 40};
  compiles_once<3>(
      "layer_norm's weight and bias gradients as the row length changes too",
      k::grad([](auto x, auto w, auto b) { return k::sum(k::square(k::layer_norm(x, w, b))); }, k::wrt<0, 1, 2>),
      [&](int i) {
        return Args{randn({R[i], C[i]}, 51), randn({C[i]}, 52), randn({C[i]}, 53)};
      });
  compiles_once<2>(
      "a full sum of a product", [](auto x, auto y) { return k::sum(x * y); },
      [&](int i) {
        return Args{randn({R[i], 3}, 43), randn({R[i], 3}, 44)};
      });
  compiles_once<2>(
      "cross_entropy's mean loss and its gradient",
      k::value_and_grad([](auto l, auto t) { return k::cross_entropy(l, t); }, k::wrt<0>), [&](int i) {
        return Args{randn({R[i], 9}, 45), k::Tensor(k::cast(k::rand({R[i]}, k::f32, k::cpu, 46) * 8.0f, k::i64))};
      });
  compiles_once<1>(
      "logsumexp over dim 0", [](auto x) { return k::logsumexp(x, 0); },
      [&](int i) {
        return Args{randn({R[i], 5}, 47)};
      });
  compiles_once<1>(
      "var over dim 0", [](auto x) { return k::var(x, 0); },
      [&](int i) {
        return Args{randn({R[i], 6}, 48)};
      });
  compiles_once<2>(
      "an embedding's gradient over many ids",
      k::grad([](auto w, auto t) { return k::sum(k::exp(k::embedding(w, t))); }, k::wrt<0>), [&](int i) {
        return Args{randn({50, 4}, 49), k::Tensor(k::cast(k::rand({R[i]}, k::f32, k::cpu, 50) * 49.0f, k::i64))};
      });
}
