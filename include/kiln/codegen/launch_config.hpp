// Block sizes of a kernel for one target: how many elements a program owns (pointwise), how
// many threads share a row and how many rows a program takes (reductions). Chosen from sizes and
// dtypes with simple rules; autotuning may override them.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <string>

namespace kiln::codegen {

enum class Target { cpu, cuda };

struct LaunchConfig {
  int threads = 1;       // CUDA threads per program (block)
  int xvec = 16;         // pointwise: consecutive elements per thread-tile
  std::int64_t xblock = 4096;  // pointwise: elements per program
  int rvec = 16;         // rows: consecutive elements per thread-tile along the row
  int row_threads = 1;   // rows: threads sharing one row
  int rows = 1;          // rows: rows per program
  int riters = 0;        // rows: tiles per thread along a row when known (the row is then kept in
                         // registers across loops: the "per" kind); 0 = looped ("red")
  int runroll = 1;       // looped rows: steps of the row loop unrolled together

  std::string str() const {
    return "threads=" + std::to_string(threads) + " XVEC=" + std::to_string(xvec) + " XBLOCK=" + std::to_string(xblock) +
           " RVEC=" + std::to_string(rvec) + " ROW_THREADS=" + std::to_string(row_threads) + " ROWS=" + std::to_string(rows) +
           (riters ? " RITERS=" + std::to_string(riters) : " RUNROLL=" + std::to_string(runroll));
  }
};

// A KILN_TUNE_* experiment knob: the variable's value clamped to [lo, hi], else the fallback.
inline std::int64_t tuning_knob(const char* name, std::int64_t fallback, std::int64_t lo, std::int64_t hi) {
  const char* e = std::getenv(name);
  return e ? std::clamp<std::int64_t>(std::atoll(e), lo, hi) : fallback;
}

// One kernel's choices that the rules below (and the kernel writer) make from sizes and dtypes,
// each of which an autotuning candidate may set instead (options.autotune, runtime/autotune.hpp).
// -1 leaves the rule's choice (or its KILN_TUNE_* knob) in place.
struct Tuning {
  int poi_threads = -1;  // pointwise: threads a block
  int poi_vectors = -1;  // pointwise: 16-byte vectors a thread
  int row_elems = -1;    // rows: elements of a row a thread
  int row_block = -1;    // rows: threads of a block that short rows share
  int row_unroll = -1;   // looped rows: steps unrolled together
  int hoist = -1;        // row-invariant loads: 0 reloaded each row, 1 registers, 2 shared memory
  int loads = -1;        // 16-byte loads: 0 through the read-only path, 1 plain (kiln::via)
  int waves = -1;        // row kernels: grid of this many times the resident blocks (a launch choice)

  // The fields in order, with their names: what str() prints and the disk cache stores.
  static constexpr int Tuning::*fields[] = {&Tuning::poi_threads, &Tuning::poi_vectors, &Tuning::row_elems, &Tuning::row_block,
                                            &Tuning::row_unroll,  &Tuning::hoist,       &Tuning::loads,     &Tuning::waves};
  static constexpr const char* names[] = {"threads", "vectors", "row_elems", "row_block", "unroll", "hoist", "loads", "waves"};

  std::string str() const {
    std::string s;
    for (std::size_t i = 0; i < std::size(fields); ++i)
      if (this->*fields[i] >= 0) s += (s.empty() ? "" : " ") + std::string(names[i]) + "=" + std::to_string(this->*fields[i]);
    return s.empty() ? "default" : s;
  }
  // This tuning with the fields `over` sets replaced (a neighbour of a winner, in autotuning).
  Tuning merged(const Tuning& over) const {
    Tuning t = *this;
    for (auto f : fields)
      if (over.*f >= 0) t.*f = over.*f;
    return t;
  }
  bool operator==(const Tuning&) const = default;
};

inline std::int64_t next_pow2(std::int64_t v) {
  std::int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

// item: the narrowest element (bytes) the kernel loads or stores; each thread moves 16 bytes of it.
inline LaunchConfig pointwise_config(Target t, std::int64_t xnumel, int max_item, const Tuning& tune = {}) {
  LaunchConfig c;
  if (t == Target::cpu) {
    c.xvec = 16;
    c.xblock = std::clamp<std::int64_t>(next_pow2(xnumel / 64), 1024, 16384);
    return c;
  }
  // KILN_TUNE_POI_THREADS / KILN_TUNE_POI_UNROLL: tuning experiments (benchmarks/NOTES.md). 128
  // threads x 4 vectors measured best on an H200 for 16-bit data (W1c 0.092 -> 0.088 ms; 2 vectors
  // +5%), 2 vectors for 32-bit or wider data, which streams better in smaller blocks (W1 0.136 -> 0.130, W8
  // 0.117 -> 0.115), special functions included once they load via::plain (W1b 0.1343 -> 0.1320;
  // with read-only loads 4 vectors were better: NOTES items 18 and 30).
  static const int threads = static_cast<int>(tuning_knob("KILN_TUNE_POI_THREADS", 128, 32, 1024));
  static const int big_unroll = static_cast<int>(tuning_knob("KILN_TUNE_POI_UNROLL", 0, 0, 16));
  c.xvec = std::max(1, 16 / std::max(1, max_item));
  c.threads = tune.poi_threads > 0 ? tune.poi_threads : threads;
  int heavy = big_unroll ? big_unroll : max_item < 4 ? 4 : 2;
  int unroll = tune.poi_vectors > 0 ? tune.poi_vectors : xnumel >= (std::int64_t{1} << 22) ? heavy : 1;
  c.xblock = std::int64_t{c.threads} * c.xvec * unroll;
  return c;
}

// static_rnumel: the row length is a compile-time constant (then rows may stay in registers).
// column: the innermost dim is kept (a reduction over outer dims, e.g. a bias gradient).
// streams: how many full-size inputs the kernel reads along its rows.
inline LaunchConfig row_config(Target t, std::int64_t xnumel, std::int64_t rnumel, int max_item, bool static_rnumel,
                               bool column, int streams = 1, const Tuning& tune = {}) {
  LaunchConfig c;
  auto iters = [&] { return (rnumel + std::int64_t{c.row_threads} * c.rvec - 1) / (std::int64_t{c.row_threads} * c.rvec); };
  if (t == Target::cpu) {
    c.rvec = 16;
    c.rows = static_cast<int>(std::clamp<std::int64_t>(4096 / std::max<std::int64_t>(rnumel, 1), 1, 64));
    if (static_rnumel && iters() <= 256) c.riters = static_cast<int>(std::max<std::int64_t>(iters(), 1));
    return c;
  }
  if (column) {  // the reduced dims are outer: a thread per kept element, coalesced across threads
    c.rvec = 1;
    c.rows = 256;
    c.threads = 256;
    if (static_rnumel && rnumel <= 16) c.riters = static_cast<int>(std::max<std::int64_t>(rnumel, 1));
    c.runroll = tune.row_unroll > 0 ? tune.row_unroll : 4;  // one strided element a step: 4 loads in flight
    return c;
  }
  c.rvec = std::max(1, 16 / std::max(1, max_item));
  // About 32 elements of the row a thread (more for long rows: at most 512 threads a row; 1024
  // measured slower for 32768-element softmax and 32000-class cross_entropy rows on an H200).
  // KILN_TUNE_ROW_ELEMS overrides the 32, for tuning experiments (benchmarks/NOTES.md).
  // KILN_TUNE_ROW_THREADS caps the threads a row (512), KILN_TUNE_ROW_ITERS the register-cached
  // tiles a thread (16; above it the row is re-read from L2 instead: the "red" kind).
  constexpr std::int64_t any = std::int64_t{1} << 40;
  static const std::int64_t elems = tuning_knob("KILN_TUNE_ROW_ELEMS", 0, 0, any);
  static const std::int64_t max_threads = tuning_knob("KILN_TUNE_ROW_THREADS", 512, 32, 1024);
  static const std::int64_t max_iters = tuning_knob("KILN_TUNE_ROW_ITERS", 16, 0, any);
  // Measured on an H200: 32 elements a thread for f32 rows, 16 for 16-bit rows (W6 0.146 -> 0.086 ms)
  // and for rows that stream two or more full-size inputs, whose register caches would otherwise
  // cost occupancy (layer_norm backward, x and dy: 128 -> ~64 registers, W5 0.427 -> 0.393 ms).
  std::int64_t per_thread = tune.row_elems > 0 ? tune.row_elems : elems ? elems : (max_item <= 2 || streams >= 2 ? 16 : 32);
  std::int64_t per_row = next_pow2((rnumel + per_thread - 1) / per_thread);
  c.row_threads = static_cast<int>(std::clamp<std::int64_t>(per_row, 32, max_threads));
  // Rows shorter than a block share one (in lockstep: the same barriers). KILN_TUNE_ROW_BLOCK sets
  // the block's threads (256) for A/B runs; a block a row of 128 threads (four independent blocks an
  // SM for layer_norm, as Triton has) measured W4 +3%, W3 equal (benchmarks/NOTES.md item 32).
  static const std::int64_t block = tuning_knob("KILN_TUNE_ROW_BLOCK", 256, 32, 1024);
  const std::int64_t shared_block = tune.row_block > 0 ? tune.row_block : block;
  c.rows = c.row_threads >= shared_block ? 1 : static_cast<int>(shared_block / c.row_threads);
  c.threads = c.row_threads * c.rows;
  if (static_rnumel && iters() <= max_iters) c.riters = static_cast<int>(std::max<std::int64_t>(iters(), 1));
  // Looped rows unroll their vector steps by 2: 4 raised the NVRTC time of a dynamic layer_norm 1.5x
  // (214 -> 320 ms), 1 made its kernel 14% slower (W4 dynamic 0.188 -> 0.214 ms, NOTES item 27).
  // KILN_TUNE_ROW_UNROLL sets it for experiments.
  static const int row_unroll = static_cast<int>(tuning_knob("KILN_TUNE_ROW_UNROLL", 2, 1, 8));
  c.runroll = tune.row_unroll > 0 ? tune.row_unroll : row_unroll;
  (void)xnumel;
  return c;
}

}  // namespace kiln::codegen
