// The extern step of attention_flash(q [B, H, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, D], scale):
// the fused forward kernel of codegen/attention_kernel.hpp, compiled once per (device, head dim,
// warps, causal, dtype) through the disk cache. Lowering (runtime/lower.hpp) gives an attention
// node to it only where attention_flash_fits says so; everywhere else attention is decomposed.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <numbers>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "../../autodiff/score_mod.hpp"
#include "../../codegen/attention_backward_kernel_sm90.hpp"
#include "../../codegen/attention_kernel.hpp"
#include "../../codegen/attention_kernel_sm90_pingpong.hpp"
#include "../../core/driver.hpp"
#include "../../core/error.hpp"
#include "../../core/tensor.hpp"
#include "../../debug/log.hpp"
#include "../../graph/graph.hpp"
#include "../../graph/infer_attention.hpp"
#include "../compile/cached_cubin.hpp"
#include "../launch/capture_keep.hpp"
#include "../launch/cuda_module.hpp"
#include "../launch/named_function.hpp"
#include "../tune/kept_choices.hpp"
#include "attention_kernels.hpp"

namespace kiln::runtime {

namespace attention_detail {

// A forward kernel, compiled once a device (launch/named_function.hpp).
inline CUfunction function(const codegen::AttentionKernel& a, int device) {
  return named_function(
      a.name(), [&] { return codegen::attention_forward_kernel_source(a); }, device);
}

// The dynamic looping forward's tile counter (codegen::AttentionKernel::dynamic). A launch adds to
// it exactly once a tile, and the add that takes the last value puts it back to zero
// (attention_kernel_sm90_pingpong.hpp), so a launch leaves the word as it found it and launches
// need no zeroing of their own: one word a stream (launches on two streams never share one,
// launches on one are ordered by it), zeroed once when made. Never freed: a caller's captured graph
// may still point at it (its first launch on a stream must come before the caller captures on it,
// as for any buffer the allocator would have to make). In kiln's own capture (`.cuda_graphs`) the
// word is the graph's (capture_temporary, fresh from the driver) and the graph zeroes it before the
// launch, as a later node of the same graph may reuse it: graphs recorded on kiln's capture stream
// would otherwise share one word, and two of them replayed at once on two streams would take each
// other's tiles.
inline void* tile_counter(int device, CUstream stream, Tensor& captured) {
  if (stream && active_capture_keep() && driver::is_capturing(stream)) {
    captured = capture_temporary(Dims{1}, dtype::i32, Device{Device::Kind::cuda, device}, stream);
    driver::memset_async(captured.data_ptr(), 0, sizeof(int), stream);
    return captured.data_ptr();
  }
  // CU_STREAM_PER_THREAD names a different stream on each thread: its words are a thread's.
  const std::thread::id thread = stream == CU_STREAM_PER_THREAD ? std::this_thread::get_id() : std::thread::id();
  static std::mutex mutex;
  static auto* counters = new std::map<std::tuple<int, CUstream, std::thread::id>, void*>();
  std::lock_guard lock(mutex);
  void*& word = (*counters)[{device, stream, thread}];
  if (!word) {
    void* fresh = driver::allocate(sizeof(int), device, stream);
    driver::memset_async(fresh, 0, sizeof(int), stream);
    word = fresh;
  }
  return word;
}

// A TMA map of a [B, H, T, D] operand for the producer forward's copies (AttentionKernel::tma):
// boxes of 64 columns and `rows` rows, as its tiles' 64-column panels; false where the copy engine
// does not take it.
inline bool tile_map(CUtensorMap& map, const Tensor& t, int rows) {
  const Dims &s = t.shape(), &st = t.strides();
  const std::uint64_t dims[4] = {static_cast<std::uint64_t>(s[3]), static_cast<std::uint64_t>(s[2]),
                                 static_cast<std::uint64_t>(s[1]), static_cast<std::uint64_t>(s[0])};
  const std::uint64_t strides[3] = {static_cast<std::uint64_t>(st[2]) * 2, static_cast<std::uint64_t>(st[1]) * 2,
                                    static_cast<std::uint64_t>(st[0]) * 2};
  const std::uint32_t box[4] = {64, static_cast<std::uint32_t>(rows), 1, 1};
  for (int i = 0; i < 3; ++i)
    if (st[i] < 0) return false;
  return driver::encode_tile_map(map, t.dtype() == dtype::bf16, t.data_ptr(), 4, dims, strides, box);
}

inline void check_contiguous(const Tensor& t, const char* what) {
  if (!t.is_contiguous() || reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 != 0)
    throw error(std::string("attention: the fused backward reads ") + what + " " + t.shape().str() +
                " as a contiguous, 16-byte aligned buffer (lowering copies strided arguments)");
}

// Launches one backward kernel over `blocks` row tiles of `heads` (batch, head) pairs; a score_mod's
// scalars go after `args` (the kernel's last parameter).
inline void launch_part(const codegen::AttentionBackwardKernel& a, int device, std::int64_t rows, std::int64_t heads,
                        std::vector<void*> args, ScoreModCall& mod, CUstream stream, CUtensorMap* maps = nullptr) {
  if (mod.mod) args.push_back(mod.params.data());
  if (a.tma)  // (AttentionBackwardKernel::tma: q's, k's, v's and dO's maps, the kernel's last parameters)
    for (int i = 0; i < 4; ++i) args.push_back(&maps[i]);
  CUfunction f = named_function(
      a.name(), [&] { return codegen::attention_backward_kernel_source(a); }, device);
  driver::make_current(device);
  const std::int64_t most = 65535;
  const unsigned blocks = static_cast<unsigned>((rows + a.block_rows() - 1) / a.block_rows());
  if (blocks == 0 || heads == 0) return;
  launch(f,
         Dim3{blocks, static_cast<unsigned>(std::min(heads, most)), static_cast<unsigned>((heads + most - 1) / most)},
         Dim3{static_cast<unsigned>(a.threads())}, static_cast<unsigned>(a.shared_bytes()), stream, args.data(),
         a.name().c_str());
}

inline void check(const Tensor& t, const char* what) {
  const Dims& s = t.strides();
  bool ok = s.size() == 4 && s[3] == 1;
  for (int i = 0; ok && i < 3; ++i) ok = s[i] % 8 == 0;
  ok = ok && reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0;
  if (!ok)
    throw error(std::string("attention: the fused kernel reads ") + what + " " + t.shape().str() + " with strides " +
                s.str() + "; it needs a contiguous head dim, 16-byte rows and a 16-byte aligned start");
}

}  // namespace attention_detail

// Each query row's log-sum-exp of its scaled, masked scores into out [B, H, Tq] f32, for the fused
// backward: a pass over the keys, where the forward's kernel has not written it (attention_flash).
inline void attention_lse(const Tensor& q, const Tensor& k, double scale, bool causal, Tensor& out, ScoreModCall mod,
                          CUstream stream) {
  const Tensor* ts[] = {&q, &k, &out};
  const char* names[] = {"q", "k", "the log-sum-exp"};
  for (int i = 0; i < 3; ++i) attention_detail::check_contiguous(*ts[i], names[i]);
  codegen::AttentionBackwardKernel a;
  a.part = codegen::AttentionBackwardKernel::Part::stats;
  a.head_dim = static_cast<int>(q.shape()[3]);
  a.causal = causal;
  a.dt = q.dtype();
  if (mod.mod) a.score_mod = mod.mod->source, a.score_mod_tag = mod.mod->tag;
  const Dims& qs = q.shape();
  int BH = static_cast<int>(qs[0] * qs[1]), H = static_cast<int>(qs[1]), G = static_cast<int>(qs[1] / k.shape()[1]),
      Tq = static_cast<int>(qs[2]), Tk = static_cast<int>(k.shape()[2]);
  float scale_log2 = static_cast<float>(scale * std::numbers::log2e), sc = static_cast<float>(scale);
  const void *qp = q.data_ptr(), *kp = k.data_ptr(), *none = nullptr;
  void* sp = out.data_ptr();
  attention_detail::launch_part(a, out.device().index, Tq, BH,
                                {&qp, &kp, &none, &none, &sp, &none, &BH, &H, &G, &Tq, &Tk, &scale_log2, &sc}, mod,
                                stream);
}

// One gradient of attention (part: dq, dk or dv; dk and dv stacked; dk, dv and dq stacked with dq's f32 sums)
// into out, from q, k, v, g (the output's cotangent) and the row statistics [B, H, Tq, 2] (each
// row's log-sum-exp and delta = sum(g * o)); `hopper`: the warpgroup kernels on a device of compute
// capability 9.0 (which dq, dk and dv together need).
inline void attention_grad(codegen::AttentionBackwardKernel::Part part, const Tensor& q, const Tensor& k,
                           const Tensor& v, const Tensor& g, const Tensor& stats, double scale, bool causal,
                           bool hopper, Tensor& out, ScoreModCall mod, CUstream stream, bool autotune = false) {
  using Part = codegen::AttentionBackwardKernel::Part;
  const Tensor* ts[] = {&q, &k, &v, &g, &stats, &out};
  const char* names[] = {"q", "k", "v", "the output's cotangent", "the statistics", "a gradient"};
  for (int i = 0; i < 6; ++i) attention_detail::check_contiguous(*ts[i], names[i]);
  const int device = out.device().index;
  codegen::AttentionBackwardKernel a = attention_backward_kernel_for(
      part, q.shape()[3], causal, hopper && driver::compute_capability(device) == 90, q.dtype(), mod.mod);
  if (part == Part::dqkv && !a.hopper)
    throw error("attention: dq, dk and dv in one kernel run on compute capability 9.0 at head dims 64 and 128, not " +
                a.name() + " on device " + std::to_string(device));
  const Dims &qs = q.shape(), &ks = k.shape();
  int BH = static_cast<int>(qs[0] * qs[1]), BHkv = static_cast<int>(ks[0] * ks[1]), H = static_cast<int>(qs[1]),
      G = static_cast<int>(qs[1] / ks[1]), Tq = static_cast<int>(qs[2]), Tk = static_cast<int>(ks[2]);
  float scale_log2 = static_cast<float>(scale * std::numbers::log2e), sc = static_cast<float>(scale);
  const void *qp = q.data_ptr(), *kp = k.data_ptr(), *vp = v.data_ptr(), *gp = g.data_ptr(), *sp = stats.data_ptr();
  void* op = out.data_ptr();
  // The whole gradient with kernel c (a run writes all of out: the dqkv sums are zeroed first).
  auto run = [&](codegen::AttentionBackwardKernel c) {
    CUtensorMap
        maps[4];  // (TMA: q's, k's, v's and dO's; the block's rows in boxes of its rows, the streamed in theirs)
    if (c.tma) {
      driver::make_current(device);
      const bool dq = part == Part::dq;
      const int query_rows = dq ? c.block_rows() : c.streamed_rows(),
                key_rows = dq ? c.streamed_rows() : c.block_rows();
      c.tma = attention_detail::tile_map(maps[0], q, query_rows) && attention_detail::tile_map(maps[1], k, key_rows) &&
              attention_detail::tile_map(maps[2], v, key_rows) && attention_detail::tile_map(maps[3], g, query_rows);
    }
    const std::size_t slot = out.nbytes() / 5;  // (dqkv) dq's f32 sums, added by every key tile, start at zero
    if (part == Part::dqkv && slot > 0)
      driver::memset_async(static_cast<char*>(out.data_ptr()) + 3 * slot, 0, 2 * slot, stream);
    if (part == Part::dq) {
      attention_detail::launch_part(c, device, Tq, BH,
                                    {&qp, &kp, &vp, &gp, &sp, &op, &BH, &H, &G, &Tq, &Tk, &scale_log2, &sc}, mod,
                                    stream, maps);
    } else {
      attention_detail::launch_part(c, device, Tk, BHkv,
                                    {&qp, &kp, &vp, &gp, &sp, &op, &BHkv, &H, &G, &Tq, &Tk, &scale_log2, &sc}, mod,
                                    stream, maps);
    }
    if (part == Part::dqkv) {  // dq's sums (slots 3 and 4) into slot 2
      const std::string name = codegen::attention_dq_convert_name(q.dtype());
      CUfunction f = named_function(
          name, [&] { return codegen::attention_dq_convert_source(q.dtype()); }, device);
      std::int64_t n = out.numel() / 5;  // (a multiple of 8: D is 64 or 128)
      void* sums = static_cast<char*>(out.data_ptr()) + 3 * slot;
      void* dq = static_cast<char*>(out.data_ptr()) + 2 * slot;
      std::vector<void*> args = {&sums, &dq, &n};
      const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((n / 8 + 255) / 256, 4096));
      if (blocks > 0) launch(f, Dim3{blocks}, Dim3{256}, 0, stream, args.data(), name.c_str());
    }
  };
  // options.autotune: the first call of a problem times Hopper's kernel with cp.async and with TMA
  // copies and keeps the faster for the process (not inside a capture: there the rules' runs, unkept).
  if (autotune && a.hopper && !(stream && driver::is_capturing(stream)) && BH > 0 && Tq > 0 && Tk > 0) {
    std::pair<std::string, std::vector<std::int64_t>> key{a.name(), {device, qs[0], qs[1], qs[2], qs[3], ks[1], ks[2]}};
    static auto* chosen = new KeptChoices<std::pair<std::string, std::vector<std::int64_t>>, bool>();
    if (const bool* tma = chosen->find(key)) {
      a.tma = *tma;
    } else {
      double ms[2];
      for (int t = 0; t < 2; ++t) {
        codegen::AttentionBackwardKernel c = a;
        c.tma = t == 1;
        ms[t] = time_calls_ms([&] { run(c); }, stream);
      }
      debug::log_lazy(debug::Channel::autotune, [&] {
        return "attention backward " + a.name() + " q " + qs.str() + " k " + ks.str() + ": cp.async " +
               std::to_string(ms[0]) + " ms, TMA " + std::to_string(ms[1]) + " ms";
      });
      a.tma = chosen->keep(std::move(key), ms[1] < ms[0]);
    }
  }
  run(a);
}

namespace attention_detail {

// The function of this thread's last forward launch (for tests of the launcher's run-time choices).
inline CUfunction& last_forward() {
  thread_local CUfunction f = nullptr;
  return f;
}

// Launches forward kernel `a` (attention_flash's arguments, checked): out, and lse where given.
inline void launch_forward(codegen::AttentionKernel a, const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                           Tensor& out, Tensor* lse, ScoreModCall& mod, CUstream stream) {
  const int device = out.device().index;
  const Dims &qs = q.shape(), &ks = k.shape();
  const unsigned blocks = static_cast<unsigned>((qs[2] + a.query_rows() - 1) / a.query_rows());
  const std::int64_t heads = qs[0] * qs[1], most = 65535;  // (batch, head) pairs along y, then z
  if (blocks == 0 || heads == 0) return;
  CUtensorMap maps[3];  // (TMA: q's, k's and v's, the kernel's last parameters)
  if (a.tma) {
    driver::make_current(device);
    a.tma =
        tile_map(maps[0], q, a.query_rows()) && tile_map(maps[1], k, a.key_rows) && tile_map(maps[2], v, a.key_rows);
  }
  CUfunction f = function(a, device);
  driver::make_current(device);
  int BH = static_cast<int>(qs[0] * qs[1]), H = static_cast<int>(qs[1]), G = static_cast<int>(qs[1] / ks[1]),
      Tq = static_cast<int>(qs[2]), Tk = static_cast<int>(ks[2]);
  float scale_log2 = static_cast<float>(scale * std::numbers::log2e), sc = static_cast<float>(scale);
  const void *qp = q.data_ptr(), *kp = k.data_ptr(), *vp = v.data_ptr();
  void* op = out.data_ptr();
  void* lp = lse ? lse->data_ptr() : nullptr;
  std::int64_t st[12];
  const Tensor* ts[4] = {&q, &k, &v, &out};
  for (int t = 0; t < 4; ++t)
    for (int i = 0; i < 3; ++i) st[3 * t + i] = ts[t]->strides()[i];
  std::vector<void*> args = {&qp,    &kp,         &vp,    &op,    &BH,     &H,      &G,     &Tq,
                             &Tk,    &scale_log2, &st[0], &st[1], &st[2],  &st[3],  &st[4], &st[5],
                             &st[6], &st[7],      &st[8], &st[9], &st[10], &st[11], &lp};
  if (mod.mod) args.insert(args.end(), {&sc, mod.params.data()});  // the mod's parameters
  // Looping (AttentionKernel::persistent): one block an SM, each taking one query tile a round of the
  // blocks (attention_kernel_sm90_pingpong.hpp's TILE_AT), or dynamic: the next from a counter.
  const Dim3 grid = a.persistent
                        ? Dim3{static_cast<unsigned>(std::min<std::int64_t>(blocks * heads, driver::sm_count(device)))}
                        : Dim3{blocks, static_cast<unsigned>(std::min(heads, most)),
                               static_cast<unsigned>((heads + most - 1) / most)};
  Tensor captured;  // (dynamic inside a capture: the graph's own counter)
  void* cp = nullptr;
  if (a.dynamic) {  // (never with a mod: its parameters would come first)
    cp = tile_counter(device, stream, captured);
    args.push_back(&cp);
  }
  if (a.tma) args.insert(args.end(), {&maps[0], &maps[1], &maps[2]});
  launch(f, grid, Dim3{static_cast<unsigned>(a.threads())}, static_cast<unsigned>(a.shared_bytes()), stream,
         args.data(), a.name().c_str());
  last_forward() = f;
}

// options.autotune on Hopper: the first call of a problem (shapes, strides, dtype, causal, mod, the
// scale's sign) times the forwards fed by a producer warpgroup — two or three consumer warpgroups, a
// query tile a block, looping over a fixed round or taking tiles from a counter, each with cp.async
// or TMA copies — on its own operands, and keeps the fastest for the process. Inside a capture
// nothing is timed and the rules' kernel runs, unkept. Returns the kernel to launch.
inline codegen::AttentionKernel tuned_forward(const codegen::AttentionKernel& rules, const Tensor& q, const Tensor& k,
                                              const Tensor& v, double scale, Tensor& out, Tensor* lse,
                                              ScoreModCall& mod, CUstream stream) {
  if (stream && driver::is_capturing(stream)) return rules;
  // (the key: the rules' kernel, which names the dtype, causal, the mod and the scale's sign; then the
  // device, whether lse is written, and every operand's sizes and strides)
  std::pair<std::string, std::vector<std::int64_t>> key{rules.name(), {out.device().index, lse != nullptr}};
  for (const Tensor* t : {&q, &k, &v, static_cast<const Tensor*>(&out)})
    for (int i = 0; i < 4; ++i) key.second.insert(key.second.end(), {t->shape()[i], t->strides()[i]});
  static auto* chosen = new KeptChoices<std::pair<std::string, std::vector<std::int64_t>>, codegen::AttentionKernel>();
  if (const codegen::AttentionKernel* kept = chosen->find(key)) return *kept;
  std::vector<codegen::AttentionKernel> candidates = {rules};
  for (int hopper : {6, 5, 4, 3})
    for (bool tma : {false, true}) {
      codegen::AttentionKernel c =
          attention_kernel_for(q.shape()[3], rules.warps, rules.row_tiles, hopper, rules.causal, rules.dt, mod.mod);
      c.raw_max = rules.raw_max;
      c.tma = tma && c.producer;
      if (std::none_of(candidates.begin(), candidates.end(),
                       [&](const codegen::AttentionKernel& d) { return d.name() == c.name(); }))
        candidates.push_back(c);
    }
  codegen::AttentionKernel best = rules;
  double best_ms = 0, rules_ms = 0;
  for (const codegen::AttentionKernel& c : candidates) {
    const double ms = time_calls_ms([&] { launch_forward(c, q, k, v, scale, out, lse, mod, stream); }, stream);
    if (&c == &candidates.front()) rules_ms = ms;
    if (best_ms > 0 && ms >= best_ms) continue;
    best_ms = ms;
    best = c;
  }
  debug::log_lazy(debug::Channel::autotune, [&] {
    return "attention q " + q.shape().str() + " k " + k.shape().str() + ": " + std::to_string(candidates.size()) +
           " forwards timed, fastest " + best.name() + " " + std::to_string(best_ms) + " ms (the rules' " +
           rules.name() + " " + std::to_string(rules_ms) + " ms)";
  });
  return chosen->keep(std::move(key), best);
}

}  // namespace attention_detail

// out = softmax(q k^T * scale [causal]) v, written by the fused kernel attention_kernel_for picks
// (`hopper`: the warpgroup kernel where it takes the head dim, attention_kernel_for's; under
// `autotune` the fastest of Hopper's producer forwards, attention_detail::tuned_forward); given lse,
// each row's log-sum-exp into it ([B, H, Tq] f32, attention_lse's value).
inline void attention_flash(const Tensor& q, const Tensor& k, const Tensor& v, double scale, bool causal, int warps,
                            int row_tiles, int hopper, Tensor& out, Tensor* lse, ScoreModCall mod, CUstream stream,
                            bool autotune = false) {
  if (!q.device().is_cuda()) throw error("attention: the fused kernel runs on CUDA devices only");
  attention_detail::check(q, "q");
  attention_detail::check(k, "k");
  attention_detail::check(v, "v");
  attention_detail::check(out, "its output");
  if (lse) attention_detail::check_contiguous(*lse, "the log-sum-exp");
  const Dims &qs = q.shape(), &ks = k.shape();
  if (!attention_flash_fits(qs, ks, v.shape(), q.dtype(), 80) || k.dtype() != q.dtype() || v.dtype() != q.dtype())
    throw shape_error("attention: this program runs the fused kernel, which does not take q " + qs.str() + ", k " +
                      ks.str() + ", v " + v.shape().str() + " " + std::string(name(q.dtype())) +
                      " (sizes changed under dynamic shapes): compile it again");
  const int device = out.device().index;
  const bool sm90 = driver::compute_capability(device) == 90;
  codegen::AttentionKernel a =
      attention_kernel_for(qs[3], warps, row_tiles, sm90 ? hopper : 0, causal, q.dtype(), mod.mod);
  a.raw_max = mod.mod || scale > 0;  // (a mod's scores come scaled: softmax_tile scales them by 1)
  // KILN_TUNE_ATTENTION_WAVE=1 (NOTES item 192): where the two-warpgroup kernel's 128-row tiles fit one
  // wave of blocks, each SM's time is one tile's whichever kernel runs, so the shorter tile wins: looping
  // buys nothing in one wave, and the three-warpgroup kernel's 192-row tiles would leave SMs idle.
  static const bool one_wave = Tuning::from_environment().attention_wave == 1;  // an A/B knob: see Tuning
  if (one_wave && a.warpgroups == 3 && (qs[2] + 127) / 128 * qs[0] * qs[1] <= driver::sm_count(device)) {
    const bool raw_max = a.raw_max;
    a = attention_kernel_for(qs[3], warps, row_tiles, 3, causal, q.dtype(), mod.mod);
    a.raw_max = raw_max;
  }
  if (autotune && sm90 && a.warpgroups > 0 && qs[0] * qs[1] * qs[2] > 0)
    a = attention_detail::tuned_forward(a, q, k, v, scale, out, lse, mod, stream);
  attention_detail::launch_forward(a, q, k, v, scale, out, lse, mod, stream);
}

}  // namespace kiln::runtime
