// The tuning of a compiled program: the choices that launch rules and the kernel writer otherwise
// make from sizes and dtypes, each of which an autotuning candidate or a KILN_TUNE_* experiment
// variable may set instead. Parsed from the environment once per compiled program
// (Tuning::from_environment), carried in the program, and merged once with a candidate's choices:
// autotuning over the environment over the rules. Every field is -1 where the rule decides.
#pragma once
#include <array>
#include <cstdint>
#include <iterator>
#include <string>

#include "config.hpp"

namespace kiln {

struct Tuning {
  // A kernel's choices that an autotuning candidate may set (runtime/tune/autotune.hpp):
  int poi_threads = -1;  // pointwise: threads a block (KILN_TUNE_POI_THREADS)
  int poi_vectors = -1;  // pointwise: 16-byte vectors a thread
  int row_elems = -1;    // rows: elements of a row a thread (KILN_TUNE_ROW_ELEMS)
  int row_block = -1;    // rows: threads of a block that short rows share (KILN_TUNE_ROW_BLOCK)
  int row_unroll = -1;   // looped rows: steps unrolled together (KILN_TUNE_ROW_UNROLL)
  int hoist = -1;        // row-invariant loads: 0 reloaded each row, 1 registers, 2 shared memory (KILN_TUNE_HOIST)
  int loads = -1;        // 16-byte loads: 0 through the read-only path, 1 plain (kiln::via)
  int waves = -1;        // row kernels: grid of this many times the resident blocks, 0 the
                         // occupancy formula (KILN_TUNE_ROW_WAVES)
  int partial_rows = -1;  // GPU row kernels with column partials: row slots a block (default from the
                          // bytes in flight, codegen's partial_row_slots; KILN_TUNE_PARTIAL_ROWS)
  // Experiment knobs only the environment sets, for A/B runs (benchmarks/ab.sh):
  int poi_unroll = -1;     // large pointwise kernels: vectors a thread (KILN_TUNE_POI_UNROLL)
  int row_threads = -1;    // rows: the most threads a row (KILN_TUNE_ROW_THREADS)
  int row_iters = -1;      // rows: the most register-cached tiles a thread (KILN_TUNE_ROW_ITERS)
  int row_slots = -1;      // 0: reductions of one row kernel share one shared-memory slot (KILN_TUNE_ROW_SLOTS)
  int aligned = -1;        // 0: bounds tests even in exactly tiled kernels (KILN_TUNE_ALIGNED)
  int prelude_loads = -1;  // the prelude's KILN_LOADS, how 16-byte loads reach memory (KILN_TUNE_LOADS)
  int partials = -1;       // column partial sums in row kernels (schedule/partials.hpp): 0 never; 1 the
                           // rule before on a GPU (rows of 2048-8192 columns, one row a block, chunks
                           // of 64 rows or more); default rows of any width the block holds, several
                           // row slots a block folding their sums (KILN_TUNE_PARTIALS)
  int matmul_t = -1;       // 0: a matmul's transpose stays a copy (KILN_TUNE_MATMUL_T)
  int matmul_wide = -1;    // 0: a 16-bit matmul read only as f32 stays a 16-bit product and a cast
                           // (KILN_TUNE_MATMUL_WIDE)
  int gemm_room = -1;      // 0: 16-bit GEMM operands off 8 are padded by copies in the GEMM step, not
                           // stored with room (schedule/pad_buffers.hpp; KILN_TUNE_GEMM_ROOM)
  int realize = -1;        // 0: shared pointwise values are recomputed in each kernel (KILN_TUNE_REALIZE)
  int row_tiling = -1;     // 0: a row's threads from its length alone, never fewer than a warp (the
                           // rule before the shape sweep; KILN_TUNE_ROW_TILING)
  int row_cache = -1;      // rows: what a thread's register caches may cost, in half-registers a
                           // value (codegen/launch_config.hpp); 0 no limit, the rule before it
                           // (KILN_TUNE_ROW_CACHE)
  int vector_masks = -1;   // rows whose length is a multiple of the vector: 0 test each lane (the
                           // rule before), 1 each vector, 2 each vector and split the body on
                           // alignment (KILN_TUNE_VECTOR_MASKS)
  int keep_values = -1;    // CPU rows held across loops: 0 evaluates special functions again in each
                           // loop that reads them (the rule before; KILN_TUNE_KEEP_VALUES)
  int transpose = -1;      // GPU pointwise kernels with transposed inputs: 0 untiled (the rule before),
                           // 16-128 the side of their shared-memory tiles (KILN_TUNE_TRANSPOSE)
  int column_lanes = -1;   // reductions over outer dims: on the CPU 0 lanes along the reduced dim (the
                           // rule before), else along the kept elements; on the GPU 0 a thread a kept
                           // element (the default for columns walked more than once that a thread
                           // holds), 1 gives threads 16 bytes of kept elements (measured slower: NOTES
                           // 85), 2 column blocks always (autotuning's other side of that rule),
                           // default else column blocks (KILN_TUNE_COLUMN_LANES)
  int column_rows = -1;    // GPU column blocks over a symbolic last kept dim of no whole number of
                           // tiles: default (or 1) a block a kept row's run of column tiles
                           // (codegen's plan: a dynamic layer_norm backward's split sums over 50257
                           // bf16 columns 1.54 -> 1.17 ms on an H200), 0 the flat walk (the rule
                           // before; KILN_TUNE_COLUMN_ROWS)
  int aligned_sizes = -1;  // GPU kernels whose contiguous tiles start on a vector only where the
                           // program's symbolic sizes are multiples of it (a dynamic column sum over
                           // an odd width): 1 tests those sizes once, at the kernel's start, and runs
                           // a body with no alignment test at each access (element by element where
                           // they are not multiples); default a test at each access (measured: odd bf16
                           // column sums 1.37 -> 1.30x static, an rms_norm backward 1.06 -> 1.14x;
                           // KILN_TUNE_ALIGNED_SIZES, benchmarks/NOTES.md item 139)
  int index32 = -1;        // GPU index arithmetic in int where it fits: 0 never (the rule before), 1
                           // static sizes only, default also symbolic sizes under a guard on the
                           // program's sizes (codegen's narrow_indices; KILN_TUNE_INDEX32)
  int dynamic_rows = -1;   // GPU rows of symbolic length: 0 looped (the rule before); default (or 2)
                           // held in registers as at the compiling call's length, the program keeping
                           // the kernel written looped for other lengths; 1 unshifted rows held only at
                           // lengths of whole vectors (the rule before item 169; codegen's plan,
                           // held_dynamic; KILN_TUNE_DYNAMIC_ROWS). Not
                           // a knob: merged() keeps it (autotuning's candidates stay looped) and str()
                           // leaves it out
  int row_shift = -1;      // GPU rows of a length no whole number of vectors: start their tiles on the
                           // vector before the row; 0 at the row's first element, 1 only rows without
                           // weights (the rule before), 2 every row, weights too (KILN_TUNE_ROW_SHIFT)
  int occupancy = -1;      // held-row GPU kernels: the threads an SM they ask ptxas to fit (the second
                           // argument of __launch_bounds__, as blocks), 0 none (KILN_TUNE_OCCUPANCY)
  int attention = -1;      // k::attention on a GPU: 0 decomposed into batched matmuls and a softmax (the
                           // rule before), else the fused kernel with this many warps a block, 16 query
                           // rows each (default 4; KILN_TUNE_ATTENTION)
  int attention_backward = -1;  // the fused attention forward's backward: 0 from primitives with the
                                // probabilities materialised (the rule before), else fused kernels
                                // (KILN_TUNE_ATTENTION_BACKWARD)
  int attention_rows = -1; // the fused attention kernel's 16-row tiles a warp (1 or 2; default by registers,
                           // codegen/attention_kernel.hpp; KILN_TUNE_ATTENTION_ROWS)
  int attention_wgmma = -1;  // the fused attention kernels on Hopper (compute capability 9.0), head dims 64
                             // and 128, forward and dq, dk/dv: 0 the mma.sync kernels (the rule before),
                             // otherwise warpgroup MMA (codegen/attention_kernel_sm90.hpp,
                             // attention_backward_kernel_sm90.hpp): 1 with a forward of two warpgroups
                             // in step, 2 of one warpgroup a block, 3 fed by a producer warpgroup whose
                             // two warpgroups take turns (attention_kernel_sm90_pingpong.hpp), 4 the same
                             // with three at head dim 64 without a score_mod (192 query rows a block; NOTES
                             // item 180), 5 the same looping: one block an SM over the query tiles where
                             // q's second buffer leaves three key stages and there is no score_mod, at D
                             // 64 (NOTES items 183, 185; the rule before), default (or 6) the same with
                             // each block's next tile from a counter (NOTES items 188, 189;
                             // KILN_TUNE_ATTENTION_WGMMA)
  int attention_order = -1;  // fused attention kernels' block order: 0 tile by tile within each (batch,
                             // head) pair (the rule before); default (or 1) causal, the longest tiles first
                             // over groups of pairs (codegen/attention_prelude.hpp's kiln_tile_at); 2 also,
                             // not causal, a looping forward's short last tiles after the full ones (NOTES
                             // item 186). Read where
                             // the kernel's source is written, once a process (its name does not carry
                             // it): an A/B across processes (KILN_TUNE_ATTENTION_ORDER)
  int attention_softmax = -1;  // the Hopper forwards' online softmax: by default (or 1) each tile's max over
                               // the raw scores and the scale inside the exponent's FFMA, with tree
                               // reductions, where the scale is positive (codegen/attention_kernel_sm90.hpp's
                               // softmax_tile; NOTES item 178); 0 scales every score first, one chain a
                               // row (the rule before). Read where the kernel's source is written, once a
                               // process (KILN_TUNE_ATTENTION_SOFTMAX)
  int attention_keys = -1;     // the Hopper producer forward's key rows a tile at head dim 64: 192 (FlashAttention-3's
                               // non-causal tile; NOTES item 179) or 128 (the default). Read where the kernel
                               // is chosen (codegen/attention_kernel.hpp's hopper; KILN_TUNE_ATTENTION_KEYS)
  int attention_idle_warpgroups = -1;  // the Hopper producer forward's consumer warpgroups whose query rows all
                                       // lie past Tq (the last query tile where Tq is not a multiple of the
                                       // block's rows, as 1024 of three warpgroups' 192): default (or 1) they
                                       // only keep their turns and releases
                                       // (codegen/attention_kernel_sm90_pingpong.hpp; NOTES items 182, 185); 0
                                       // they run every tile as the others do (the rule before). Read where
                                       // the kernel's source is written, once a process
                                       // (KILN_TUNE_ATTENTION_IDLE_WARPGROUPS)
  int attention_uniform = -1;          // the Hopper attention kernels: each thread's warpgroup index is lane
                                       // 0's, broadcast, so that ptxas keeps what derives from it in uniform
                                       // registers (codegen/attention_kernel_sm90.hpp's wgmma_prelude; NOTES
                                       // items 184, 185): by default in the forwards only, 1 in the backwards
                                       // too, 0 nowhere (threadIdx.x / 128, the rule before). Read where the
                                       // kernels' source is written, once a process
                                       // (KILN_TUNE_ATTENTION_UNIFORM)
  int attention_copies = -1;           // the Hopper attention kernels' cp.async copies into swizzled tiles: by
                                       // default (or 1) each thread walks one chunk column's rows, its
                                       // addresses advanced by constants (a few instructions a copy; NOTES
                                       // item 190); 0 each copy's row and column recomputed from a running
                                       // index (about 38 instructions a copy, the rule before). Read where the
                                       // kernels' source is written, once a process (KILN_TUNE_ATTENTION_COPIES)
  int attention_tma = -1;              // the Hopper attention forwards fed by a producer warpgroup: by default
                                       // (or 1) its thread 0 loads each tile by TMA (cp.async.bulk.tensor, tensor
                                       // maps the launcher encodes; NOTES item 191) where the operands allow
                                       // a map, else the cp.async copies; 0 its 128 threads' cp.async copies
                                       // (the rule before). Read where the kernel is chosen, once a process
                                       // (KILN_TUNE_ATTENTION_TMA)
  int attention_wave = -1;             // the Hopper forward where its query tiles fit one wave of blocks: 1
                                       // the two-warpgroup kernel, a tile a block, wherever its 128-row tiles
                                       // number no more than the SMs (looping buys nothing in one wave, and
                                       // the three-warpgroup kernel's 192-row tiles leave SMs idle: NOTES
                                       // item 192, not yet run on a GPU); default (or 0) the rules' kernel
                                       // whatever the size. Read once a process (KILN_TUNE_ATTENTION_WAVE)
  int attention_bwd_tma = -1;          // the Hopper attention backwards (dq, dk/dv, dq/dk/dv): 1 thread 0
                                       // loads each tile by TMA, each stage landing on an mbarrier (NOTES item
                                       // 193, not yet run on a GPU), where the operands allow a map; default
                                       // (or 0) every thread's cp.async copies. Read where the kernel is
                                       // chosen, once a process (KILN_TUNE_ATTENTION_BACKWARD_TMA)
  int attention_dq = -1;     // the fused attention backward on Hopper where q, k and v have one shape: 0
                             // dq in a kernel of its own, 1 dq's sums added with atomic reductions by
                             // the dk/dv kernel, which has dS already (attention_backward_kernel_sm90.hpp's
                             // dqkv); default: 1 where the registers hold it (graph/infer_attention.hpp's
                             // fused_attention_joins_dq: D 64; KILN_TUNE_ATTENTION_DQ)
  int one_pass = -1;       // looped rows: a sum that reads an earlier reduction of the same row only
                           // through a row value D (sum((x - D)^2), sum(exp(x - D))) is carried beside
                           // it in one pass (Welford, online softmax); 0 two passes (the rule before),
                           // 1 wherever it applies (default: GPU rows of 4-byte values or wider;
                           // KILN_TUNE_ONE_PASS)
  int row_split = -1;      // rows of a length no whole number of vectors (host rows, GPU rows of symbolic
                           // length): 0 tests every lane of every step (the rule before); default
                           // loops over the whole vectors unmasked, then the vector with the end
                           // (KILN_TUNE_ROW_SPLIT)
  int row_smem = -1;       // looped GPU rows of static length read by several loops: the shared memory a
                           // block may keep their tiles in (the first loop stores them, later loops
                           // read them there, not from memory again; a longer row keeps its first
                           // tiles); 1 half an SM's (two blocks an SM), more: at most that many
                           // bytes, 0 none; default: only rows whose tiles all fit half an SM's
                           // (row_smem_whole; rows kept in part measured slower, and a whole 201 KB
                           // row, one block an SM, slower than two passes over memory:
                           // benchmarks/NOTES.md items 105, 108, 109; KILN_TUNE_ROW_SMEM)
  int row_smem_whole = 0;  // where row_smem is the default: the bytes a block may keep whole rows in,
                           // resolved by planning from the device (half an SM's less 2 KiB; 0 where no
                           // driver answers). Not a knob: merged() keeps it and str() leaves it out
  int wide_rows = -1;      // 1: static GPU rows too long for 512 threads to hold are held by 1024
                           // (codegen's wide_rows); off by default: layer_norm and rms_norm over
                           // 50257 f32 columns ran 1.24x and 1.45x faster, cross_entropy's value
                           // and gradient 1.28x slower (benchmarks/NOTES.md item 106;
                           // KILN_TUNE_WIDE_ROWS)
  int row_prefetch = -1;   // GPU rows of static length held in registers: 0 loads each cached tile where
                           // the first loop uses it (the rule before); default caches of 4-byte values
                           // loaded by a loop of their own before it, all of a row's loads in flight
                           // at once (ptxas had interleaved rms_norm's with their squares: one tile in
                           // flight; codegen's prefetched, benchmarks/NOTES.md item 168;
                           // KILN_TUNE_ROW_PREFETCH)
  int held_weights = -1;   // held GPU rows whose weights live in registers: 0 keeps them there (the
                           // rule before); default: written again with them in shared memory where
                           // ptxas left the compiled kernel fewer blocks an SM than its bound asked
                           // for (runtime/refit_held_rows.hpp's share_held_weights, benchmarks/NOTES.md item
                           // 171; KILN_TUNE_HELD_WEIGHTS)
  int live_tiles = -1;     // GPU rows: 0 tests every lane of a held row of symbolic length and the
                           // row of each one-row block at a symbolic number of rows (the rule
                           // before); default: the tiles inside the compiling call's length and the
                           // rows an unshifted one-row block visits are known live, the kernel
                           // serving lengths from those tiles' end up and a held twin with the
                           // tiles inside every length it serves the lengths below (NOTES item
                           // 175); 1 the tiles inside every served length only, 2 every one-row
                           // block's rows only, 3 both, 4 the tiles inside every served length and
                           // an unshifted one-row block's rows (item 173's rule, the default
                           // before; KILN_TUNE_LIVE_TILES)
  int shifted_row_test = -1;  // 1: a static GPU kernel's one-row blocks over shifted rows test their
                              // row (`xmask = xindex < xnumel`) as their dynamic twins do; default
                              // `xmask = true`: the test made log_softmax over 3073 bf16 columns
                              // 0.85x and over 50257 1.64x (benchmarks/NOTES.md item 174;
                              // KILN_TUNE_SHIFTED_ROW_TEST)
  int fuller_twins = -1;      // 1: a held GPU row of symbolic length whose chain's middle twin (NOTES item
                              // 175) holds more blocks an SM than the kernel compiled with the live tiles
                              // of the compiling call's length gives way to it (runtime/refit_held_rows.hpp's
                              // keep_fuller_twins; rms_norm over 3073 bf16 columns: 105 against 91
                              // registers, 9 against 10 blocks of 64 threads, 1.06-1.08x slower; NOTES
                              // item 177; KILN_TUNE_FULLER_TWINS). Default off
  int spill_floor = -1;       // GPU rows: the stack frame in bytes a held-row kernel may reach before
                              // runtime/refit_held_rows.hpp's loop_spilled_rows weighs writing it looped
                              // (launch_config.hpp's held_row_spills); default min_spill_bytes (256), above
                              // ptxas's own small arrays. A frame of exactly 256 bytes (340 of spill
                              // stores) at one block an SM stayed held, 1.5x slower than looped
                              // (benchmarks/NOTES.md item 174; KILN_TUNE_SPILL_FLOOR)
  int tile_stores = -1;    // GPU rows of 16-bit values, unshifted: a tile all of whose lanes are in the
                           // row but which starts off a vector is stored element by element without
                           // a test a lane (the prelude's align::tile); 0 tests each lane (the rule
                           // before; benchmarks/NOTES.md item 172; KILN_TUNE_TILE_STORES)
  int row_scalars = -1;    // rows: a load the same for every lane of a row's tile (cross_entropy's target,
                           // a norm backward's mean and rstd) read as one scalar under the row's
                           // mask, not lane by lane (1); default lane by lane: the host's cross_entropy
                           // did not move, the GPU's is to be measured (benchmarks/NOTES.md item 107;
                           // KILN_TUNE_ROW_SCALARS)
  int epilogue = -1;       // a matmul's bias and activation become cuBLASLt epilogues where the
                           // pattern matches (0 keeps them in the fused pointwise kernel; GPT-2: 19.4
                           // against 19.6 ms a step, benchmarks/NOTES.md); 1 with item 153's DGELU
                           // and BGRAD; 2 the forward's only; 3 DGELU without BGRAD (the default:
                           // BGRAD cost GPT-2's step 6%, NOTES item 164; KILN_TUNE_EPILOGUE)

  // A field, named through an alias (nvcc's host pass writes `int Tuning::*f[]` with parentheses
  // that g++ then warns about).
  using Field = int Tuning::*;
  // The candidate fields in order: what autotuning's stored choice holds (its disk format).
  static constexpr Field fields[] = {&Tuning::poi_threads, &Tuning::poi_vectors, &Tuning::row_elems,
                                     &Tuning::row_block,   &Tuning::row_unroll,  &Tuning::hoist,
                                     &Tuning::loads,       &Tuning::waves,       &Tuning::partial_rows};
  // Every field with its name, as str() prints it.
  struct Knob {
    Field field;
    const char* name;
  };
  static constexpr Knob knobs[] = {{&Tuning::poi_threads, "threads"},
                                   {&Tuning::poi_vectors, "vectors"},
                                   {&Tuning::row_elems, "row_elems"},
                                   {&Tuning::row_block, "row_block"},
                                   {&Tuning::row_unroll, "unroll"},
                                   {&Tuning::hoist, "hoist"},
                                   {&Tuning::loads, "loads"},
                                   {&Tuning::waves, "waves"},
                                   {&Tuning::poi_unroll, "poi_unroll"},
                                   {&Tuning::row_threads, "row_threads"},
                                   {&Tuning::row_iters, "row_iters"},
                                   {&Tuning::row_slots, "row_slots"},
                                   {&Tuning::aligned, "aligned"},
                                   {&Tuning::prelude_loads, "prelude_loads"},
                                   {&Tuning::partials, "partials"},
                                   {&Tuning::partial_rows, "partial_rows"},
                                   {&Tuning::matmul_t, "matmul_t"},
                                   {&Tuning::matmul_wide, "matmul_wide"},
                                   {&Tuning::gemm_room, "gemm_room"},
                                   {&Tuning::realize, "realize"},
                                   {&Tuning::epilogue, "epilogue"},
                                   {&Tuning::row_tiling, "row_tiling"},
                                   {&Tuning::row_cache, "row_cache"},
                                   {&Tuning::vector_masks, "vector_masks"},
                                   {&Tuning::transpose, "transpose"},
                                   {&Tuning::keep_values, "keep_values"},
                                   {&Tuning::column_lanes, "column_lanes"},
                                   {&Tuning::column_rows, "column_rows"},
                                   {&Tuning::aligned_sizes, "aligned_sizes"},
                                   {&Tuning::attention, "attention"},
                                   {&Tuning::attention_rows, "attention_rows"},
                                   {&Tuning::attention_backward, "attention_backward"},
                                   {&Tuning::attention_wgmma, "attention_wgmma"},
                                   {&Tuning::attention_order, "attention_order"},
                                   {&Tuning::attention_dq, "attention_dq"},
                                   {&Tuning::attention_softmax, "attention_softmax"},
                                   {&Tuning::attention_keys, "attention_keys"},
                                   {&Tuning::attention_idle_warpgroups, "attention_idle_warpgroups"},
                                   {&Tuning::attention_uniform, "attention_uniform"},
                                   {&Tuning::attention_copies, "attention_copies"},
                                   {&Tuning::attention_tma, "attention_tma"},
                                   {&Tuning::attention_wave, "attention_wave"},
                                   {&Tuning::attention_bwd_tma, "attention_bwd_tma"},
                                   {&Tuning::occupancy, "occupancy"},
                                   {&Tuning::row_shift, "row_shift"},
                                   {&Tuning::index32, "index32"},
                                   {&Tuning::one_pass, "one_pass"},
                                   {&Tuning::row_split, "row_split"},
                                   {&Tuning::row_smem, "row_smem"},
                                   {&Tuning::wide_rows, "wide_rows"},
                                   {&Tuning::row_scalars, "row_scalars"},
                                   {&Tuning::row_prefetch, "row_prefetch"},
                                   {&Tuning::held_weights, "held_weights"},
                                   {&Tuning::tile_stores, "tile_stores"},
                                   {&Tuning::live_tiles, "live_tiles"},
                                   {&Tuning::shifted_row_test, "shifted_row_test"},
                                   {&Tuning::spill_floor, "spill_floor"},
                                   {&Tuning::fuller_twins, "fuller_twins"}};

  // The KILN_TUNE_* variables set now, each clamped to its range.
  static Tuning from_environment() {
    struct Var {
      Field field;
      const char* name;
      std::int64_t lo, hi;
    };
    constexpr std::int64_t any = std::int64_t{1} << 30;
    static constexpr Var vars[] = {{&Tuning::poi_threads, "KILN_TUNE_POI_THREADS", 32, 1024},
                                   {&Tuning::poi_unroll, "KILN_TUNE_POI_UNROLL", 0, 16},
                                   {&Tuning::row_elems, "KILN_TUNE_ROW_ELEMS", 0, any},
                                   {&Tuning::row_threads, "KILN_TUNE_ROW_THREADS", 32, 1024},
                                   {&Tuning::row_iters, "KILN_TUNE_ROW_ITERS", 0, any},
                                   {&Tuning::row_block, "KILN_TUNE_ROW_BLOCK", 32, 1024},
                                   {&Tuning::row_unroll, "KILN_TUNE_ROW_UNROLL", 1, 8},
                                   {&Tuning::hoist, "KILN_TUNE_HOIST", 0, 2},
                                   {&Tuning::row_slots, "KILN_TUNE_ROW_SLOTS", 0, 1},
                                   {&Tuning::aligned, "KILN_TUNE_ALIGNED", 0, 1},
                                   {&Tuning::waves, "KILN_TUNE_ROW_WAVES", 0, 1024},
                                   {&Tuning::prelude_loads, "KILN_TUNE_LOADS", 0, 2},
                                   {&Tuning::partials, "KILN_TUNE_PARTIALS", 0, 2},
                                   {&Tuning::partial_rows, "KILN_TUNE_PARTIAL_ROWS", 1, 32},
                                   {&Tuning::matmul_t, "KILN_TUNE_MATMUL_T", 0, 1},
                                   {&Tuning::matmul_wide, "KILN_TUNE_MATMUL_WIDE", 0, 1},
                                   {&Tuning::gemm_room, "KILN_TUNE_GEMM_ROOM", 0, 1},
                                   {&Tuning::realize, "KILN_TUNE_REALIZE", 0, 1},
                                   {&Tuning::epilogue, "KILN_TUNE_EPILOGUE", 0, 3},
                                   {&Tuning::row_tiling, "KILN_TUNE_ROW_TILING", 0, 1},
                                   {&Tuning::row_cache, "KILN_TUNE_ROW_CACHE", 0, any},
                                   {&Tuning::vector_masks, "KILN_TUNE_VECTOR_MASKS", 0, 2},
                                   {&Tuning::transpose, "KILN_TUNE_TRANSPOSE", 0, 128},
                                   {&Tuning::keep_values, "KILN_TUNE_KEEP_VALUES", 0, 1},
                                   {&Tuning::column_lanes, "KILN_TUNE_COLUMN_LANES", 0, 2},
                                   {&Tuning::column_rows, "KILN_TUNE_COLUMN_ROWS", 0, 1},
                                   {&Tuning::aligned_sizes, "KILN_TUNE_ALIGNED_SIZES", 0, 1},
                                   {&Tuning::occupancy, "KILN_TUNE_OCCUPANCY", 0, 2048},
                                   {&Tuning::row_shift, "KILN_TUNE_ROW_SHIFT", 0, 2},
                                   {&Tuning::index32, "KILN_TUNE_INDEX32", 0, 1},
                                   {&Tuning::one_pass, "KILN_TUNE_ONE_PASS", 0, 1},
                                   {&Tuning::row_split, "KILN_TUNE_ROW_SPLIT", 0, 1},
                                   {&Tuning::row_smem, "KILN_TUNE_ROW_SMEM", 0, any},
                                   {&Tuning::wide_rows, "KILN_TUNE_WIDE_ROWS", 0, 1},
                                   {&Tuning::row_scalars, "KILN_TUNE_ROW_SCALARS", 0, 1},
                                   {&Tuning::row_prefetch, "KILN_TUNE_ROW_PREFETCH", 0, 1},
                                   {&Tuning::held_weights, "KILN_TUNE_HELD_WEIGHTS", 0, 1},
                                   {&Tuning::tile_stores, "KILN_TUNE_TILE_STORES", 0, 1},
                                   {&Tuning::live_tiles, "KILN_TUNE_LIVE_TILES", 0, 4},
                                   {&Tuning::shifted_row_test, "KILN_TUNE_SHIFTED_ROW_TEST", 0, 1},
                                   {&Tuning::spill_floor, "KILN_TUNE_SPILL_FLOOR", 0, 65536},
                                   {&Tuning::fuller_twins, "KILN_TUNE_FULLER_TWINS", 0, 1},
                                   {&Tuning::dynamic_rows, "KILN_TUNE_DYNAMIC_ROWS", 0, 2},
                                   {&Tuning::attention, "KILN_TUNE_ATTENTION", 0, 8},
                                   {&Tuning::attention_rows, "KILN_TUNE_ATTENTION_ROWS", 1, 2},
                                   {&Tuning::attention_backward, "KILN_TUNE_ATTENTION_BACKWARD", 0, 1},
                                   {&Tuning::attention_wgmma, "KILN_TUNE_ATTENTION_WGMMA", 0, 6},
                                   {&Tuning::attention_order, "KILN_TUNE_ATTENTION_ORDER", 0, 2},
                                   {&Tuning::attention_softmax, "KILN_TUNE_ATTENTION_SOFTMAX", 0, 1},
                                   {&Tuning::attention_keys, "KILN_TUNE_ATTENTION_KEYS", 128, 192},
                                   {&Tuning::attention_idle_warpgroups, "KILN_TUNE_ATTENTION_IDLE_WARPGROUPS", 0, 1},
                                   {&Tuning::attention_uniform, "KILN_TUNE_ATTENTION_UNIFORM", 0, 1},
                                   {&Tuning::attention_copies, "KILN_TUNE_ATTENTION_COPIES", 0, 1},
                                   {&Tuning::attention_tma, "KILN_TUNE_ATTENTION_TMA", 0, 1},
                                   {&Tuning::attention_wave, "KILN_TUNE_ATTENTION_WAVE", 0, 1},
                                   {&Tuning::attention_bwd_tma, "KILN_TUNE_ATTENTION_BACKWARD_TMA", 0, 1},
                                   {&Tuning::attention_dq, "KILN_TUNE_ATTENTION_DQ", 0, 1}};
    Tuning t;
    for (const auto& v : vars)
      if (auto value = config::env_int(v.name, v.lo, v.hi)) t.*v.field = static_cast<int>(*value);
    return t;
  }

  std::string str() const {
    std::string s;
    for (const auto& k : knobs)
      if (this->*k.field >= 0) s += (s.empty() ? "" : " ") + std::string(k.name) + "=" + std::to_string(this->*k.field);
    return s.empty() ? "default" : s;
  }
  // This tuning with the fields `over` sets replaced (a candidate over the environment; a
  // neighbour of a winner, in autotuning).
  Tuning merged(const Tuning& over) const {
    Tuning t = *this;
    for (const auto& k : knobs)
      if (over.*k.field >= 0) t.*k.field = over.*k.field;
    return t;
  }
  bool operator==(const Tuning&) const = default;
};

}  // namespace kiln
