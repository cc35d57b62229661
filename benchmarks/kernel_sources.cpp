// Prints the CUDA kernels kiln's runtime would compile for a function, with static or dynamic
// shapes, on a machine without a GPU: the runtime's own planner (runtime::plan_program, with the
// specialisations of dynamic kernels on the compiling call's sizes, each beside its looped twin),
// not k::export_kernels, which plans dynamic kernels without them and refuses split programs. For
// reading what a device run will launch before spending device time on it (benchmarks/NOTES.md
// item 116 found a modulo by the row count a step this way).
//
// Usage: kernel_sources OP ROWS COLS [DIM] [--bf16] [--dynamic | --rows-dynamic] [--ptxas sm_90] [--call N] [--memory]
//        [--step]
//   --memory: also prints the program's intermediates: their bytes in all, the most live at one step
//   (a plain run's peak of them) and the block a CUDA graph keeps them in (runtime's pack_buffers)
//   --step: gpt2's training step as one program (its value_and_grad called inside, SGD after it)
//   --call N: also says whether the program's guards admit a call with N rows in place of ROWS (a
//   dynamic program that a call at another row count compiles again runs the second program's kernels)
//   --ptxas ARCH: also compiles each kernel's unit with NVRTC for ARCH and prints ptxas's registers, spills and stack
//   --cubin DIR (with --ptxas): also writes each unit's CUBIN to DIR/<unit>.<kernel>[.bounded].cubin, for cuobjdump
//   -sass, and its source to DIR/<unit>.<kernel>.cu
//   --dynamic: every size symbolic (k::shapes::dynamic); --rows-dynamic: only sizes equal to ROWS
//   (with the split sums' chunk lengths: the sizes that change with ROWS), as the automatic mode
//   makes them after a call with another row count
//   OP: colsum (sum over dim 0), softmax (last dim), layer_norm and rms_norm (forward, with a weight
//       and layer_norm's bias), softmax3d (dim 1 of [ROWS, COLS, DIM]),
//       layer_norm_bwd (vjp of layer_norm: dx, dw, db), rms_norm_bwd (dx, dw), cross_entropy (loss and dlogits), block
//       (the vjp of W12's MLP block over [ROWS, COLS], hidden 4 * COLS), gpt2 (examples/gpt2.cpp's
//       value_and_grad with one layer: ROWS tokens in sequences of up to 1024, d COLS, vocab DIM or 50257)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <kiln/kiln.hpp>

namespace k = kiln;

enum class Sizes { static_, dynamic, rows };
std::string ptxas_arch;  // --ptxas ARCH: also compile the unit and print ptxas's report
std::int64_t call_rows = 0;  // --call N: check the guards at N rows
bool memory = false;         // --memory: the intermediates' bytes
bool step = false;           // --step: gpt2's training step as one program (SGD inside)
std::string cubin_dir;       // --cubin DIR: also write each unit's CUBIN there (for cuobjdump -sass)

template <class F, class... T>
void print_kernels(const F& fn, Sizes sizes, std::int64_t rows, const T&... a) {
  auto f = k::compile(fn);
  auto e = f.trace_with(a...);
  std::vector<const k::Tensor*> args{&a...};
  k::graph::Captured cap;
  k::graph::gather(e, cap, true);
  for (int i = 0; i < cap.nt; ++i) args.push_back(cap.tensors[i]);
  auto arg = [&](int slot) -> const k::Tensor& { return *args[static_cast<std::size_t>(slot)]; };
  k::runtime::LoweringStats stats;
  stats.for_gpu = true;                      // a CUDA program from CPU tensors, as export_kernels plans one
  stats.symbolic = sizes != Sizes::static_;  // as the program cache lowers for symbolic sizes
  k::graph::Graph g = k::detail::graph_builder(f.fn(), e, static_cast<int>(sizeof...(T)))(arg, stats);
  const std::vector<std::uint32_t> chunks = k::schedule::chunk_count_dims(g);  // never symbols (ProgramCache::make_env)
  auto symbolic = [&](int n, int d) {
    const bool chunk_length = g[n].op == k::Op::reshape && g[n].attrs.keepdim && d == 1;  // of a padded split
    return !(chunks[n] >> d & 1u) && (sizes == Sizes::dynamic || g[n].shape[d] == rows || chunk_length);
  };
  k::ir::ShapeEnv env = sizes == Sizes::static_ ? k::ir::make_static_shape_env(g) : k::ir::make_shape_env(g, symbolic);
  auto p = k::runtime::plan_program(std::move(g), std::move(env), k::Device(k::cuda), arg, false, stats.tuning);
  std::string body = k::runtime::program_body(*p);
  std::fputs(body.substr(body.find("\n// kiln_") + 1).c_str(), stdout);  // past the size helpers
  if (memory) {
    auto bytes_of = [&](int b) {
      return static_cast<std::size_t>(p->storage_shape(b, p->graph[b].shape).product()) * k::itemsize(p->graph[b].dt);
    };
    std::size_t all = 0;
    for (int b : p->buffers) all += bytes_of(b);
    auto packed = k::runtime::pack_buffers(p->lifetimes, p->graph.nodes.size(), bytes_of);
    std::printf(
        "// intermediates: %zu buffers, %.1f MiB in all, %.1f MiB live at the busiest of %zu steps, %.1f MiB "
        "packed for a CUDA graph\n",
        p->buffers.size(), all / 1048576.0, packed.live_peak / 1048576.0, p->kernels.size(), packed.bytes / 1048576.0);
  }
  if (call_rows > 0) {  // the program's buffers, and the arguments with `rows` leading rows at call_rows
    for (int b : p->buffers)
      std::printf("// buffer %%%d: %s %s\n", b, std::string(k::name(p->graph[b].op)).c_str(),
                  p->graph[b].shape.str().c_str());
    std::printf("// %zu steps\n", p->kernels.size());
    for (const auto& kk : p->kernels) {
      std::printf("// step %s extern %d: %s held [%lld, %lld] x%lld, %zu assumed multiples, index_bound %d, params",
                  kk.src.name.c_str(), kk.extern_node, kk.src.config.str().c_str(), (long long)kk.src.held_min,
                  (long long)kk.src.held_max, (long long)kk.src.held_multiple, kk.src.assumed_multiples.size(),
                  (int)kk.src.index_bound);
      for (const auto& prm : kk.src.params) std::printf(" %d:%d", (int)prm.kind, prm.ref);
      std::printf(" xnumel %s rnumel %s\n", kk.src.xnumel.str().c_str(), kk.src.rnumel.str().c_str());
    }
    std::vector<k::Tensor> other;
    for (const k::Tensor* t : args) {
      k::Dims s = t->shape();
      if (s.size() && s[0] == rows) s[0] = call_rows;
      other.push_back(k::Tensor::empty(s, t->dtype(), k::cpu));
    }
    k::graph::Graph h = p->graph;
    k::graph::infer_shapes(h, [&](int slot) -> const k::Tensor& { return other[static_cast<std::size_t>(slot)]; });
    std::vector<const k::Tensor*> ptrs;
    for (const auto& t : other) ptrs.push_back(&t);
    ptrs.resize(static_cast<std::size_t>(h.num_args));
    k::guards::GuardSet gs = k::guards::make_guards(p->graph, p->env, ptrs, {});
    std::vector<std::int64_t> symbols(static_cast<std::size_t>(p->env.num_symbols()) + 1);
    int bad = k::guards::check_shapes(
        gs, [&](int n) -> const k::Dims& { return h[n].shape; }, symbols.data(), p->env.num_symbols());
    if (bad < 0)
      std::printf("// a call at %lld rows: the guards hold\n", static_cast<long long>(call_rows));
    else
      std::printf("// a call at %lld rows fails the guard of node %%%d: %s, now %s\n",
                  static_cast<long long>(call_rows), bad,
                  (std::string(k::name(p->graph[bad].op)) + k::graph::attrs_str(p->graph[bad]) + " " +
                   p->graph[bad].shape.str())
                      .c_str(),
                  h[bad].shape.str().c_str());
  }
  if (ptxas_arch.empty()) return;
  // NVRTC on each kernel's unit, as the runtime compiles them (a specialised kernel and its twins
  // share a name: one unit each), with ptxas's register and spill report.
  std::vector<const k::codegen::KernelSource*> kernels;
  for (const auto& kk : p->kernels)
    if (kk.extern_node < 0)
      k::runtime::each_twin(kk, [&](const k::runtime::CompiledKernel& t) { kernels.push_back(&t.src); });
  // A unit with held-row bounds also as the runtime compiles it (runtime/compile/nvrtc.hpp's
  // compile_cubin: the bound it took, KILN_HELD_BOUND, and ptxas's report at that bound).
  for (std::size_t unit = 0; unit < kernels.size(); ++unit) {
    const k::codegen::KernelSource* ks = kernels[unit];
    k::runtime::KernelUnit u = k::runtime::kernel_unit(*ks, false);
    int bound = 0;
    if (!k::runtime::detail::held_bounds(u.source).empty()) {
      k::runtime::compile_cubin(u.source, u.name, ptxas_arch, {}, &bound);
      std::printf("// %s: the runtime's compile took %s\n", ks->name.c_str(),
                  bound == 0 ? "no held bound"
                  : bound == k::runtime::detail::own_bounds
                      ? "the kernel's own held bound"
                      : ("a held bound of " + std::to_string(bound) + " blocks").c_str());
    }
    for (int bounded = 0; bounded <= int(bound != 0); ++bounded) {
      std::vector<std::string> extra = k::runtime::ptxas_report_options();
      if (bounded) extra.push_back("-DKILN_HELD_BOUND=" + std::to_string(bound));
      std::vector<std::string> options = k::runtime::nvrtc_options(ptxas_arch, extra);
      std::vector<const char*> argv;
      for (const std::string& o : options) argv.push_back(o.c_str());
      k::runtime::detail::Program program(u.source, (u.name + ".cu").c_str());
      nvrtcResult r = nvrtcCompileProgram(program.get(), static_cast<int>(argv.size()), argv.data());
      std::printf("// NVRTC %s, %s%s (%s):\n%s\n", ptxas_arch.c_str(), ks->name.c_str(),
                  bounded ? ", held bound on" : "", r == NVRTC_SUCCESS ? "compiled" : "FAILED", program.log().c_str());
      std::size_t size = 0;
      if (!cubin_dir.empty() && r == NVRTC_SUCCESS && nvrtcGetCUBINSize(program.get(), &size) == NVRTC_SUCCESS) {
        std::vector<char> bin(size);
        nvrtcGetCUBIN(program.get(), bin.data());
        const std::string path =
            cubin_dir + "/" + std::to_string(unit) + "." + ks->name + (bounded ? ".bounded" : "") + ".cubin";
        auto write = [](const std::string& to, const char* data, std::size_t n) {
          if (std::FILE* f = std::fopen(to.c_str(), "wb")) {
            std::fwrite(data, 1, n, f);
            std::fclose(f);
          }
        };
        write(path, bin.data(), bin.size());
        if (!bounded) write(path.substr(0, path.size() - 6) + ".cu", u.source.data(), u.source.size());
      }
    }
  }
}

int main(int argc, char** argv) {
  std::vector<std::string> pos;
  bool bf16 = false;
  Sizes sizes = Sizes::static_;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--bf16")
      bf16 = true;
    else if (s == "--dynamic")
      sizes = Sizes::dynamic;
    else if (s == "--rows-dynamic")
      sizes = Sizes::rows;
    else if (s == "--ptxas" && i + 1 < argc)
      ptxas_arch = argv[++i];
    else if (s == "--cubin" && i + 1 < argc)
      cubin_dir = argv[++i];
    else if (s == "--memory")
      memory = true;
    else if (s == "--step")
      step = true;
    else if (s == "--call" && i + 1 < argc)
      call_rows = std::atoll(argv[++i]);
    else
      pos.push_back(s);
  }
  if (pos.size() < 3) {
    std::fprintf(
        stderr,
        "usage: %s OP ROWS COLS [DIM] [--bf16] [--dynamic | --rows-dynamic] [--ptxas ARCH]\n"
        "OP: colsum, softmax, layer_norm, rms_norm, softmax3d, layer_norm_bwd, rms_norm_bwd, cross_entropy, block, "
        "gpt2\n",
        argv[0]);
    return 2;
  }
  const std::string op = pos[0];
  const std::int64_t rows = std::atoll(pos[1].c_str()), cols = std::atoll(pos[2].c_str());
  const k::dtype dt = bf16 ? k::bf16 : k::f32;
  auto randn = [&](k::Dims shape) { return k::Tensor(k::cast(k::randn(shape), dt)); };
  try {
    if (op == "colsum") {
      print_kernels([](auto x) { return k::sum(x, 0); }, sizes, rows, randn({rows, cols}));
    } else if (op == "softmax") {
      print_kernels([](auto x) { return k::softmax(x, -1); }, sizes, rows, randn({rows, cols}));
    } else if (op == "layer_norm") {
      print_kernels([](auto x, auto w, auto b) { return k::layer_norm(x, w, b); }, sizes, rows, randn({rows, cols}),
                    randn({cols}), randn({cols}));
    } else if (op == "rms_norm") {
      print_kernels([](auto x, auto w) { return k::rms_norm(x, w, 1e-6); }, sizes, rows, randn({rows, cols}),
                    randn({cols}));
    } else if (op == "softmax3d" && pos.size() >= 4) {
      print_kernels([](auto x) { return k::softmax(x, 1); }, sizes, rows,
                    randn({rows, cols, std::atoll(pos[3].c_str())}));
    } else if (op == "layer_norm_bwd") {
      auto f = k::vjp([](auto x, auto w, auto b) { return k::layer_norm(x, w, b); }, k::wrt<0, 1, 2>);
      print_kernels(f, sizes, rows, randn({rows, cols}), randn({cols}), randn({cols}), randn({rows, cols}));
    } else if (op == "rms_norm_bwd") {
      auto f = k::vjp([](auto x, auto w) { return k::rms_norm(x, w, 1e-6); }, k::wrt<0, 1>);
      print_kernels(f, sizes, rows, randn({rows, cols}), randn({cols}), randn({rows, cols}));
    } else if (op == "block") {  // W12's block: vjp of layer_norm(x + linear(gelu(linear(x, w1, b1)), w2, b2))
      auto block = [](auto x, auto w1, auto b1, auto w2, auto b2, auto g, auto be) {
        return k::layer_norm(x + k::linear(k::gelu(k::linear(x, w1, b1)), w2, b2), g, be);
      };
      auto f = k::vjp(block, k::wrt<0, 1, 2, 3, 4, 5, 6>);
      print_kernels(f, sizes, rows, randn({rows, cols}), randn({4 * cols, cols}), randn({4 * cols}),
                    randn({cols, 4 * cols}), randn({cols}), randn({cols}), randn({cols}), randn({rows, cols}));
    } else if (op == "gpt2") {  // examples/gpt2.cpp's loss with one layer: ROWS tokens (T 1024), d COLS, vocab DIM
      const std::int64_t T = std::min<std::int64_t>(rows, 1024), B = rows / T, d = cols, H = d / 64;
      const std::int64_t V = pos.size() >= 4 ? std::atoll(pos[3].c_str()) : 50257;
      auto loss = [=](auto x, auto ln1w, auto ln1b, auto qkvw, auto qkvb, auto projw, auto projb, auto ln2w, auto ln2b,
                      auto fcw, auto fcb, auto fc2w, auto fc2b, auto lnfw, auto lnfb, auto wte, auto targets) {
        auto w = [](auto t) { return k::cast(t, k::bf16); };
        auto h = k::reshape(w(k::layer_norm(x, ln1w, ln1b)), {B * T, d});
        auto qkv = k::matmul(h, w(qkvw)) + w(qkvb);
        auto heads = [&](std::int64_t part) {
          return k::permute(k::reshape(k::slice(qkv, 1, part * d, (part + 1) * d), {B, T, H, 64}), {0, 2, 1, 3});
        };
        auto y = k::attention(heads(0), heads(1), heads(2), {.causal = true});
        auto merged = k::reshape(k::permute(y, {0, 2, 1, 3}), {B * T, d});
        auto x1 = x + k::reshape(k::cast(k::matmul(merged, w(projw)) + w(projb), k::f32), {B, T, d});
        auto h2 = k::reshape(w(k::layer_norm(x1, ln2w, ln2b)), {B * T, d});
        auto m = k::gelu(k::matmul(h2, w(fcw)) + w(fcb), k::approximate::tanh);
        auto x2 = x1 + k::reshape(k::cast(k::matmul(m, w(fc2w)) + w(fc2b), k::f32), {B, T, d});
        auto hf = k::reshape(w(k::layer_norm(x2, lnfw, lnfb)), {B * T, d});
        auto logits = k::cast(k::matmul(hf, k::transpose(w(wte), 0, 1)), k::f32);
        return k::cross_entropy(logits, k::reshape(targets, {B * T}));
      };
      auto f = k::value_and_grad(loss, k::wrt<0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15>);
      auto f32 = [](k::Dims shape) { return k::randn(shape); };
      k::Tensor t = k::cast(k::rand({B, T}) * static_cast<float>(V - 1), k::i64);
      // --step: the training step as one program, SGD on the layer's parameters after the value_and_grad
      // (examples/gpt2.cpp's step, AdamW there).
      auto sgd_step = [f](auto x, auto... p) {
        auto r = f(x, p...);
        auto update = [&]<std::size_t... I>(std::index_sequence<I...>) {
          auto params = std::forward_as_tuple(p...);
          return std::make_tuple(std::get<0>(r),
                                 k::assign(std::get<I>(params), std::get<I>(params) - 1e-3f * std::get<I + 2>(r))...);
        };
        return update(std::make_index_sequence<sizeof...(p) - 1>{});  // (the targets have no update)
      };
      auto run = [&](const auto& fn) {
        print_kernels(fn, sizes, rows, f32({B, T, d}), f32({d}), f32({d}), f32({d, 3 * d}), f32({3 * d}), f32({d, d}),
                      f32({d}), f32({d}), f32({d}), f32({d, 4 * d}), f32({4 * d}), f32({4 * d, d}), f32({d}), f32({d}),
                      f32({d}), f32({V, d}), t);
      };
      if (step)
        run(sgd_step);
      else
        run(f);
    } else if (op == "cross_entropy") {
      auto f = k::value_and_grad([](auto l, auto t) { return k::cross_entropy(l, t); }, k::wrt<0>);
      k::Tensor t = k::cast(k::rand({rows}) * static_cast<float>(cols - 1), k::i64);
      print_kernels(f, sizes, rows, randn({rows, cols}), t);
    } else {
      std::fprintf(stderr, "%s: unknown op or missing DIM: %s\n", argv[0], op.c_str());
      return 2;
    }
  } catch (const k::error& e) {
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    return 1;
  }
}
