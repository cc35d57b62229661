// Code generation: writes one kernel plan as a readable block program, the way Inductor writes
// Triton: program ids, xindex/rindex tiles, xmask/rmask, tmp0.. one statement a line. Index
// arithmetic is symbolic (ir/sym.hpp), so static and dynamic sizes go through one path.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../ir/shape_env.hpp"
#include "../schedule/fuse.hpp"
#include "c_text.hpp"
#include "launch_config.hpp"

namespace kiln::codegen {

// One parameter of a generated kernel, in signature order.
struct Param {
  enum Kind { in_ptr, out_ptr, scalar, size } kind;
  int ref;         // in/out: node id; scalar: slot; size: symbol id
  kiln::dtype dt;  // buffers: element dtype
  std::string name;
};

// The elements a buffer, domain or node may hold for a kernel's index arithmetic to be int.
inline constexpr std::int64_t index32_limit = std::int64_t{1} << 30;

struct KernelSource {
  std::string name;
  schedule::Kind kind;
  std::string source;  // the block program (without the prelude)
  std::vector<Param> params;
  Sym xnumel, rnumel;  // iteration sizes, for the launch grid
  LaunchConfig config;
  Tuning tuning;                    // what an autotuning candidate set (default: the rules' choices)
  std::int64_t partial_groups = 0;  // row kernels with column partials: exactly this many programs
  bool column = false;              // rows reduced over outer dims (a thread, or a host lane, a kept element)
  std::vector<std::string> fused_ops;
  // Int indices that hold while the sizes keep index_nodes' element counts within index32_limit and
  // index_span's product below 2^31 (the program guards them: guards::within_index_limit).
  bool index_bound = false;
  std::vector<int> index_nodes;
  std::pair<Sym, Sym> index_span{Sym(0), Sym(0)};
  // A GPU row of symbolic length held in registers, its tiles sized at the compiling call's length:
  // the kernel serves calls whose held_rnumel lies in [held_min, held_max] (right up to the tiles'
  // capacity, worth it while it fills more than half of them) and is a multiple of held_multiple
  // (whole vectors: one mask test a vector, as at static lengths); the program launches the same
  // kernel written looped for other lengths (runtime's CompiledKernel::looped). held_max 0: none.
  Sym held_rnumel{Sym(0)};
  std::int64_t held_min = 0, held_max = 0, held_multiple = 1;
  // Where a held GPU row's row-invariant loads (weights) live: 0 none hoisted, 1 registers, 2 shared
  // memory. The runtime may write a kernel of 1 again as 2 (runtime/refit_held_rows.hpp's share_held_weights).
  int hoisted_weights = 0;
  // Sizes this kernel assumed multiples of assumed_by (Assumptions below); empty: none.
  std::vector<Sym> assumed_multiples;
  std::int64_t assumed_by = 1;
};

// Whether a call with these symbol values may launch kernel s (KernelSource::held_rnumel,
// assumed_multiples), else the program launches its looped, unassuming twin.
inline bool serves(const KernelSource& s, Bindings sizes) {
  for (const Sym& m : s.assumed_multiples)
    if (m.eval(sizes) % s.assumed_by != 0) return false;
  if (s.held_max <= 0) return true;
  const std::int64_t n = s.held_rnumel.eval(sizes);
  return n >= s.held_min && n <= s.held_max && n % s.held_multiple == 0;
}
inline bool specialised(const KernelSource& s) { return s.held_max > 0 || !s.assumed_multiples.empty(); }

// GPU kernels over symbolic sizes: sizes whose value at the compiling call is a multiple of the
// kernel's vector (`by`) are taken as multiples of it where that lets a tile move whole (a
// division or remainder by the size, an offset that stays aligned), as Triton specialises integer
// arguments divisible by 16; `used` records those the kernel relied on (its launches test them).
struct Assumptions {
  const std::vector<std::int64_t>* example = nullptr;  // symbol id -> its value at the compiling call
  std::int64_t by = 0;                                 // 0: none taken
  mutable std::vector<Sym> used;
  bool take(const Sym& s, std::int64_t m) const {
    if (!example || by <= 0 || by % m != 0 || s.kind() != SymKind::symbol) return false;
    const int id = s.symbol_id();
    if (id < 0 || id >= static_cast<int>(example->size())) return false;
    const std::int64_t v = (*example)[static_cast<std::size_t>(id)];
    if (v <= 0 || v % by != 0) return false;
    if (std::find(used.begin(), used.end(), s) == used.end()) used.push_back(s);
    return true;
  }
};

// Whether e is a multiple of m for every tile (defined in kernel_writer_access.hpp).
inline bool multiple_of(const Sym& e, std::int64_t m, int start, std::int64_t vec, const Assumptions* a = nullptr);

// Writes one kernel. `strides_of(node)` gives the symbolic strides of a buffer (args may be
// strided; intermediates are contiguous).
class KernelWriter {
 public:
  using StridesOf = std::function<std::vector<Sym>(int)>;

  KernelWriter(const graph::Graph& g, const schedule::Schedule& s, const ir::ShapeEnv& env, int kernel, Target target,
               StridesOf strides_of, Tuning tune = {})
      : g_(g),
        s_(s),
        env_(env),
        k_(kernel),
        plan_(s.kernels[kernel]),
        target_(target),
        strides_of_(std::move(strides_of)),
        tune_(tune) {}

  // Whether the kernel can be written as planned: a row kernel asked to keep column partial sums
  // must hold its row in registers under its launch config (not so for long rows on the CPU, some
  // tuning candidates and KILN_TUNE_* knobs). The planner plans without partials where this is
  // false (runtime/lower.hpp); autotuning leaves such a candidate out.
  bool holds_partials();
  bool narrow_indices();  // index arithmetic in int (kernel_writer_impl.hpp)
  bool index_bound_ = false;  // ... at the compiling call's symbolic sizes (the program guards them)
  void note_index_bound(KernelSource& ks) const;
  KernelSource write();

 private:
  using Value = detail::CValue;

  // The parts of a kernel's body, written separately and joined in this order by write(), with
  // the row-invariant loads (hoist_row_invariants) before the row loop and the row's register
  // caches (found while writing the loop's body) at its top.
  // Tiled pointwise kernels (kernel_writer_tiles.hpp) use row_open for the tile loop's head and
  // stage for the staging pass.
  enum class Section { before_rows, row_open, stage, body, count };

  bool rows() const { return plan_.kind != schedule::Kind::poi; }
  void line(const std::string& s) {
    sections_[static_cast<int>(section_)] << std::string(indent_ * 2, ' ') << s << "\n";
  }
  std::string section(Section s) const { return sections_[static_cast<int>(s)].str(); }
  std::string fresh() { return "tmp" + std::to_string(tmp_++); }
  std::string mask() const { return in_rloop_ ? "rmask" : "xmask"; }
  // A load's mask: the tile's, and the positions a view above it left out (`xm`: a padded split's
  // rows past the input, a slice gradient's zeros). Indexed loads (a gather's, an embedding's) need
  // it too: their ids read as 0 there, but the base row may lie past the source.
  std::string load_mask(const std::string& xm) const { return xm.empty() ? mask() : "(" + mask() + " & " + xm + ")"; }

  Value cast(const Value& v, kiln::dtype to) { return detail::cast_value(v, to); }
  Value bind(const std::string& expr, kiln::dtype ct) {
    std::string n = fresh();
    line("auto " + n + " = " + expr + ";");
    return {n, compute_dtype(ct)};
  }
  // A tile held in a row's array, named without a copy on the host: GCC copied a 64-byte tile
  // through the stack in 16-byte pieces that its vector reads then could not forward (NOTES 70).
  Value bind_held(const std::string& element, kiln::dtype ct) {
    if (target_ != Target::cpu) return bind(element, ct);
    std::string n = fresh();
    line("const auto& " + n + " = " + element + ";");
    return {n, compute_dtype(ct)};
  }

  std::string param_for(int node, bool out) {
    auto& list = out ? outs_ : ins_;
    auto it = list.find(node);
    if (it != list.end()) return it->second;
    std::string n = (out ? "out_ptr" : "in_ptr") + std::to_string(list.size());
    list[node] = n;
    params_.push_back({out ? Param::out_ptr : Param::in_ptr, node, g_[node].dt, n});
    return n;
  }
  std::string scalar_param(int slot) {
    // Named in order of use, not by the program's slot: a kernel's source does not depend on where
    // in the program it sits (runtime/compile/kernel_units.hpp compiles equal sources once).
    if (auto it = scalars_.find(slot); it != scalars_.end()) return it->second;
    std::string n = "sc" + std::to_string(scalars_.size());
    scalars_[slot] = n;
    params_.push_back({Param::scalar, slot, kiln::dtype::f64, n});
    return n;
  }
  std::string index_code(const Sym& e) {
    for (auto& sym : e.free_symbols()) note_symbol(sym);
    return e.c_expr();
  }
  void note_symbol(const Sym& sym) {
    if (sym.symbol_id() < env_.num_symbols() && !sizes_.count(sym.symbol_id())) {
      sizes_[sym.symbol_id()] = sym.symbol_name();
      params_.push_back({Param::size, sym.symbol_id(), kiln::dtype::i64, sym.symbol_name()});
    }
  }

  // The lanes of the code being written, where they are an aligned run of one index symbol: that
  // symbol, its tile's first value and the run's length (kernel_writer_access.hpp).
  struct LaneTile {
    Sym lane, first;
    std::int64_t vec;
  };
  std::optional<LaneTile> lane_tile() const;
  bool uniform_on_lanes(const Sym& rel, const Sym& count) const;
  std::string at_first_lane(const Sym& e);

  Value load(int node, const std::vector<Sym>& idx, const std::string& extra_mask);
  std::optional<Value> kept_row_load(int node, const std::string& code, kiln::dtype ct);
  Value emit(int node, const std::vector<Sym>& idx, const std::string& extra_mask = "");
  Value emit_uncached(int node, const std::vector<Sym>& idx, const std::string& extra_mask);
  std::vector<Sym> broadcast_index(int child, int parent, const std::vector<Sym>& idx);
  std::vector<Sym> view_index(int node, const std::vector<Sym>& idx);
  Sym slice_start(int node, const Dims& sliced);
  Sym slice_step(int node);
  std::vector<Sym> domain_index();
  std::vector<Sym> row_index(int node);
  void store(int node, const std::vector<Sym>& idx);
  void write_pointwise();
  void write_rows();
  bool open_partials();                 // column partials before the rows (kernel_writer_partials.hpp)
  void store_partials(bool in_memory);  // ... and after them
  void open_column_program(bool by_cols, bool lane_split);  // reductions over outer dims (kernel_writer_outer.hpp)
  void write_lane_halves(const std::function<void()>& body, bool by_cols, const std::map<int, Value>& reduced_before);
  void choose_tiling(int max_item);
  std::vector<Sym> tiled_index();
  void write_tiled();
  void choose_col_tiles();  // host rows by column tiles (kernel_writer_columns.hpp)
  std::vector<Sym> col_index();
  void write_col_tiles();
  std::optional<Value> staged_load(int node, const Sym& offset);
  std::string reduction_identity(Op op, kiln::dtype ct);
  bool depends_on_any(int red, std::size_t i, std::size_t j);
  bool reads_any(int node, std::size_t i, std::size_t j);
  // Whether a walk up from `node` through the values this kernel computes (stopping at arguments and
  // other kernels' buffers, which it visits) meets a node for which hit(v) holds.
  template <class Hit> bool reaches(int node, Hit hit) {
    std::vector<int> stack = {node};
    std::vector<bool> seen(g_.size(), false);
    while (!stack.empty()) {
      int v = stack.back();
      stack.pop_back();
      if (seen[v]) continue;
      seen[v] = true;
      if (hit(v)) return true;
      if (g_[v].op == Op::arg || (s_.realized[v] && s_.kernel_of[v] != k_)) continue;
      for (int c = 0; c < g_[v].n_in; ++c) stack.push_back(g_[v].in[c]);
    }
    return false;
  }
  // A sum carried in the loop of the reductions it reads (kernel_writer_impl.hpp's one_pass_form):
  // sum(square(a - d)) or sum(exp(a - d)), `a` reading none of them, `d` a row value.
  struct OnePass {
    enum Kind { none, squares, exps } kind = none;
    int a = -1, d = -1, sub = -1;
    std::vector<std::string> accs;  // the lanes' summary (Welford's n, mean, m2; the max and sum)
  };
  OnePass one_pass_form(int red, std::size_t i, std::size_t j);  // (kernel_writer_one_pass.hpp)
  std::int64_t row_bytes_read(int node);
  bool reads_reduction_of(int node, Op op, int a, std::size_t i, std::size_t j);
  void declare_one_pass(OnePass& p, const std::string& acc, kiln::dtype ct);
  void step_one_pass(const OnePass& p, const std::vector<Sym>& idx, kiln::dtype ct);
  Value reduce_one_pass(const OnePass& p, const std::vector<Sym>& idx, int red);
  std::string access_base(const Sym& offset, const std::string& ptr, kiln::dtype dt, std::string& width);
  std::string split_on_alignment(const std::string& body);  // (kernel_writer_alignment.hpp)
  bool aligned_at_sizes(const Sym& base, std::int64_t m, int start, std::int64_t vec);
  void plan();

  const graph::Graph& g_;
  const schedule::Schedule& s_;
  const ir::ShapeEnv& env_;
  int k_;
  const schedule::KernelPlan& plan_;
  Target target_;
  StridesOf strides_of_;
  Tuning tune_;
  bool planned_ = false;
  KernelSource ks_;  // what plan() decided: name, kind, launch config, tuning
  std::ostringstream sections_[static_cast<int>(Section::count)];
  Section section_ = Section::body;
  int indent_ = 1, tmp_ = 0;
  bool in_rloop_ = false;
  Sym xindex_, rindex_, xnumel_{1}, rnumel_{1};
  LaunchConfig config_;
  std::map<std::string, std::string> row_cache_;  // load code -> register array holding it
  std::vector<std::string> cache_decls_;
  // Looped GPU rows read by several loops: load code -> the row's tiles in shared memory (the
  // array, how many of the row's tiles it keeps, whether all), and the bytes a block keeps
  // (kernel_writer_access.hpp's kept_row_load).
  struct KeptRow {
    std::string name;
    std::int64_t cells;
    bool whole;
  };
  std::map<std::string, KeptRow> kept_rows_;
  std::vector<int> later_reads_;  // the values the loops after the one being written read (write_rows)
  std::int64_t kept_row_bytes_ = 0;
  std::int64_t cached_cost_ = 0;  // what a value of the register caches costs, summed (launch_config.hpp)
  bool final_loop_ = false;
  std::map<std::string, std::string> column_cache_;  // row-invariant loads hoisted before the rows
  std::vector<kiln::dtype> column_types_;            // their compute types, in order (weights0, weights1, ...)
  std::vector<std::string> column_loads_;
  // Where row-invariant loads are kept: 0 reloaded in the row loop, 1 registers, 2 shared memory
  // (one copy a block). Measured on an H200: registers for blocks of several rows (layer_norm),
  // reloaded for rows of their own block (rms_norm on bf16): benchmarks/NOTES.md items 22, 30, 33.
  // A Tuning's hoist (KILN_TUNE_HOIST, an autotuning candidate) sets the mode.
  int hoist_mode() const { return codegen::hoist_mode(tune_, config_.rows); }
  // Whether a kernel's reductions get a shared slot each (one barrier a reduction instead of two);
  // a Tuning's row_slots = 0 (KILN_TUNE_ROW_SLOTS=0) turns it off.
  bool row_slots() const { return tune_.row_slots != 0; }
  // Whether a row-uniform load in a row's loop is one scalar (KILN_TUNE_ROW_SCALARS=1; off by
  // default: no change measured on the host, not yet run on a GPU; benchmarks/NOTES.md item 107).
  bool row_scalars() const { return tune_.row_scalars == 1; }
  std::string hoist_row_invariants(std::string& signature) const;
  bool weights_shared() const;  // the hoisted weights go to shared memory (hoist_row_invariants)
  std::map<int, std::string> ins_, outs_, scalars_, sizes_;
  std::map<int, Value> reduced_;  // in-kernel reduction results (per row)
  int accumulators_ = 0;
  std::vector<Param> params_;
  bool plain_loads_ = false;  // 16-byte loads via::plain (a kernel evaluating special functions)
  std::string load_via(std::string width) const;
  std::vector<std::string> aligned_ptrs_;  // pointers whose tiles are vector-aligned when they are
  bool unaligned_tiles_ = false;           // some contiguous tile may start off a vector
  // Program sizes that must be multiples of a vector's elements for every tile to start on one
  // (Tuning::aligned_sizes): the kernel tests them once, beside its pointers' alignment.
  std::vector<std::pair<Sym, std::int64_t>> aligned_sizes_;
  bool exact_tiles_ = false;               // the tiles cover the domain: no bounds tests (plan())
  bool full_rows_ = false;                 // rows: programs hold whole groups of rows
  bool full_tiles_ = false;                // rows: register tiles cover a row exactly
  bool vector_rows_ = false;               // rows: the row length is a multiple of the vector
  // GPU rows of symbolic length held in registers: served only at lengths of whole vectors (the
  // launch tests it, KernelSource::held_multiple, as Triton specialises sizes divisible by 16).
  bool dyn_vector_rows_ = false;
  int live_tiles_ = 0;               // GPU rows of symbolic length held: leading tiles inside every length served
  bool dyn_held_unshifted_ = false;  // GPU rows of symbolic length held in registers, unshifted
  Assumptions assumed_;  // GPU kernels over symbolic sizes (plan())
  bool row_shift_ = false;                 // GPU rows: tiles start on the vector before the row (plan())
  bool rows_on_vectors_ = false;           // GPU rows: every full-size array's rows start on a vector (plan())
  bool shifted_weights_ = false;           // ... and the row reads weights (plan())
  // Host rows whose loops' rmask is all true by construction (whole programs of rows, whole tiles).
  // GPU column reductions split down the reduced elements too (launch_config.hpp's column blocks).
  bool column_block() const { return target_ == Target::cuda && config_.x_lanes && config_.row_threads > 1; }
  bool host_rows_unmasked() const {
    return target_ == Target::cpu && (unmasked_part_ || whole_lanes_ ||
                                      (full_rows_ && !col_tiles_ && (config_.x_lanes || full_tiles_ ||
                                                      (vector_rows_ && config_.riters == 0))));
  }
  // A host held row's maximum or minimum in two chains, over its even and its odd tiles, joined
  // after the loop: the NaN-propagating compare-and-blend's latency bounded one chain (softmax over
  // 4096 x 1024 f32: 1.03 -> 0.91 ms on 2 cores, NOTES 120). The same result (max is exact in any
  // order; NaN from any tile). Sums keep one chain (a reordered sum rounds differently).
  bool two_chains(int red) const {
    return target_ == Target::cpu && rows() && !config_.x_lanes && config_.riters >= 2 && host_rows_unmasked() &&
           (g_[red].op == Op::amax || g_[red].op == Op::amin);
  }
  bool whole_lanes_ = false;  // host column programs: writing the body of a program of whole tiles (write_rows)
  bool unmasked_part_ = false;  // host rows: writing the whole vectors of a split row (write_rows)
  bool tail_part_ = false;      // writing the vector with a split row's end (its caches: stored before)
  // Held GPU rows (Tuning::row_prefetch): the head of the loop being written, and the first loop's
  // register-cache loads with its head, which write() puts in a loop of their own before it.
  std::vector<std::string> loop_head_, prefetch_head_, prefetch_loads_;
  bool prefetched(const std::string& load, kiln::dtype stored) const;
  // Host rows: the loop over a row being written, its halves one loop (a split row's register
  // caches and kept values are stored in both halves, read in later loops).
  int loop_id_ = 0;
  std::map<std::string, std::pair<int, int>> cache_written_;  // register cache -> loop and scope that stored it
  std::map<std::string, int> kept_loop_;
  std::map<std::string, Value> memo_;
  std::map<std::string, std::string> kept_values_;  // CPU rows: a special function's tiles kept for later loops
  int scope_ = 0;
  // Transposed tiles (kernel_writer_tiles.hpp): the dim staged beside the last one and the tiles'
  // side (none: -1, 0); a probe's per-dim symbols and the loads it saw; the staged loads.
  int tile_dim_ = -1, tile_ = 0;
  bool probe_ = false;
  std::vector<Sym> dims_;
  std::vector<std::pair<int, Sym>> probe_loads_;
  Sym ya_, xb_, sa_, sb_, znumel_{1};
  bool col_tiles_ = false;  // host: rows by column tiles (kernel_writer_columns.hpp)
  Sym xrow_, xcol_;
  // Column programs by kept rows (col_tiles_ with rows()): the last kept dim and the product of the
  // kept dims before it.
  Sym kept_cols_{0}, kept_lead_{0};
  // The kept elements' flat index: xindex, or a column program's kept row and column tile.
  Sym kept_flat() const { return rows() && col_tiles_ ? xrow_ * kept_cols_ + xcol_ : xindex_; }
  bool is_kept_symbol(const Sym& f) const { return f == xindex_ || (rows() && col_tiles_ && (f == xrow_ || f == xcol_)); }
  // Column programs by kept rows: the lanes a kept row takes (its column tiles, the last one
  // overhanging the row; on the GPU whole column blocks of XT threads, so that a block never
  // straddles two rows), and every row's as the kernel's xnumel.
  std::int64_t kept_block_lanes() const {
    return std::int64_t{config_.xvec} * (column_block() ? config_.threads / config_.row_threads : 1);
  }
  Sym kept_row_span() const {
    const std::int64_t w = kept_block_lanes();
    return floordiv(kept_cols_ + Sym(w - 1), Sym(w)) * Sym(w);
  }
  Sym kept_tiles_xnumel() const { return rows() && col_tiles_ ? kept_lead_ * kept_row_span() : xnumel_; }
  std::map<std::string, std::string> staged_;  // the staging load -> its shared tile
  std::vector<std::string> stage_decls_;
  std::int64_t stage_bytes_ = 0;
};

}  // namespace kiln::codegen

#include "kernel_writer_access.hpp"
#include "kernel_writer_alignment.hpp"
#include "kernel_writer_columns.hpp"
#include "kernel_writer_emit.hpp"
#include "kernel_writer_impl.hpp"
#include "kernel_writer_indices.hpp"
#include "kernel_writer_one_pass.hpp"
#include "kernel_writer_outer.hpp"
#include "kernel_writer_partials.hpp"
#include "kernel_writer_plan.hpp"
#include "kernel_writer_tiles.hpp"
