// The lengths a dynamic row kernel serves (issue 19 item 2): a function compiled with every size
// symbolic at one row length, then timed at others, as a model meeting new sequence lengths runs
// it. A held row's kernel serves lengths from held_min to its tiles' capacity and hands the rest
// to its looped twin (codegen/kernel_writer.hpp's KernelSource::held_min), so a rule that narrows
// or widens that range shows here, not in the sweep (which times each kernel at its compiling
// length). Each length is also compiled static, and both results must agree before either is timed.
// bf16, about 128 MiB of input a case; one JSON line a (case, length) on stdout.
//   served_range [--at 3073] [--cols 3073,2560,2049,1801] [--reps 30] [--impl NAME]
// Run it once per tuning variant (KILN_TUNE_LIVE_TILES=4 served_range --impl lt4, the rule before
// NOTES item 175) and compare.
#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/testing.hpp>

#include "timing.hpp"

namespace k = kiln;
using i64 = std::int64_t;

namespace {

std::vector<i64> parse_list(const std::string& s) {
  std::vector<i64> v;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) v.push_back(std::stoll(item));
  return v;
}

i64 rows_for(i64 cols) { return (i64{128} << 20) / (cols * 2); }

// One family: inputs at a length, and the function under test.
struct Family {
  std::string name;
  std::function<std::vector<k::Tensor>(i64 rows, i64 cols, int seed)> inputs;
};

// f(got, want) over a compiled function's outputs: a tensor, or a tuple of them (value_and_grad).
template <class T, class F>
void each_output(const T& got, const T& want, F&& f) {
  if constexpr (requires { std::tuple_size<T>::value; }) [&]<std::size_t... I>(std::index_sequence<I...>) {
      (each_output(std::get<I>(got), std::get<I>(want), f), ...);
    }
  (std::make_index_sequence<std::tuple_size_v<T>>{});
  else f(k::Tensor(got), k::Tensor(want));
}

template <class F>
void run_family(const Family& fam, F fn, i64 at, const std::vector<i64>& cols, int reps, const std::string& impl) {
  auto dyn = k::compile(fn, k::options{.shapes = k::shapes::dynamic});
  auto call = [](auto& compiled, const std::vector<k::Tensor>& in) { return compiled(in[0], in[1]); };
  {  // the compiling call: the kernels' tiles are sized at this length
    std::vector<k::Tensor> in = fam.inputs(rows_for(at), at, 1);
    (void)call(dyn, in);
  }
  for (i64 c : cols) {
    const i64 rows = rows_for(c);
    std::vector<k::Tensor> in = fam.inputs(rows, c, 2 + static_cast<int>(c));
    auto fixed = k::compile(fn, k::options{.shapes = k::shapes::static_});
    auto got = call(dyn, in);
    auto want = call(fixed, in);
    bool ok = true;
    each_output(got, want, [&](const k::Tensor& g, const k::Tensor& w) {
      ok = ok && bool(k::testing::allclose(g, w, 2e-2, 2e-2));
    });
    if (!ok) {
      std::printf(
          "{\"id\": \"served-%s-at%lld-%lldx%lld-bf16\", \"impl\": \"%s\", \"error\": \"dynamic and static differ\"}\n",
          fam.name.c_str(), static_cast<long long>(at), static_cast<long long>(rows), static_cast<long long>(c),
          impl.c_str());
      continue;
    }
    const double ms = kiln_bench::cuda_time_ms([&] { (void)call(dyn, in); }, reps);
    std::printf("{\"id\": \"served-%s-at%lld-%lldx%lld-bf16\", \"impl\": \"%s-dynamic\", \"ms\": %.4f}\n",
                fam.name.c_str(), static_cast<long long>(at), static_cast<long long>(rows), static_cast<long long>(c),
                impl.c_str(), ms);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  i64 at = 3073;
  std::vector<i64> cols{3073, 2560, 2049, 1801};
  int reps = 30;
  std::string impl = "kiln";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool more = i + 1 < argc;
    if (a == "--at" && more)
      at = std::stoll(argv[++i]);
    else if (a == "--cols" && more)
      cols = parse_list(argv[++i]);
    else if (a == "--reps" && more)
      reps = std::stoi(argv[++i]);
    else if (a == "--impl" && more)
      impl = argv[++i];
    else {
      std::fprintf(stderr, "usage: served_range [--at N] [--cols A,B,...] [--reps N] [--impl NAME]\n");
      return 2;
    }
  }
  if (!kiln_bench::cuda_device_present()) {
    std::fprintf(stderr, "served_range: no CUDA device, skipped\n");
    return 0;
  }
  auto randn = [](i64 rows, i64 cols, int seed) { return k::randn({rows, cols}, k::bf16, k::cuda, seed); };
  Family ce{"cross_entropy", [&](i64 rows, i64 cols, int seed) {
              k::Tensor t =
                  k::cast(k::rand({rows}, k::f32, k::cuda, seed + 1000) * static_cast<float>(cols - 1), k::i64);
              return std::vector<k::Tensor>{randn(rows, cols, seed), t};
            }};
  run_family(ce, k::value_and_grad([](auto l, auto t) { return k::cross_entropy(l, t); }, k::wrt<0>), at, cols, reps,
             impl);
  Family rms{"rms_norm", [&](i64 rows, i64 cols, int seed) {
               return std::vector<k::Tensor>{randn(rows, cols, seed), k::randn({cols}, k::bf16, k::cuda, seed + 1)};
             }};
  run_family(
      rms, [](auto x, auto w) { return k::rms_norm(x, w, 1e-6); }, at, cols, reps, impl);
  Family sm{"softmax", [&](i64 rows, i64 cols, int seed) {
              return std::vector<k::Tensor>{randn(rows, cols, seed), randn(1, cols, seed + 1)};
            }};
  run_family(
      sm, [](auto x, auto y) { return k::softmax(x + y, -1); }, at, cols, reps, impl);
  return 0;
}
