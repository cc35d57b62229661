// Block sizes of a kernel for one target: how many elements a program owns (pointwise), how
// many threads share a row and how many rows a program takes (reductions). Chosen from sizes and
// dtypes with simple rules; autotuning may override them.
#pragma once
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include "../core/tuning.hpp"

namespace kiln::codegen {

// An SM's 32-bit registers (every GPU kiln compiles for, compute capability 7.0 to 9.0), and the step a
// thread's are allocated in (a warp's 256 at a time).
inline constexpr long sm_registers = 65536, register_step = 8;

enum class Target { cpu, cuda };

struct LaunchConfig {
  int threads = 1;             // CUDA threads per program (block)
  int xvec = 16;               // pointwise: consecutive elements per thread-tile
  std::int64_t xblock = 4096;  // pointwise: elements per program
  int rvec = 16;               // rows: consecutive elements per thread-tile along the row
  int row_threads = 1;         // rows: threads sharing one row
  int rows = 1;                // rows: rows per program
  int riters = 0;              // rows: tiles per thread along a row when known (the row is then kept in
                               // registers across loops: the "per" kind); 0 = looped ("red")
  int runroll = 1;             // looped rows: steps of the row loop unrolled together
  bool cache_invariants = true;  // held rows: row-invariant arrays (weights) are cached too, not
                                 // re-read from L1 each loop
  int tile = 0;                  // pointwise on the GPU: square tiles of this side over dims
  int tile_dim = -1;             // (tile_dim, last), transposed inputs staged (kernel_writer_tiles.hpp)
  bool x_lanes = false;          // host rows reduced over outer dims: a program's ROWS kept elements
                                 // are one tile's lanes, the reduced elements a scalar loop
  int min_blocks = 0;            // GPU: blocks an SM the kernel asks ptxas to fit (__launch_bounds__)
  std::int64_t shared_bytes = 0;  // GPU: dynamic shared memory a block (looped rows kept there)

  std::string str() const {
    return "threads=" + std::to_string(threads) + " XVEC=" + std::to_string(xvec) +
           " XBLOCK=" + std::to_string(xblock) + " RVEC=" + std::to_string(rvec) +
           " ROW_THREADS=" + std::to_string(row_threads) + " ROWS=" + std::to_string(rows) +
           (riters ? " RITERS=" + std::to_string(riters) : " RUNROLL=" + std::to_string(runroll)) +
           (cache_invariants ? "" : " UNCACHED_WEIGHTS") +
           (x_lanes ? " X_LANES" : "") + (shared_bytes ? " SMEM=" + std::to_string(shared_bytes) : "") + (min_blocks ? " MIN_BLOCKS=" + std::to_string(min_blocks) : "") +
           (tile ? " TILE=" + std::to_string(tile) + " (dims " + std::to_string(tile_dim) + ", last)" : "");
  }
};

// The choices below that a Tuning (core/tuning.hpp) may set instead: autotuning candidates and
// KILN_TUNE_* experiment variables, merged once per kernel.
using Tuning = kiln::Tuning;

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
  // 128 threads; 4 vectors a thread for 16-bit data, 2 for 32-bit or wider data, which streams
  // better in smaller blocks, special functions included once they load via::plain (measured on an
  // H200: benchmarks/NOTES.md items 18 and 30).
  c.xvec = std::max(1, 16 / std::max(1, max_item));
  c.threads = tune.poi_threads > 0 ? tune.poi_threads : 128;
  int heavy = tune.poi_unroll > 0 ? tune.poi_unroll : max_item < 4 ? 4 : 2;
  int unroll = tune.poi_vectors > 0 ? tune.poi_vectors : xnumel >= (std::int64_t{1} << 22) ? heavy : 1;
  c.xblock = std::int64_t{c.threads} * c.xvec * unroll;
  return c;
}

// CPU tiles of transposed operands (kernel_writer_tiles.hpp): rows of dim a by lanes of the last dim.
inline constexpr std::int64_t cpu_tile_rows = 64, cpu_tile_lanes = 16;

// Threads of a tiled kernel: each moves 16 bytes of the narrowest element a pass (as pointwise
// vectors do), so side^2 * item / 16, between side and side^2 (a whole column of the tile); a
// Tuning's poi_threads (KILN_TUNE_POI_THREADS) overrides it within the same bounds.
inline int tile_threads(int side, int max_item, const Tuning& tune) {
  std::int64_t t = tune.poi_threads > 0 ? next_pow2(tune.poi_threads) : std::int64_t{side} * side * max_item / 16;
  return static_cast<int>(std::clamp<std::int64_t>(t, side, std::min<std::int64_t>(1024, std::int64_t{side} * side)));
}

// The threads sharing a row of `rnumel` elements in vectors of `rvec`, from `wanted` (a power of
// two) and the most register-cached steps a thread may take (`iters`). A row of fewer vectors than
// a warp takes a power of two of threads covering it in one step: the warp then reads several
// whole rows, contiguous in memory, instead of idling lanes past the row's end (rows of 64 bf16
// values ran at 14% of the copy ceiling with a warp a row). A longer row held in registers takes,
// among powers of two from max(32, wanted / 4) up to `most` that keep it in registers, the count
// whose steps leave the fewest lanes past its end, the nearest to `wanted` among equals: rows that
// tile exactly need no bounds tests (768 bf16 values: 32 threads x 3 vectors, not 64 x 2 with a
// half-empty step, 2.7x slower). Looped rows keep `wanted`.
inline int row_threads_for(std::int64_t rnumel, int rvec, int wanted, std::int64_t most, std::int64_t iters) {
  const std::int64_t vectors = (rnumel + rvec - 1) / rvec;
  if (vectors < 32) return static_cast<int>(next_pow2(std::max<std::int64_t>(vectors, 1)));
  auto steps = [&](std::int64_t t) { return (vectors + t - 1) / t; };
  if (steps(wanted) > iters) return wanted;
  auto distance = [&](std::int64_t t) { return t > wanted ? t / wanted : wanted / t; };
  std::int64_t best = wanted, best_waste = steps(wanted) * wanted - vectors;
  for (std::int64_t t = std::max(32, wanted / 4); t <= most; t *= 2) {
    std::int64_t waste = steps(t) * t - vectors;
    if (steps(t) <= iters && (waste < best_waste || (waste == best_waste && distance(t) < distance(best))))
      best = t, best_waste = waste;
  }
  return static_cast<int>(best);
}

// What a row kernel's register caches cost a thread, in half-registers for each value of a
// thread's tiles (codegen/kernel_writer_access.hpp): full-size arrays read along the rows
// (streams) and row-invariant ones (weights), held raw; weights hoisted above the row loop in
// blocks of several rows are held in the compute dtype.
struct RowCaches {
  int streams = 1;         // full-size arrays
  int stream_cost = 2;     // their cost a value, summed: 3 for a 16-bit array, 2 for 32 bits, 4 for 64
  int invariant_cost = 0;  // the same for the weights, held raw
  int hoisted_cost = 0;    // the weights, hoisted: 4 for a 32-bit compute dtype, 8 for 64
  int loops = 1;           // walks down a row (each reads again what an earlier one read), at most
};
// A held value's cost in half-registers, by the bytes it is held in: 16-bit and narrower values
// also keep their widened copy (3), wider ones their size; a hoisted weight, held in its compute
// dtype over every row of the block, twice its compute size.
inline int held_cost(std::int64_t bytes) { return bytes >= 4 ? static_cast<int>(bytes / 2) : 3; }
inline int hoisted_cost(std::int64_t compute_bytes) { return static_cast<int>(std::max<std::int64_t>(4, compute_bytes)); }

// The most a thread's register caches may cost: 1.5 times the 128 registers a thread of a 512-thread
// block has. A 16-bit value costs 1.5 registers (ptxas keeps the widened copy live across the loops
// that reuse it beside the raw half), a hoisted weight twice its compute size (it stays live over
// every row of the block). Measured on an H200 (benchmarks/NOTES.md item 51): the norm backward's
// dx kernel over 32000 f32 columns ran best with x, dy and w held (3 x 64 values: 192), over 32000
// bf16 columns with x and dy held and w re-read (2.0x faster than holding w too), and over 65536
// bf16 columns looped (3.5x faster than spilling); a layer_norm over 5120 bf16 columns ran 1.9x
// faster re-reading w and b than hoisting them.
inline constexpr std::int64_t row_cache_half_registers = 384;

// Whether a compiled held-row GPU kernel should be written again looped (runtime/refit_held_rows.hpp's
// loop_spilled_rows), from the local memory a thread of its function uses (ptxas's stack frame:
// spills, arrays it could not keep in registers) and its RITERS. Holding a row saves a looped
// kernel's re-reads of it, about two passes over the 16 * RITERS bytes a thread holds (a softmax
// or cross_entropy reads its row for the max, the sum and the output); a stack frame larger than
// that costs more than it saves. Cross_entropy's fused kernel over 50257 bf16 columns kept 1,008
// bytes a thread for 416 saved and ran 3x slower than looped; softmax's at the same shape keeps
// 224 and stays held (benchmarks/NOTES.md items 77-78). Under min_spill_bytes, a stack frame is
// ptxas's own small arrays (sin and cos keep 28-40 bytes for their argument reduction) or a few
// spilled words, not a held row that did not fit.
// A block's stack frames past held_row_l1_bytes (three quarters of an sm_90 SM's 256 KB of L1 and
// shared memory) leave the L1 for L2: softmax held by 1024 threads over 50257 f32 columns kept 376
// bytes a thread (385 KB a block, under the 416 its row saves) and ran 1.7x slower than looped.
inline constexpr std::int64_t min_spill_bytes = 256;
inline constexpr std::int64_t held_row_l1_bytes = 192 * 1024;
inline std::int64_t held_row_saves(int riters) { return 2 * 16 * std::int64_t{riters}; }
// `blocks`: the blocks an SM holds of the kernel (registers, shared memory). One block an SM that
// spills as well has no other block to run while its row waits on local memory and its barriers:
// cross_entropy's value and gradient over rows of 50257 bf16 values a GEMM stores with room
// (schedule/pad_buffers.hpp), held at 128 registers with 304 bytes of stack (under the 416 its row
// saves), ran 1.38 ms at 8192 rows on an H200 where looped it ran 0.88 (NOTES item 142).
// `floor`: the frame taken for ptxas's own (KILN_TUNE_SPILL_FLOOR sets it; NOTES item 176).
inline bool held_row_spills(std::int64_t local_bytes, int riters, int threads, int blocks = 2,
                            std::int64_t floor = min_spill_bytes) {
  return riters > 0 && local_bytes > floor &&
         (local_bytes > held_row_saves(riters) || local_bytes * threads > held_row_l1_bytes || blocks <= 1);
}

// Blocks an SM a held-row GPU kernel may ask ptxas to fit (__launch_bounds__' second argument):
// enough for `occupancy` threads (1024 by default: 64 registers a thread) when its register caches,
// at RowCaches' costs (`cached`: half-registers for all of a thread's tiles), leave a quarter of
// those registers to the rest of the kernel; else 0. The bound is taken only where ptxas, left
// alone, used more registers (runtime/compile/nvrtc.hpp compiles such a kernel again): it sized
// kernels for their heaviest path, the element-by-element body of unaligned pointers (an rms_norm
// over 16384 bf16 columns: 81 registers, one 512-thread block an SM, 1.35x slower than with two),
// while a bound on a kernel that needed fewer registers made ptxas use them all, up to 1.19x
// slower; caches that fill the 64 registers spilled (f32 rows of 32000, layer_norm's hoisted f32
// weights: up to 2.4x slower). Measured on an H200 over 152 row cases: benchmarks/NOTES.md item 73.
inline int min_blocks_for(int threads, std::int64_t cached, const Tuning& tune) {
  const std::int64_t occupancy = tune.occupancy >= 0 ? tune.occupancy : 1024;
  if (occupancy < threads || occupancy <= 0) return 0;
  const std::int64_t registers = std::min<std::int64_t>(sm_registers / occupancy, 255);
  return cached * 4 <= registers * 2 * 3 ? static_cast<int>(occupancy / threads) : 0;
}

// Where a held row's weights live: 0 reloaded each row, 1 hoisted into registers (blocks of several
// rows, by default), 2 shared memory (KILN_TUNE_HOIST).
inline int hoist_mode(const Tuning& tune, int rows) { return tune.hoist >= 0 ? tune.hoist : rows >= 2 ? 1 : 0; }

// A GPU row's vector: 16 bytes of the narrowest element the kernel moves.
inline int row_vector(int max_item) { return std::max(1, 16 / std::max(1, max_item)); }

// GPU blocks of rows shorter than a block (row_config): at least this many threads, and rows that
// span at least this many bytes of each array.
inline constexpr std::int64_t row_min_block = 64;
inline constexpr std::int64_t row_block_bytes = 1536;

// GPU columns of at most this many values are held in registers by a thread alone (row_config's
// thread-a-column form), and a column block's threads hold at most this many steps each;
// KILN_TUNE_ROW_ITERS sets it as it does rows' tiles.
inline constexpr std::int64_t column_thread_values = 16;

// shifted: a GPU row whose tiles start on the vector before the row (kernel_writer_impl.hpp's
// row_shift_), so that its tiles span up to a vector less one more than the row.
inline LaunchConfig row_config(Target t, std::int64_t xnumel, std::int64_t rnumel, int max_item, bool static_rnumel,
                               bool column, const RowCaches& caches = {}, const Tuning& tune = {},
                               bool shifted = false) {
  const int streams = caches.streams;
  LaunchConfig c;
  auto iters = [&] {
    return (rnumel + std::int64_t{c.row_threads} * c.rvec - 1) / (std::int64_t{c.row_threads} * c.rvec);
  };
  if (t == Target::cpu && column && tune.column_lanes != 0) {
    // Reduced over outer dims (a column sum, a bias's gradient): lanes along the kept elements,
    // contiguous in memory, each summing its own column down a scalar loop over the reduced ones
    // (Inductor's outer reduction). Lanes along a column read one element a cache line, 4 KiB apart
    // over 1024 f32 columns: benchmarks/NOTES.md item 68.
    c.rows = static_cast<int>(cpu_tile_lanes);
    c.xvec = c.rows;
    c.rvec = 1;
    c.x_lanes = true;
    return c;
  }
  // Columns walked more than once (a softmax over a middle dim) that one thread can hold (the
  // thread-a-column form's 16 values) go to that form: each walk is then register-only, with no
  // combine across a column block's threads through shared memory and its barriers. Over [N, 12 or
  // 16, M] it ran 1.3-2.8x faster than column blocks holding theirs (0.227 ms against 0.633 over
  // 56775x12x197 bf16); longer columns and single walks (column sums) stay in blocks, faster there
  // (NOTES item 115).
  const std::int64_t thread_values = tune.row_iters >= 0 ? tune.row_iters : column_thread_values;
  const bool held_alone = static_rnumel && rnumel > 0 && rnumel <= thread_values && caches.loops >= 2;
  if (column && tune.column_lanes != 0 && !(held_alone && tune.column_lanes < 0)) {
    // The same on the GPU: a thread's lanes are 16 bytes of adjacent kept elements (one vector load
    // a step down its columns instead of one 2- or 4-byte element). Alone (column_lanes 1) that
    // left an eighth of the threads and ran slower (NOTES item 86); by default a block is XT such
    // threads across the columns by RT down the reduced elements (row_threads), combined through
    // shared memory at the end (Inductor's [RBLOCK, XBLOCK] tile): as many threads as a thread a
    // kept element, each moving 16 bytes a step, and a column's steps split RT ways.
    c.xvec = row_vector(max_item);
    c.threads = 256;
    const std::int64_t rt = tune.column_lanes == 1 ? 1 : static_cast<std::int64_t>(static_rnumel ? next_pow2(std::max<std::int64_t>(rnumel, 1)) : 8);
    c.row_threads = static_cast<int>(std::min<std::int64_t>(rt, 8));
    c.rows = c.xvec * (c.threads / c.row_threads);  // kept elements a block
    c.rvec = 1;
    c.x_lanes = true;
    c.runroll = tune.row_unroll > 0 ? tune.row_unroll : 4;
    // Columns of a static length that a thread's steps cover in a few tiles, walked more than once,
    // are held in registers, as rows are: a softmax over dim 1 of [28387, 12, 197] read its input
    // three times without (0.317 ms, 2.3x torch.compile's 0.138; NOTES item 112). Same budget as
    // rows' caches (0: no limit). Column blocks only: KILN_TUNE_COLUMN_LANES=1's single threads down
    // a column stay looped. (A column sum walks once: its loop stays as it was.)
    const std::int64_t steps = (rnumel + c.row_threads - 1) / c.row_threads;
    const std::int64_t budget = tune.row_cache >= 0 ? tune.row_cache : row_cache_half_registers;
    if (static_rnumel && rnumel > 0 && c.row_threads > 1 && caches.loops >= 2 && steps <= thread_values &&
        (budget <= 0 || steps * c.xvec * std::max(caches.stream_cost, 2) <= budget))
      c.riters = static_cast<int>(steps);
    return c;
  }
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
    if (static_rnumel && rnumel <= thread_values) c.riters = static_cast<int>(std::max<std::int64_t>(rnumel, 1));
    c.runroll = tune.row_unroll > 0 ? tune.row_unroll : 4;  // one strided element a step: 4 loads in flight
    return c;
  }
  c.rvec = row_vector(max_item);
  if (shifted) rnumel += c.rvec - 1;  // the span the tiles cover
  // About 32 elements of the row a thread (more for long rows: at most 512 threads a row, the
  // row_threads knob; 1024 measured slower for long softmax and cross_entropy rows), at most 16
  // register-cached tiles a thread (row_iters; above it the row is re-read from L2 instead: the
  // "red" kind). 16 elements a thread for 16-bit rows and for rows that stream two or more
  // full-size inputs, whose register caches would otherwise cost occupancy (layer_norm backward:
  // benchmarks/NOTES.md).
  const std::int64_t max_threads = tune.row_threads > 0 ? tune.row_threads : 512;
  const std::int64_t max_iters = tune.row_iters >= 0 ? tune.row_iters : 16;
  std::int64_t per_thread = tune.row_elems > 0 ? tune.row_elems : (max_item <= 2 || streams >= 2 ? 16 : 32);
  std::int64_t per_row = next_pow2((rnumel + per_thread - 1) / per_thread);
  c.row_threads = static_cast<int>(std::clamp<std::int64_t>(per_row, 32, max_threads));
  if (static_rnumel && tune.row_tiling != 0 && tune.row_threads <= 0 && tune.row_elems <= 0)
    c.row_threads = row_threads_for(rnumel, c.rvec, c.row_threads, max_threads, max_iters);
  // Rows shorter than a block share one: the fewest rows that fill a block of 64 threads (the
  // smallest that still fill an SM: 2048 thread slots, at most 32 resident blocks on sm_80 and
  // sm_90) and span row_block_bytes of each array. A block frees its slots only when its last row
  // is done, so the more rows a block, the more of the SM waits behind its slowest row (256-thread
  // blocks ran rows of 768 bf16 at 68% of the copy ceiling, 2 rows of 32 threads at 94%); but an SM
  // starts a block only about every 80 ns, in which it moves ~3 KB at the copy ceiling, so blocks
  // of less traffic wait on that instead (rows of 128 f32 two to a block: 0.162 ms against 0.130
  // in blocks of eight). benchmarks/NOTES.md item 99.
  if (tune.row_block > 0) {
    c.rows = c.row_threads >= tune.row_block ? 1 : static_cast<int>(tune.row_block / c.row_threads);
  } else {
    const std::int64_t row_bytes = std::max<std::int64_t>(rnumel * max_item, 1);
    std::int64_t rows = std::max<std::int64_t>(row_min_block / c.row_threads, 1);
    while (rows * row_bytes < row_block_bytes && rows * c.row_threads < 1024) rows *= 2;
    c.rows = static_cast<int>(rows);
  }
  c.threads = c.row_threads * c.rows;
  if (static_rnumel && iters() <= max_iters) c.riters = static_cast<int>(std::max<std::int64_t>(iters(), 1));
  // Register caches past a thread's registers spill to local memory (a 16-bit norm backward over
  // 65536 columns ran at 4% of the copy ceiling): weights are held only when they fit beside the
  // full-size arrays, which are held only when they fit alone (else the row is looped and re-read).
  const std::int64_t budget = tune.row_cache >= 0 ? tune.row_cache : row_cache_half_registers;
  if (budget > 0 && c.riters > 0) {
    const std::int64_t values = std::int64_t{c.riters} * c.rvec;
    const int hoist = hoist_mode(tune, c.rows);
    const int weights = hoist == 2 ? 0 : hoist == 1 ? caches.hoisted_cost : caches.invariant_cost;
    const std::int64_t held = values * std::max(caches.stream_cost, 2);
    c.cache_invariants = held + values * weights <= budget;
    if (held > budget) c.riters = 0;
  }
  // Looped rows unroll their vector steps by 2: 4 raised the NVRTC time of a dynamic layer_norm by
  // half, 1 made its kernel slower (NOTES item 27).
  c.runroll = tune.row_unroll > 0 ? tune.row_unroll : 2;
  (void)xnumel;
  return c;
}

// With KILN_TUNE_WIDE_ROWS=1 (off by default: cross_entropy's value and gradient over 50257 f32
// columns ran 1.28x slower held so, unexplained yet; NOTES item 106), a static GPU row too long
// for 512 threads to hold (row_config loops it) held by 1024, when its
// tiles fit 56 of the 64 registers such a thread has (wide_row_cache_half_registers) and the rule's
// other choices are its own (no KILN_TUNE_ROW_THREADS, ROW_ELEMS or ROW_ITERS; loop_spilled_rows
// asks for the looped form with ROW_ITERS=0). Measured on an H200 at 1335x50257 f32 (NOTES item
// 106): rms_norm 0.2626 -> 0.1817 ms, layer_norm 0.2770 -> 0.2230; softmax and log_softmax
// spilled 368-376 bytes a thread, 385 KB a block, past the L1 (held_row_spills loops them again).
// At 64 registers a thread the kernel's own values take a larger share than at 128: ptxas held
// 52 f32 values a thread with 8-88 bytes of stack (rms_norm, layer_norm over 50257 columns).
inline constexpr std::int64_t wide_row_cache_half_registers = 112;
inline std::optional<LaunchConfig> wide_rows(std::int64_t xnumel, std::int64_t rnumel, int max_item,
                                             const RowCaches& caches, const Tuning& tune, bool shifted) {
  if (tune.wide_rows != 1 || tune.row_threads > 0 || tune.row_elems > 0 || tune.row_iters >= 0) return std::nullopt;
  Tuning wide = tune;
  wide.row_threads = 1024;
  if (wide.row_cache < 0) wide.row_cache = wide_row_cache_half_registers;
  LaunchConfig c = row_config(Target::cuda, xnumel, rnumel, max_item, true, false, caches, wide, shifted);
  if (c.riters == 0 || c.rows != 1) return std::nullopt;
  return c;
}

// GPU row kernels with column partials (schedule/partials.hpp): a block a row group, whose row
// slots each keep a partial tile a row tile in registers over the rows they visit, folded into the
// first slot's at the end (the prelude's fold_row_slots). The sums' registers, in 4-byte words a
// thread, are held to what hosting took before rows of any width were (layer_norm's dw and db over
// 8192 columns, 16 values a thread each); a row with more goes to more threads, fewer values each
// (partial_config), or is not hosted.
inline constexpr std::int64_t partial_registers = 32;
inline std::int64_t partial_words(const LaunchConfig& c, std::int64_t sum_words) {
  return std::int64_t{c.riters} * c.rvec * sum_words;
}
// The held config of a row whose partials' words (sum_words a lane, all sums together) fit the
// budget: the rule's own, else the rule's with as many elements a thread as the budget leaves; none
// where neither holds the row.
inline std::optional<LaunchConfig> partial_config(const LaunchConfig& rule, std::int64_t xnumel, std::int64_t rnumel,
                                                  int max_item, bool static_rnumel, const RowCaches& caches,
                                                  const Tuning& tune, std::int64_t sum_words) {
  if (rule.riters > 0 && partial_words(rule, sum_words) <= partial_registers) return rule;
  if (tune.row_elems > 0 || tune.row_threads > 0 || tune.row_iters >= 0) return std::nullopt;  // a knob decides
  Tuning fewer = tune;
  fewer.row_elems =
      static_cast<int>(std::max<std::int64_t>(1, partial_registers / std::max<std::int64_t>(sum_words, 1)));
  LaunchConfig c = row_config(Target::cuda, xnumel, rnumel, max_item, static_rnumel, false, caches, fewer, false);
  if (c.riters == 0 || partial_words(c, sum_words) > partial_registers) return std::nullopt;
  return c;
}
// Looped GPU rows add each row's tiles to their group's sums in the partials buffer, a load and a
// store of 4 bytes a column a row: that pays only where the buffer stays in L2, at most this many
// bytes (the window hosted before, 256 groups of 8192 f32 columns' dw and db, 16 MiB, a third of an
// H100's L2); past it (dw and db over 2048 rows of 65536 columns: 64 MiB) the sums stay a split kernel.
inline constexpr std::int64_t partial_buffer_bytes = std::int64_t{16} << 20;
// The row slots of such a block: enough that the groups' slots keep partial_bytes_in_flight of
// rows moving (a slot reads one row at a time: row_bytes of every full-size array), at most a
// slot a row of the group and 256 threads a block. The bytes are what W5's layer_norm backward had
// in flight when its partials ran at 82% of the copy ceiling on an H200: 256 groups, a slot each,
// a 4096-column f32 row of x and dy (8 MiB). The threads: such kernels hold rows, their sums and
// often hoisted weights, 100-128 registers a thread (ptxas on GPT-2's norm backward, 768 bf16
// columns), so a block of 512 would be an SM's only one, and 256 groups of them two waves on 132
// SMs where blocks of 256 fit in one.
inline constexpr std::int64_t partial_bytes_in_flight = std::int64_t{8} << 20;
// Several slots need the fold's row of shared memory (a slot's tiles of the widest sum type,
// fold_bytes): at most partial_fold_bytes, else one slot (static shared memory stops at 48 KiB).
inline constexpr std::int64_t partial_fold_bytes = 16 * 1024;
inline int partial_row_slots(std::int64_t groups, std::int64_t rows, std::int64_t row_bytes, int row_threads,
                             std::int64_t fold_bytes, const Tuning& tune) {
  if (fold_bytes > partial_fold_bytes) return 1;
  const std::int64_t most_threads = tune.partial_rows > 0 ? 1024 : 256;
  const std::int64_t most = std::max<std::int64_t>(1, most_threads / std::max(row_threads, 1));
  if (tune.partial_rows > 0) return static_cast<int>(std::min<std::int64_t>(tune.partial_rows, most));
  const std::int64_t per_group = (rows + groups - 1) / std::max<std::int64_t>(groups, 1);
  std::int64_t slots = 1;
  while (slots * 2 <= most && slots * 2 <= per_group && groups * slots * row_bytes < partial_bytes_in_flight)
    slots *= 2;
  return static_cast<int>(slots);
}

}  // namespace kiln::codegen
