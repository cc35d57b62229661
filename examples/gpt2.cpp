// GPT-2 written in kiln and trained on deterministic synthetic tokens: token and position
// embeddings (the token table tied to the output layer), pre-norm blocks of causal multi-head
// attention and a tanh-gelu MLP, a final layer_norm and cross_entropy; AdamW. The ~150 parameters
// and their moments travel as three std::vector<k::Tensor> arguments; a training step is one
// compiled program: a k::value_and_grad called inside it gives the loss and every gradient, and the
// AdamW update of every parameter and moment reads them there (--two-programs: the gradients as
// outputs of a k::value_and_grad program, then an AdamW program, as a data-parallel run does
// with the all-reduce between). Blocks are built in a loop through k::expression.
//
//   gpt2 [--tiny] [--steps N] [--cpu] [--f32] [--graphs] [--two-programs] [--gpus N] [--check DIR]
// --tiny: a small config that trains on the CPU in seconds (CI runs it); the default is GPT-2 small
// (12 layers, d 768, 12 heads, context 1024, vocab 50257) at B = 8, on the GPU, bf16 activations
// over f32 master weights. --graphs replays the programs as CUDA graphs (.cuda_graphs). Prints
// `step N loss X` and, at the end, tokens/s and peak memory. --check DIR starts from the weights
// that `benchmarks/gpt2_peer.py --write-check DIR` wrote (DIR/init.safetensors) and compares the
// first 10 losses with PyTorch's (DIR/losses.txt) to bf16 tolerance. --gpus N trains data-parallel
// on N local GPUs (k::dist::spawn, one thread a GPU; k::dist::data_parallel averages the gradients
// over NCCL, overlapping the backward): each rank takes its own batch of B sequences, so tokens/s
// counts N * B * T a step.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <kiln/distributed.hpp>
#include <kiln/kiln.hpp>

namespace k = kiln;

namespace {

struct Config {
  std::int64_t layers = 12, d = 768, heads = 12, context = 1024, vocab = 50257, batch = 8;
};

// Parameter order: wte, wpe, then per layer 12 tensors (ln1 w/b, qkv w/b, proj w/b, ln2 w/b,
// fc w/b, fc2 w/b), then the final layer_norm's w/b. Linear weights are [in, out].
constexpr int per_layer = 12;

// The parameters' names, in order (benchmarks/gpt2_peer.py writes the same names).
std::vector<std::string> param_names(const Config& c) {
  std::vector<std::string> names = {"wte", "wpe"};
  for (std::int64_t l = 0; l < c.layers; ++l)
    for (const char* n :
         {"ln1.w", "ln1.b", "qkv.w", "qkv.b", "proj.w", "proj.b", "ln2.w", "ln2.b", "fc.w", "fc.b", "fc2.w", "fc2.b"})
      names.push_back("h." + std::to_string(l) + "." + n);
  names.push_back("lnf.w");
  names.push_back("lnf.b");
  return names;
}

// The weights a check starts from, checked against the shapes this config gives.
std::vector<k::Tensor> load_params(const Config& c, k::Device dev, const std::string& file,
                                   const std::vector<k::Tensor>& like) {
  std::map<std::string, k::Tensor> loaded = k::load(file, dev);
  std::vector<k::Tensor> p;
  const auto names = param_names(c);
  for (std::size_t i = 0; i < names.size(); ++i) {
    auto it = loaded.find(names[i]);
    if (it == loaded.end()) throw k::error("gpt2 --check: " + file + " has no tensor " + names[i]);
    if (!(it->second.shape() == like[i].shape()))
      throw k::shape_error("gpt2 --check: " + names[i] + " is " + it->second.shape().str() + ", expected " +
                           like[i].shape().str());
    p.push_back(it->second.to(k::f32));
  }
  return p;
}

std::vector<k::Tensor> init_params(const Config& c, k::Device dev) {
  std::vector<k::Tensor> p;
  unsigned seed = 1;
  auto normal = [&](k::Dims shape, float std) { return k::Tensor(k::randn(shape, k::f32, dev, seed++) * std); };
  const float proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(c.layers));  // GPT-2's scaled init
  p.push_back(normal({c.vocab, c.d}, 0.02f));
  p.push_back(normal({c.context, c.d}, 0.01f));
  for (std::int64_t l = 0; l < c.layers; ++l) {
    p.push_back(k::ones({c.d}, k::f32, dev));
    p.push_back(k::zeros({c.d}, k::f32, dev));
    p.push_back(normal({c.d, 3 * c.d}, 0.02f));
    p.push_back(k::zeros({3 * c.d}, k::f32, dev));
    p.push_back(normal({c.d, c.d}, proj_std));
    p.push_back(k::zeros({c.d}, k::f32, dev));
    p.push_back(k::ones({c.d}, k::f32, dev));
    p.push_back(k::zeros({c.d}, k::f32, dev));
    p.push_back(normal({c.d, 4 * c.d}, 0.02f));
    p.push_back(k::zeros({4 * c.d}, k::f32, dev));
    p.push_back(normal({4 * c.d, c.d}, proj_std));
    p.push_back(k::zeros({c.d}, k::f32, dev));
  }
  p.push_back(k::ones({c.d}, k::f32, dev));
  p.push_back(k::zeros({c.d}, k::f32, dev));
  return p;
}

// The mean next-token loss of tokens [B, T] against targets [B, T]. Weights are read in `act`
// (bf16 on the GPU: activations and GEMMs in bf16 over f32 master weights), norms and the loss in f32.
auto make_loss(Config c, k::dtype act) {
  return [c, act](auto p, auto tokens, auto targets) {
    const std::int64_t B = c.batch, T = c.context, d = c.d, H = c.heads, hd = c.d / c.heads;
    auto w = [act](auto t) { return k::cast(t, act); };
    k::expression x = k::embedding(p[0], tokens) + p[1];  // [B, T, d], f32 residual stream
    for (std::int64_t l = 0; l < c.layers; ++l) {
      const std::size_t at = 2 + static_cast<std::size_t>(l) * per_layer;
      auto h = k::reshape(w(k::layer_norm(x, p[at], p[at + 1])), {B * T, d});
      k::expression qkv = k::matmul(h, w(p[at + 2])) + w(p[at + 3]);  // [B*T, 3d]
      auto heads = [&](std::int64_t part) {
        return k::permute(k::reshape(k::slice(qkv, 1, part * d, (part + 1) * d), {B, T, H, hd}), {0, 2, 1, 3});
      };
      auto y = k::attention(heads(0), heads(1), heads(2), {.causal = true});  // [B, H, T, hd]
      auto merged = k::reshape(k::permute(y, {0, 2, 1, 3}), {B * T, d});
      x = x + k::reshape(k::cast(k::matmul(merged, w(p[at + 4])) + w(p[at + 5]), k::f32), {B, T, d});
      auto h2 = k::reshape(w(k::layer_norm(x, p[at + 6], p[at + 7])), {B * T, d});
      auto m = k::gelu(k::matmul(h2, w(p[at + 8])) + w(p[at + 9]), k::approximate::tanh);
      x = x + k::reshape(k::cast(k::matmul(m, w(p[at + 10])) + w(p[at + 11]), k::f32), {B, T, d});
    }
    const std::size_t f = 2 + static_cast<std::size_t>(c.layers) * per_layer;
    auto hf = k::reshape(w(k::layer_norm(x, p[f], p[f + 1])), {B * T, d});
    auto logits = k::cast(k::matmul(hf, k::transpose(w(p[0]), 0, 1)), k::f32);  // tied embeddings
    return k::expression(k::cross_entropy(logits, k::reshape(targets, {B * T})));
  };
}

// AdamW (decoupled weight decay on matrices only), one in-place update of every p, m, v.
auto make_adamw(float lr, float wd) {
  return [lr, wd](auto p, auto g, auto m, auto v, auto step_scale) {
    auto update = [&](std::size_t i, float decay) {
      auto m1 = m[i] * 0.9f + g[i] * 0.1f;
      auto v1 = v[i] * 0.95f + k::square(g[i]) * 0.05f;
      // step_scale holds lr * sqrt(1 - beta2^t) / (1 - beta1^t), a run-time tensor: one program for all steps.
      return std::tuple{k::assign(m[i], m1), k::assign(v[i], v1),
                        k::assign(p[i], p[i] * (1.0f - lr * decay) - step_scale * m1 / (k::sqrt(v1) + 1e-8f))};
    };
    std::vector<decltype(update(0, 0.0f))> updates;
    for (std::size_t i = 0; i < p.size(); ++i) updates.push_back(update(i, p[i].t->dim() >= 2 ? wd : 0.0f));
    return updates;
  };
}

// Deterministic tokens: a repeated pseudo-random sequence (period 3 * context / 4), so the model
// can learn to continue it; targets are the next tokens.
// Rank r of a data-parallel run starts its sequences r * B * (T + 1) further on.
void make_batch(const Config& c, k::Device dev, k::Tensor& tokens, k::Tensor& targets, int rank = 0) {
  const std::int64_t period = std::max<std::int64_t>(3 * c.context / 4, 2);
  std::vector<std::int64_t> seq(static_cast<std::size_t>(c.batch * (c.context + 1)));
  const std::size_t shift = static_cast<std::size_t>(rank) * seq.size();
  for (std::size_t i = 0; i < seq.size(); ++i) {
    const std::uint64_t pos = (i + shift) % static_cast<std::uint64_t>(period);
    seq[i] = static_cast<std::int64_t>((pos * 2654435761u + 12345u) % static_cast<std::uint64_t>(c.vocab));
  }
  std::vector<std::int64_t> in, out;
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t t = 0; t < c.context; ++t) {
      in.push_back(seq[static_cast<std::size_t>(b * (c.context + 1) + t)]);
      out.push_back(seq[static_cast<std::size_t>(b * (c.context + 1) + t + 1)]);
    }
  tokens = k::from_vector(in, {c.batch, c.context}, dev);
  targets = k::from_vector(out, {c.batch, c.context}, dev);
}

struct Args {
  int steps = 20, gpus = 0;
  bool tiny = false, want_cpu = false, want_f32 = false, graphs = false, two_programs = false;
  std::string check;
};

// Trains on `dev`; with a group, as one rank of a data-parallel run (rank 0 prints). Returns the exit code.
int train(const Config& c, Args a, k::Device dev, k::dist::group* g) {
  const bool lead = !g || g->rank() == 0;
  const int ranks = g ? g->world_size() : 1;
  auto say = [&](auto... xs) {
    if (lead) std::printf(xs...), std::fflush(stdout);
  };
  const k::dtype act = dev.is_cuda() && !a.want_f32 ? k::bf16 : k::f32;
  say("gpt2: %lld layers, d %lld, %lld heads, context %lld, vocab %lld, batch %lld on %s x %d, %s activations\n",
      static_cast<long long>(c.layers), static_cast<long long>(c.d), static_cast<long long>(c.heads),
      static_cast<long long>(c.context), static_cast<long long>(c.vocab), static_cast<long long>(c.batch),
      dev.str().c_str(), ranks, std::string(k::name(act)).c_str());

  std::vector<k::Tensor> params = init_params(c, dev), m, v;
  if (!a.check.empty()) {
    params = load_params(c, dev, a.check + "/init.safetensors", params);
    a.steps = std::max(a.steps, 10);
  }
  for (auto& p : params) m.push_back(k::zeros(p.shape(), k::f32, dev)), v.push_back(k::zeros(p.shape(), k::f32, dev));
  std::int64_t count = 0;
  for (auto& p : params) count += p.numel();
  say("parameters: %zu tensors, %lld values\n", params.size(), static_cast<long long>(count));

  k::Tensor tokens, targets;
  make_batch(c, dev, tokens, targets, g ? g->rank() : 0);
  const k::options opts{.cuda_graphs = a.graphs};
  const float lr = a.tiny ? 1e-2f : 6e-4f;
  auto adamw = k::compile(make_adamw(lr, 0.1f), opts);

  double first = 0, last = 0, first_call_s = 0;
  std::vector<double> step_s, losses;
  // step_once(scale): one training step, gradient and update; returns the loss.
  auto loop = [&](auto&& step_once) -> int {
    for (int s = 1; s <= a.steps; ++s) {
      auto t0 = std::chrono::steady_clock::now();
      const double b1 = 1 - std::pow(0.9, s), b2 = 1 - std::pow(0.95, s);
      const k::Tensor scale = k::full({}, lr * std::sqrt(b2) / b1, k::f32, dev);
      const k::Tensor loss = step_once(scale);
      last = k::to_vector<float>(loss)[0];  // waits for the step
      const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s == 1) first_call_s = took;
      if (s > 2) step_s.push_back(took);
      if (s == 1) first = last;
      losses.push_back(last);
      say("step %d loss %.4f\n", s, last);
      if (s == 2 && lead) k::runtime::profile::Table::instance().reset();  // KILN_PROFILE: steady steps only
      if (!std::isfinite(last)) return 1;
    }
    return 0;
  };
  auto grad_fn = k::value_and_grad(make_loss(c, act), k::wrt<0>);
  auto library_calls = [](const k::report& r) {
    return static_cast<long long>(std::count_if(r.kernels.begin(), r.kernels.end(),
                                                [](const k::kernel_info& kern) { return kern.kind == "extern"; }));
  };
  const k::Tensor lr_now = k::full({}, lr, k::f32, dev);
  if (g) {
    auto step = k::dist::data_parallel(grad_fn, *g, {}, opts);
    if (int rc = loop([&](const k::Tensor& scale) {
          auto [loss, grads] = step(params, tokens, targets);
          adamw(params, grads, m, v, scale);
          return loss;
        }))
      return rc;
    say("data-parallel: %d ranks, gradients overlapping the backward: %s\n", ranks, step.overlapping() ? "yes" : "no");
  } else if (a.two_programs) {
    auto step = k::compile(grad_fn, opts);
    if (int rc = loop([&](const k::Tensor& scale) {
          auto [loss, grads] = step(params, tokens, targets);
          adamw(params, grads, m, v, scale);
          return loss;
        }))
      return rc;
    // The step's kernels as k::explain lists them (one more step and update, after the timed
    // ones), against the launches a step that benchmarks/gpt2_peer.py --profile counts for
    // torch.compile, its fused optimizer among them.
    const k::report r = k::explain(step, params, tokens, targets);
    const auto last_step = step(params, tokens, targets);
    const k::report u = k::explain(adamw, params, std::get<1>(last_step), m, v, lr_now);
    const std::size_t kernels = r.kernels.size() + u.kernels.size();
    say("kernels a step: %zu, %zu in the value_and_grad program (%lld of them library calls) and %zu in the AdamW "
        "update; %.1f a layer with the embedding, head, loss and update counted in\n",
        kernels, r.kernels.size(), library_calls(r), u.kernels.size(),
        static_cast<double>(kernels) / static_cast<double>(c.layers));
  } else {
    // The whole step as one program: the gradients are intermediates that the update reads where
    // they are made (a k::value_and_grad called inside a compiled function).
    auto step = k::compile(
        [grad_fn, update = make_adamw(lr, 0.1f)](auto p, auto m, auto v, auto tokens, auto targets, auto scale) {
          auto [loss, grads] = grad_fn(p, tokens, targets);
          return std::make_tuple(loss, update(p, grads, m, v, scale));
        },
        opts);
    if (int rc = loop([&](const k::Tensor& scale) { return step(params, m, v, tokens, targets, scale)[0]; })) return rc;
    const k::report r = k::explain(step, params, m, v, tokens, targets, lr_now);
    say("kernels a step: %zu in one program (%lld of them library calls); %.1f a layer with the embedding, head, "
        "loss and update counted in\n",
        r.kernels.size(), library_calls(r), static_cast<double>(r.kernels.size()) / static_cast<double>(c.layers));
  }
  say("first step (compiles): %.1f s\n", first_call_s);
  if (!step_s.empty()) {  // the median step of steps 3..N, as benchmarks/gpt2_peer.py times torch
    std::sort(step_s.begin(), step_s.end());
    const double median = step_s[step_s.size() / 2];
    say("tokens/s: %.0f (median step %.1f ms of steps 3..%d, %d rank%s)\n",
        static_cast<double>(ranks * c.batch * c.context) / median, median * 1e3, a.steps, ranks, ranks == 1 ? "" : "s");
  }
  auto mem = k::memory_stats(dev);
  say("peak memory: %.1f MiB\n", static_cast<double>(mem.peak) / (1 << 20));
  say("loss: first %.4f last %.4f (%.2fx)\n", first, last, last / first);
  if (!a.check.empty()) {  // PyTorch's first 10 losses from the same weights, to bf16 tolerance
    std::ifstream in(a.check + "/losses.txt");
    double worst = 0;
    int n = 0;
    for (double want; n < 10 && in >> want; ++n) {
      const double rel = std::abs(losses[static_cast<std::size_t>(n)] - want) / std::abs(want);
      say("check step %d: kiln %.4f torch %.4f (%.2e)\n", n + 1, losses[static_cast<std::size_t>(n)], want, rel);
      worst = std::max(worst, rel);
    }
    const double tol = act == k::f32 ? 1e-3 : 2e-2;
    say("check: %d losses, worst relative difference %.2e (tolerance %.0e): %s\n", n, worst, tol,
        n == 10 && worst <= tol ? "ok" : "FAILED");
    if (n != 10 || worst > tol) return 4;
  }
  if (a.tiny && a.steps >= 20 && !(last < 0.7 * first)) {  // CI's check that training works
    std::fprintf(stderr, "gpt2 --tiny: the loss did not fall below 0.7x the first\n");
    return 3;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--tiny")
      a.tiny = true;
    else if (s == "--cpu")
      a.want_cpu = true;
    else if (s == "--f32")
      a.want_f32 = true;
    else if (s == "--graphs")
      a.graphs = true;
    else if (s == "--two-programs")
      a.two_programs = true;
    else if (s == "--check" && i + 1 < argc)
      a.check = argv[++i];
    else if (s == "--steps" && i + 1 < argc)
      a.steps = std::atoi(argv[++i]);
    else if (s == "--gpus" && i + 1 < argc)
      a.gpus = std::atoi(argv[++i]);
    else {
      std::fprintf(
          stderr,
          "usage: gpt2 [--tiny] [--steps N] [--cpu] [--f32] [--graphs] [--two-programs] [--gpus N] [--check DIR]\n");
      return 2;
    }
  }
  Config c;
  if (a.tiny) c = Config{2, 32, 2, 32, 97, 4};
  const bool gpu = !a.want_cpu && k::driver::available();
  if (a.gpus < 1) return train(c, a, gpu ? k::Device(k::cuda) : k::Device(k::cpu), nullptr);
  if (!gpu || a.gpus > k::driver::device_count() || !a.check.empty()) {
    std::fprintf(stderr, "gpt2 --gpus %d: needs that many GPUs (this machine has %d) and no --cpu or --check\n", a.gpus,
                 gpu ? k::driver::device_count() : 0);
    return 2;
  }
  std::vector<int> rc(static_cast<std::size_t>(a.gpus), 0);
  k::dist::spawn(a.gpus, [&](k::dist::group& g) { rc[static_cast<std::size_t>(g.rank())] = train(c, a, g.device(), &g); });
  return *std::max_element(rc.begin(), rc.end());
}
