// The shape sweep (issue 19, BENCHMARKS.md row "sweep"): kiln's side. Row ops (softmax, log_softmax,
// layer_norm and rms_norm forward and forward+backward, cross_entropy forward+backward) over row
// lengths 64 ... 262,144 in f32 and bf16, with rows for about --mib MiB of input; pointwise `x + y`
// over transposed, strided, offset and broadcast operands; column sums; 3-D softmax; small sizes.
// Every case runs in k::shapes::static_ and k::shapes::dynamic (and, with --modes ...,auto, in
// k::shapes::automatic after a call at the checked rows' count, as a model meets a new batch), each
// on a function of its own, checked once against the f64 oracle (k::reference::eval, on the first
// rows) before it is timed with CUDA events (benchmarks/timing.hpp, the sampling of bench.cpp). One
// JSON object a line:
//   {"id": "sweep-softmax-4096x8192-f32", "impl": "kiln" | "kiln-dynamic" | "kiln-auto", "ms": ..., "gbps": ...,
//    "bytes": ..., "pct_copy": ..., "family": ..., "op": ..., "shape": ..., "dtype": ..., "note": ...}
// benchmarks/sweep_peer.py prints the same ids for torch.compile; benchmarks/sweep_report.py divides.
// Usage: sweep [--only FAMILY,...] [--dtypes f32,bf16] [--cols 64,1000] [--mib N] [--reps N] [--list]
//   (--cols: the row families' lengths, any, in place of the list below)
//        sweep --cpu --mib 1 ...   (CPU tensors, wall clock: a smoke test where there is no GPU)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/testing.hpp>

#include "timing.hpp"

namespace k = kiln;

namespace {

using i64 = std::int64_t;

struct Config {
  std::string only, dtypes = "f32,bf16", cols, modes = "static,dynamic", impl = "kiln", match;
  double mib = 256;
  int reps = 100;
  bool cpu = false, list = false;
  bool perturb = false;  // --perturb: the oracle off by 2%, so every check must fail (tests the checks)
} cfg;
double copy_gbps = 0;  // the device-to-device copy ceiling, measured first on the GPU
int failures = 0;

const std::vector<std::string> kFamilies = {"softmax",  "log_softmax",  "layer_norm",    "layer_norm_bwd",
                                            "rms_norm", "rms_norm_bwd", "cross_entropy", "pointwise",
                                            "colsum",   "3d",           "small"};
const std::vector<i64> kRowLengths = {64,   128,  256,   512,   768,   1000,  1024,  2048,   3072,  4096,
                                      5120, 8192, 12288, 16384, 32000, 50257, 65536, 128256, 262144};

bool listed(const std::string& list, const std::string& x) {
  return ("," + list + ",").find("," + x + ",") != std::string::npos;
}
// The row families' lengths: --cols's, any (odd ones off the list too: 197, 1001, 3073), or the list.
std::vector<i64> row_lengths() {
  if (cfg.cols.empty()) return kRowLengths;
  std::vector<i64> out;
  for (std::size_t at = 0; at <= cfg.cols.size();) {
    std::size_t end = std::min(cfg.cols.find(',', at), cfg.cols.size());
    if (end > at) out.push_back(std::stoll(cfg.cols.substr(at, end - at)));
    at = end + 1;
  }
  return out;
}
k::Device dev() { return cfg.cpu ? k::cpu : k::Device(k::cuda); }
k::dtype dtype_of(const std::string& s) { return s == "bf16" ? k::bf16 : k::f32; }
i64 esize(const std::string& s) { return s == "bf16" ? 2 : 4; }
i64 budget_bytes() { return static_cast<i64>(cfg.mib * 1048576.0); }
// Rows of `cols` elements in about --mib MiB (at least one).
i64 rows_for(i64 cols, i64 es) { return std::max<i64>(1, budget_bytes() / (cols * es)); }
// The side of a square of about --mib MiB, a multiple of 64 (8192 for 256 MiB of f32).
i64 side_for(i64 es) {
  i64 m = budget_bytes() / es, s = static_cast<i64>(std::sqrt(static_cast<double>(m)));
  while (s * s > m) --s;
  while ((s + 1) * (s + 1) <= m) ++s;
  return std::max<i64>(64, s / 64 * 64);
}
std::string dims(const std::vector<i64>& d) {
  std::string s;
  for (auto v : d) s += (s.empty() ? "" : "x") + std::to_string(v);
  return s;
}

void fail(const std::string& id, const std::string& impl, const std::string& why) {
  std::string w = why.substr(0, 400);
  for (auto& c : w)
    if (c == '"' || c == '\n' || c == '\\') c = '\'';
  std::printf("{\"id\": \"%s\", \"impl\": \"%s\", \"error\": \"%s\"}\n", id.c_str(), impl.c_str(), w.c_str());
  std::fflush(stdout);
  std::fprintf(stderr, "sweep: %s %s FAILED: %s\n", id.c_str(), impl.c_str(), w.c_str());
  ++failures;
}

// One case: its inputs and how its outputs are checked.
//  - in_dim[i]: the dim along which input i is cut to its first `check_rows` for the oracle (-1: whole,
//    e.g. a weight); with full_check the oracle sees the whole inputs instead.
//  - out_dim[j]: output j depends on those rows only: its first check_rows along that dim are
//    compared with the oracle's (times out_scale[j]); -1: a reduction over the rows (dw, db, a mean
//    loss), compared with the same compiled function called on the cut inputs.
struct Spec {
  std::string family, op, id, dtype;
  std::vector<i64> shape;
  std::vector<k::Tensor> in;
  std::vector<int> in_dim, out_dim;
  std::vector<double> out_scale;  // empty: all 1
  i64 check_rows = 4;
  bool full_check = false;
  double bytes = 0, tol = 1e-3;
};

template <class R>
std::vector<k::Tensor> as_vec(R&& r) {
  if constexpr (std::is_same_v<std::decay_t<R>, k::Tensor>)
    return {r};
  else
    return std::apply([](auto&... t) { return std::vector<k::Tensor>{k::Tensor(t)...}; }, r);
}

template <std::size_t N, class F>
std::vector<k::Tensor> invoke(F& f, const std::vector<k::Tensor>& a) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) { return as_vec(f(a[I]...)); }
  (std::make_index_sequence<N>{});
}

// The oracle: fn on CPU f64 copies of the inputs (integer inputs keep their dtype), unfused in f64
// for an expression; through kiln's CPU backend in f64 for a gradient function.
template <std::size_t N, class Fn>
std::vector<k::Tensor> oracle(const Fn& fn, const std::vector<k::Tensor>& a) {
  std::vector<k::Tensor> c;
  for (auto& t : a) {
    k::Tensor h = t.to(k::cpu);
    c.push_back(h.dtype() == k::i64 || h.dtype() == k::i32 ? h : h.to(k::f64));
  }
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    auto r = fn(c[I]...);
    if constexpr (requires { k::reference::eval(r); })
      return as_vec(k::reference::eval(r));
    else
      return as_vec(r);
  }
  (std::make_index_sequence<N>{});
}

std::string compare(const k::Tensor& got, const k::Tensor& want, double tol, double scale = 1) {
  k::Tensor w = want;
  if (cfg.perturb) scale *= 1.02;
  if (scale != 1) w = k::eval(want * scale);
  double m = 0;
  for (double v : k::to_vector<double>(w)) m = std::max(m, std::abs(v));
  // atol relative to the output's magnitude: softmax rows of 262,144 or cross_entropy's dlogits are
  // tiny everywhere, where an absolute tolerance would pass anything.
  auto r = k::testing::allclose(k::reference::eval(got), w, tol, tol * std::max(m, 1e-30));
  return r ? "" : r.str();
}

template <std::size_t N, class Fn>
void measure(const Spec& s, Fn fn) {
  std::vector<k::Tensor> cut;
  for (std::size_t i = 0; i < s.in.size(); ++i)
    cut.push_back(
        s.full_check || s.in_dim[i] < 0
            ? s.in[i]
            : k::Tensor(k::slice(s.in[i], s.in_dim[i], 0, std::min<i64>(s.check_rows, s.in[i].shape()[s.in_dim[i]]))));
  std::vector<k::Tensor> want;
  try {
    want = oracle<N>(fn, s.full_check ? s.in : cut);
  } catch (const std::exception& e) {
    return fail(s.id, "kiln", std::string("oracle: ") + e.what());
  }
  for (auto mode : {k::shapes::static_, k::shapes::dynamic, k::shapes::automatic}) {
    const char* name = mode == k::shapes::dynamic ? "dynamic" : mode == k::shapes::automatic ? "auto" : "static";
    if (!listed(cfg.modes, name)) continue;
    std::string impl = mode == k::shapes::static_ ? cfg.impl : cfg.impl + "-" + name;
    try {
      auto f = k::compile(fn, {.shapes = mode, .recompile_limit = 64});
      // The automatic mode as a model meets it: a call at another row count first (the checked
      // rows), so that the timed program is the one compiled with the row count symbolic.
      if (mode == k::shapes::automatic) invoke<N>(f, cut);
      std::vector<k::Tensor> got = invoke<N>(f, s.in), small;
      std::string bad;
      for (std::size_t j = 0; j < got.size() && bad.empty(); ++j) {
        double scale = s.out_scale.empty() ? 1.0 : s.out_scale[j];
        if (s.full_check) {
          bad = compare(got[j], want[j], s.tol);
        } else if (s.out_dim[j] >= 0) {
          int d = s.out_dim[j];
          k::Tensor part = k::slice(got[j], d, 0, std::min<i64>(s.check_rows, got[j].shape()[d]));
          bad = compare(part, want[j], s.tol, scale);
        } else {
          if (small.empty()) small = invoke<N>(f, cut);
          bad = compare(small[j], want[j], s.tol);
        }
        if (!bad.empty()) bad = "output " + std::to_string(j) + ": " + bad;
      }
      if (!bad.empty()) {
        fail(s.id, impl, "wrong result: " + bad);
        continue;
      }
      auto call = [&] { invoke<N>(f, s.in); };
      double ms = cfg.cpu ? kiln_bench::wall_time_ms(call, cfg.reps) : kiln_bench::cuda_time_ms(call, cfg.reps);
      double gbps = s.bytes / ms / 1e6;
      char pct[32] = "null";
      if (copy_gbps > 0) std::snprintf(pct, sizeof pct, "%.1f", 100 * gbps / copy_gbps);
      std::printf(
          "{\"id\": \"%s\", \"impl\": \"%s\", \"ms\": %.5f, \"gbps\": %.1f, \"bytes\": %.0f, \"pct_copy\": %s, "
          "\"family\": \"%s\", \"op\": \"%s\", \"shape\": \"%s\", \"dtype\": \"%s\", \"note\": \"%s\"}\n",
          s.id.c_str(), impl.c_str(), ms, gbps, s.bytes, pct, s.family.c_str(), s.op.c_str(), dims(s.shape).c_str(),
          s.dtype.c_str(), cfg.cpu ? "cpu wall clock" : "");
      std::fflush(stdout);
    } catch (const std::exception& e) {
      fail(s.id, impl, e.what());
    }
  }
}

struct Case {
  std::string family, id;
  std::function<void()> run;
};

Spec spec(const std::string& family, const std::string& op, const std::string& dt, std::vector<i64> shape) {
  Spec s;
  s.family = family, s.op = op, s.dtype = dt, s.shape = std::move(shape);
  s.id = "sweep-" + op + "-" + dims(s.shape) + "-" + dt;
  s.tol = dt == "bf16" ? 3e-2 : 1e-3;
  return s;
}

std::uint64_t seed = 1;
// Standard normal inputs made where they live: Box-Muller over two counter-based uniform streams
// (k::rand_like), one kernel on the GPU (k::randn fills on the host: seconds for 256 MiB).
k::Tensor randn(const std::vector<i64>& shape, const std::string& dt) {
  k::Tensor z = k::empty(k::Dims(shape.begin(), shape.end()), k::f32, dev());
  std::uint64_t s = seed++;
  return k::eval(k::cast(k::sqrt(-2.0f * k::log(1.0f - k::rand_like(z, s, 0))) *
                             k::cos(6.2831853f * k::rand_like(z, s, static_cast<std::uint64_t>(z.numel()))),
                         dtype_of(dt)));
}

// The row ops: op over the last dim of [rows, cols].
void row_case(std::vector<Case>& cases, const std::string& fam, const std::string& dt, i64 rows, i64 cols,
              const std::string& op_name) {
  // fam picks the op; the reported family of the small, fixed sizes is "small".
  Spec s0 = spec(op_name.starts_with("small_") ? "small" : fam, op_name, dt, {rows, cols});
  cases.push_back(
      {fam, s0.id, [=] {
         Spec s = s0;
         const double n = static_cast<double>(rows) * cols, es = static_cast<double>(esize(dt)),
                      c = static_cast<double>(cols);
         if (fam == "softmax" || fam == "log_softmax") {
           s.in = {randn({rows, cols}, dt)}, s.in_dim = {0}, s.out_dim = {0}, s.bytes = 2 * n * es;
           if (fam == "softmax") return measure<1>(s, [](auto x) { return k::softmax(x, -1); });
           return measure<1>(s, [](auto x) { return k::log_softmax(x, -1); });
         }
         if (fam == "layer_norm") {
           s.in = {randn({rows, cols}, dt), randn({cols}, dt), randn({cols}, dt)};
           s.in_dim = {0, -1, -1}, s.out_dim = {0}, s.bytes = 2 * n * es + 2 * c * es;
           return measure<3>(s, [](auto x, auto w, auto b) { return k::layer_norm(x, w, b); });
         }
         if (fam == "layer_norm_bwd") {
           // dx, dw, db from a random dy (k::vjp returns no y): read x, w, b, dy; write dx, dw, db.
           s.in = {randn({rows, cols}, dt), randn({cols}, dt), randn({cols}, dt), randn({rows, cols}, dt)};
           s.in_dim = {0, -1, -1, 0}, s.out_dim = {0, -1, -1}, s.bytes = 3 * n * es + 4 * c * es;
           return measure<4>(s, k::vjp([](auto x, auto w, auto b) { return k::layer_norm(x, w, b); }, k::wrt<0, 1, 2>));
         }
         if (fam == "rms_norm") {
           s.in = {randn({rows, cols}, dt), randn({cols}, dt)};
           s.in_dim = {0, -1}, s.out_dim = {0}, s.bytes = 2 * n * es + c * es;
           return measure<2>(s, [](auto x, auto w) { return k::rms_norm(x, w, 1e-6); });
         }
         if (fam == "rms_norm_bwd") {
           // dx, dw from a random dy: read x, w, dy; write dx, dw.
           s.in = {randn({rows, cols}, dt), randn({cols}, dt), randn({rows, cols}, dt)};
           s.in_dim = {0, -1, 0}, s.out_dim = {0, -1}, s.bytes = 3 * n * es + 2 * c * es;
           return measure<3>(s, k::vjp([](auto x, auto w) { return k::rms_norm(x, w, 1e-6); }, k::wrt<0, 1>));
         }
         if (fam == "cross_entropy") {
           // The mean loss and dlogits: read logits and targets; write dlogits and the loss.
           k::Tensor t = k::cast(k::rand({rows}, k::f32, dev(), seed++) * static_cast<float>(cols - 1), k::i64);
           s.in = {randn({rows, cols}, dt), t}, s.in_dim = {0, 0}, s.out_dim = {-1, 0};
           s.check_rows = std::min<i64>(rows, 4);
           // dlogits of the mean over `rows` rows, its first rows against the oracle's mean over those.
           s.out_scale = {1.0, static_cast<double>(s.check_rows) / static_cast<double>(rows)};
           s.bytes = 2 * n * es + 8.0 * rows + es;
           return measure<2>(s, k::value_and_grad([](auto l, auto t) { return k::cross_entropy(l, t); }, k::wrt<0>));
         }
       }});
}

void pointwise_cases(std::vector<Case>& cases, const std::string& dt) {
  const i64 n = side_for(esize(dt));
  const double es = static_cast<double>(esize(dt)), nn = static_cast<double>(n) * n;
  auto add = [&](const std::string& op, std::function<void(Spec&)> body) {
    Spec s0 = spec("pointwise", op, dt, {n, n});
    cases.push_back({"pointwise", s0.id, [=] {
                       Spec s = s0;
                       s.full_check = true, s.bytes = 3 * nn * es;
                       body(s);
                     }});
  };
  add("add_contig", [=](Spec& s) {
    s.in = {randn({n, n}, dt), randn({n, n}, dt)};
    measure<2>(s, [](auto x, auto y) { return x + y; });
  });
  add("add_transposed", [=](Spec& s) {
    s.in = {randn({n, n}, dt), randn({n, n}, dt)};
    measure<2>(s, [](auto x, auto y) { return k::transpose(x, 0, 1) + y; });
  });
  add("add_strided", [=](Spec& s) {  // every second column of [n, 2n]
    s.in = {randn({n, 2 * n}, dt), randn({n, n}, dt)};
    measure<2>(s, [n](auto x, auto y) { return k::slice(x, 1, 0, 2 * n, 2) + y; });
  });
  add("add_offset", [=](Spec& s) {  // a view starting one element in: no aligned vector loads
    s.in = {randn({n * n + 1}, dt), randn({n, n}, dt)};
    measure<2>(s, [n](auto x, auto y) { return k::reshape(k::slice(x, 0, 1, n * n + 1), {n, n}) + y; });
  });
  add("add_bcast_row", [=](Spec& s) {  // y of [n] over the rows
    s.in = {randn({n, n}, dt), randn({n}, dt)}, s.bytes = 2 * nn * es + n * es;
    measure<2>(s, [](auto x, auto y) { return x + y; });
  });
  add("add_bcast_col", [=](Spec& s) {  // y of [n, 1] over the columns
    s.in = {randn({n, n}, dt), randn({n, 1}, dt)}, s.bytes = 2 * nn * es + n * es;
    measure<2>(s, [](auto x, auto y) { return x + y; });
  });
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    bool more = i + 1 < argc;
    if (a == "--only" && more)
      cfg.only = argv[++i];
    else if (a == "--dtypes" && more)
      cfg.dtypes = argv[++i];
    else if (a == "--cols" && more)
      cfg.cols = argv[++i];
    else if (a == "--modes" && more)
      cfg.modes = argv[++i];
    else if (a == "--match" && more)  // only the cases whose id contains this (an A/B run of one op)
      cfg.match = argv[++i];
    else if (a == "--impl" && more)  // the name in the "impl" field (an A/B run's variant: kiln-old)
      cfg.impl = argv[++i];
    else if (a == "--mib" && more)
      cfg.mib = std::stod(argv[++i]);
    else if (a == "--reps" && more)
      cfg.reps = std::max(1, std::stoi(argv[++i]));
    else if (a == "--cpu")
      cfg.cpu = true;
    else if (a == "--list")
      cfg.list = true;
    else if (a == "--perturb")
      cfg.perturb = true;
    else {
      std::fprintf(stderr,
                   "usage: %s [--only FAMILY,...] [--dtypes f32,bf16] [--cols N,...] [--mib N] [--reps N] [--cpu] "
                   "[--modes static,dynamic,auto] [--impl NAME] [--match TEXT] [--list] [--perturb]\nfamilies:",
                   argv[0]);
      for (auto& f : kFamilies) std::fprintf(stderr, " %s", f.c_str());
      std::fprintf(stderr, "\n");
      return 2;
    }
  }
  {
    std::string rest = cfg.only;
    while (!rest.empty()) {
      auto p = rest.find(',');
      std::string one = rest.substr(0, p);
      rest = p == std::string::npos ? "" : rest.substr(p + 1);
      if (!one.empty() && std::find(kFamilies.begin(), kFamilies.end(), one) == kFamilies.end()) {
        std::fprintf(stderr, "sweep: unknown family '%s'\n", one.c_str());
        return 2;
      }
    }
  }

  std::vector<Case> cases;
  for (const std::string dt : {"f32", "bf16"}) {
    if (!listed(cfg.dtypes, dt)) continue;
    const i64 es = esize(dt);
    for (const std::string fam :
         {"softmax", "log_softmax", "layer_norm", "layer_norm_bwd", "rms_norm", "rms_norm_bwd", "cross_entropy"})
      for (i64 c : row_lengths()) row_case(cases, fam, dt, rows_for(c, es), c, fam);
    pointwise_cases(cases, dt);
    for (i64 c : {i64{32}, i64{768}, i64{4096}, i64{32000}}) {  // column sums of [R, C]
      i64 r = rows_for(c, es);
      Spec s0 = spec("colsum", "colsum", dt, {r, c});
      cases.push_back({"colsum", s0.id, [=] {
                         Spec s = s0;
                         s.in = {randn({r, c}, dt)}, s.in_dim = {1}, s.out_dim = {0};
                         s.bytes = static_cast<double>(es) * (static_cast<double>(r) * c + c);
                         measure<1>(s, [](auto x) { return k::sum(x, 0); });
                       }});
    }
    for (auto [h, t] : {std::pair<i64, i64>{12, 197}, {16, 1024}, {32, 4096}}) {  // softmax of [B, H, T]
      i64 b = std::max<i64>(1, budget_bytes() / (h * t * es));
      for (int dim : {-1, 1}) {
        Spec s0 = spec("3d", dim == -1 ? "softmax3d" : "softmax3d_dim1", dt, {b, h, t});
        cases.push_back({"3d", s0.id, [=] {
                           Spec s = s0;
                           s.in = {randn({b, h, t}, dt)}, s.in_dim = {0}, s.out_dim = {0};
                           s.bytes = 2.0 * es * static_cast<double>(b) * h * t;
                           if (dim == -1) return measure<1>(s, [](auto x) { return k::softmax(x, -1); });
                           measure<1>(s, [](auto x) { return k::softmax(x, 1); });
                         }});
      }
    }
    // Small, latency-bound sizes (not scaled by --mib).
    for (auto [fam, r, c] : {std::tuple<std::string, i64, i64>{"softmax", 4, 64},
                             {"softmax", 32, 1000},
                             {"layer_norm", 16, 768},
                             {"rms_norm", 8, 4096},
                             {"cross_entropy", 8, 32000}}) {
      std::size_t before = cases.size();
      row_case(cases, fam, dt, r, c, "small_" + fam);
      for (std::size_t i = before; i < cases.size(); ++i) cases[i].family = "small";
    }
  }
  // row_case's Spec carries the family that picks the op; the case's family is what --only selects.
  std::vector<Case> chosen;
  for (auto& c : cases)
    if ((cfg.only.empty() || listed(cfg.only, c.family)) && c.id.find(cfg.match) != std::string::npos)
      chosen.push_back(c);
  if (cfg.list) {
    for (auto& c : chosen) std::printf("%s %s\n", c.family.c_str(), c.id.c_str());
    return 0;
  }

  if (!cfg.cpu && !k::driver::available()) {
    std::printf(
        "{\"id\": \"env\", \"impl\": \"kiln\", \"error\": \"no CUDA device (run with --cpu --mib 1 for "
        "the CPU smoke test)\"}\n");
    std::fprintf(stderr, "sweep: no GPU here; nothing to time (--cpu --mib 1 runs the CPU smoke test)\n");
    return 0;
  }
  if (cfg.cpu) {
    std::printf("{\"id\": \"env\", \"impl\": \"kiln\", \"device\": \"cpu\", \"mib\": %g, \"reps\": %d}\n", cfg.mib,
                cfg.reps);
  } else {
    std::printf("{\"id\": \"env\", \"impl\": \"kiln\", \"device\": \"%s\", \"mib\": %g, \"reps\": %d}\n",
                k::driver::device_name(0).c_str(), cfg.mib, cfg.reps);
    std::size_t bytes = std::size_t{1} << 30;
    auto a = k::empty({static_cast<i64>(bytes / 4)}, k::f32, k::cuda),
         b = k::empty({static_cast<i64>(bytes / 4)}, k::f32, k::cuda);
    double ms =
        kiln_bench::cuda_time_ms([&] { k::driver::copy_async(b.data_ptr(), a.data_ptr(), bytes, nullptr); }, cfg.reps);
    copy_gbps = 2.0 * bytes / ms / 1e6;
    std::printf("{\"id\": \"copy\", \"impl\": \"kiln\", \"gbps\": %.1f}\n", copy_gbps);
  }
  std::fflush(stdout);
  for (auto& c : chosen) {
    try {
      c.run();
    } catch (const std::exception& e) {
      fail(c.id, "kiln", e.what());
    }
    if (!cfg.cpu) k::synchronize();
  }
  if (failures) std::fprintf(stderr, "sweep: %d failure(s)\n", failures);
  return failures ? 1 : 0;
}
