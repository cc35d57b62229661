// How a node's index becomes memory traffic: the index of a broadcast or viewed input, whether a
// tile's offset starts on a 16-byte vector (contiguous access, tested once a kernel or at each
// access), the load path, and the register caches of row kernels (rows, row-invariant weights).
#pragma once
#include "kernel_writer.hpp"

namespace kiln::codegen {

inline std::vector<Sym> KernelWriter::broadcast_index(int child, int parent, const std::vector<Sym>& idx) {
  const Dims& c = g_[child].shape;
  const Dims& p = g_[parent].shape;
  std::vector<Sym> out(c.size());
  for (int j = 0; j < c.size(); ++j) {
    int pj = j + (p.size() - c.size());
    out[j] = (c[j] == 1 && p[pj] != 1) ? Sym(0) : idx[pj];
  }
  return out;
}

// Maps an index of a view's output to the index of its input.
inline std::vector<Sym> KernelWriter::view_index(int node, const std::vector<Sym>& idx) {
  const auto& n = g_[node];
  int in = n.in[0];
  const auto& in_shape = env_[in];
  switch (n.op) {
    case Op::permute: {
      std::vector<Sym> out(idx.size());
      for (int i = 0; i < n.attrs.dims.size(); ++i) out[n.attrs.dims[i]] = idx[i];
      return out;
    }
    case Op::reshape: {
      if (g_[in].shape == n.shape && in_shape == env_[node]) return idx;
      // The same elements: an index inside the output is a flat position inside the input (of a
      // zero-padded reshape, one past its end where the emitter masks the access).
      Sym flat = ravel(idx, contiguous_strides(env_[node]));
      return unravel(flat, detail::nonzero(in_shape), true);
    }
    case Op::expand:
      return broadcast_index(in, node, idx);
    case Op::slice: {  // start and step are kernel arguments when symbolic
      int d = static_cast<int>(n.attrs.a < 0 ? n.attrs.a + n.shape.size() : n.attrs.a);
      std::vector<Sym> out = idx;
      out[d] = slice_start(node, g_[in].shape) + idx[d] * slice_step(node);
      return out;
    }
    default:
      throw error("codegen: no index rule for view " + std::string(name(n.op)));
  }
}

// A slice's (or slice_backward's) start, clamped into the sliced dim of shape `sliced`, and its step:
// constants, or the program's symbols for them when they change between calls. A view sized from a
// second input and aligned to the end (graph/infer_views.hpp's sized_view_shape) starts at the whole's
// size less the part's.
inline Sym KernelWriter::slice_start(int node, const Dims& sliced) {
  const auto& n = g_[node];
  if (n.n_in == 2 && n.attrs.keepdim) {
    const int whole = n.op == Op::slice ? n.in[0] : node, part = n.op == Op::slice ? node : n.in[0];
    const int d = static_cast<int>(n.attrs.a < 0 ? n.attrs.a + n.shape.size() : n.attrs.a);
    return env_[whole][d] - env_[part][d];
  }
  if (auto s = env_.attr_symbol(node, ir::AttrField::start)) return *s;
  return Sym(ir::ShapeEnv::attr_value(ir::AttrField::start, g_[node].attrs, sliced));
}
inline Sym KernelWriter::slice_step(int node) {
  if (auto s = env_.attr_symbol(node, ir::AttrField::step)) return *s;
  return Sym(g_[node].attrs.d);
}

// Whether e is a multiple of m for every tile, where the tile start (symbol id `start`) is a
// multiple of `vec`. Sizes are unknown (false); constants and products are exact.
inline bool multiple_of(const Sym& e, std::int64_t m, int start, std::int64_t vec, const Assumptions* a) {
  auto rec = [&](const Sym& x) { return multiple_of(x, m, start, vec, a); };
  switch (e.kind()) {
    case SymKind::constant:
      return e.constant_value() % m == 0;
    case SymKind::symbol:
      return (e.symbol_id() == start && vec % m == 0) || (a && a->take(e, m));
    case SymKind::add:
      return std::all_of(e.args().begin(), e.args().end(), rec);
    case SymKind::mul:
      return std::any_of(e.args().begin(), e.args().end(), rec);
    case SymKind::mod:  // a - c * floor(a / c): a multiple of m when a and c are
      return rec(e.args()[0]) && rec(e.args()[1]);
    default:
      return false;
  }
}

// How e moves along an aligned tile of `vec` consecutive values of t (t = s + i with s a multiple of
// vec and i < vec; vec 0: tiles that may start anywhere, as shifted rows' do): e(s + i) = e(s) +
// step * i, and whether e(s) is a multiple of vec, which keeps the tile inside one block of a later
// floor division or remainder by a multiple of vec (a permuted head dim of 64 read through
// reshapes, a slice's offset). nullopt: the lanes move otherwise (a gather).
struct TileForm {
  std::int64_t step = 0;
  bool aligned = false;
};
// Assumptions (a): sizes taken as multiples of the tile (a division or remainder by one keeps
// whole tiles together, as one by a constant multiple of the tile does).
inline std::optional<TileForm> tile_form(const Sym& e, const Sym& t, std::int64_t vec, const Assumptions* a = nullptr) {
  auto free = e.free_symbols();
  if (std::none_of(free.begin(), free.end(), [&](const Sym& f) { return f == t; }))
    return TileForm{0, vec > 0 && multiple_of(e, vec, -1, 0, a)};  // (768 * rindex: a whole number of tiles)
  switch (e.kind()) {
    case SymKind::symbol:  // t itself
      return TileForm{1, vec > 0};
    case SymKind::add: {
      TileForm r{0, true};
      for (const Sym& x : e.args()) {
        auto f = tile_form(x, t, vec, a);
        if (!f) return std::nullopt;
        r.step += f->step;
        r.aligned = r.aligned && f->aligned;
      }
      return r;
    }
    case SymKind::mul: {  // constants times one factor that moves, or factors that do not
      std::int64_t c = 1;
      std::optional<TileForm> moving;
      bool other = false, other_aligned = false;  // factors that are not constants but do not move
      for (const Sym& x : e.args()) {
        if (x.is_constant()) {
          c *= x.constant_value();
          continue;
        }
        auto f = tile_form(x, t, vec, a);
        if (!f || (f->step != 0 && moving)) return std::nullopt;  // two moving factors
        if (f->step != 0)
          moving = f;
        else
          other = true, other_aligned = other_aligned || f->aligned;
      }
      const bool c_aligned = vec > 0 && c % vec == 0;
      if (!moving) return TileForm{0, other_aligned || c_aligned};
      if (other) return std::nullopt;  // a step that is a symbol
      return TileForm{c * moving->step, moving->aligned || c_aligned};
    }
    case SymKind::floordiv:
    case SymKind::mod: {
      const Sym& d = e.args()[1];
      auto f = tile_form(e.args()[0], t, vec, a);
      // blocks of whole tiles: a constant multiple of the tile, or a size assumed one; a numerator
      // that does not move divides by any size alike across the tile
      const bool whole = vec > 0 && (d.is_constant() ? d.constant_value() % vec == 0 : multiple_of(d, vec, -1, 0, a));
      if (!f || (d.is_constant() ? d.constant_value() <= 0 : !whole && f->step != 0)) return std::nullopt;
      if (f->step == 0) return TileForm{0, e.kind() == SymKind::mod && f->aligned && whole};
      if (f->step != 1 || !f->aligned || !whole) return std::nullopt;
      return e.kind() == SymKind::mod ? TileForm{1, true} : TileForm{0, false};
    }
    case SymKind::min:
    case SymKind::max: {  // the same for every lane when both sides are (a padded split's clamped row)
      auto f0 = tile_form(e.args()[0], t, vec, a), f1 = tile_form(e.args()[1], t, vec, a);
      if (!f0 || !f1 || f0->step != 0 || f1->step != 0) return std::nullopt;
      return TileForm{0, f0->aligned && f1->aligned};
    }
    default:
      return std::nullopt;
  }
}

// When offset(t) = base(tile start) + lane inside every aligned tile of t, returns base with t
// replaced by the tile start: the access is then one contiguous run (a vector load or store).
inline std::optional<Sym> tile_base(const Sym& offset, const Sym& t, const Sym& start, std::int64_t vec,
                                    const Assumptions* a = nullptr) {
  auto f = tile_form(offset, t, vec, a);
  if (!f || f->step != 1) return std::nullopt;
  SymMap m;
  m.emplace(t, start);
  return offset.substitute(m);
}

inline std::optional<KernelWriter::LaneTile> KernelWriter::lane_tile() const {
  if (probe_ || tile_dim_ >= 0 || col_tiles_) return std::nullopt;
  if (rows() && !config_.x_lanes) {
    if (!in_rloop_ || row_shift_) return std::nullopt;
    return LaneTile{rindex_, Sym::symbol("roffset", 1003, {.nonnegative = true}), config_.rvec};
  }
  return LaneTile{xindex_, Sym::symbol("xoffset", 1002, {.nonnegative = true}), config_.xvec};
}

// Whether 0 <= rel < count (a slice's positions, a unit step) holds for all lanes of a tile or for
// none: rel moves a lane at a time from a multiple of the tile's length, and count is one too (the
// masks of GPT-2's dq/dk/dv assembly: a test a vector instead of three a lane), or rel does not
// move with the lanes at all.
inline bool KernelWriter::uniform_on_lanes(const Sym& rel, const Sym& count) const {
  auto lt = lane_tile();
  if (!lt || lt->vec <= 1) return false;
  auto f = tile_form(rel, lt->lane, lt->vec, &assumed_);
  return f && (f->step == 0 || (f->step == 1 && f->aligned && multiple_of(count, lt->vec, -1, 0, &assumed_)));
}
// The code of e at a tile's first lane (where lane_tile() holds).
inline std::string KernelWriter::at_first_lane(const Sym& e) {
  auto lt = lane_tile();
  SymMap first;
  first.emplace(lt->lane, lt->first);
  return index_code(e.substitute(first));
}

inline std::string KernelWriter::access_base(const Sym& offset, const std::string& ptr, kiln::dtype dt,
                                             std::string& width) {
  // GPU tiles move a lane at a time; CPU tiles have their 16 lanes along the last dim (xb). Rows
  // have their lanes along the row (rindex), or along the kept elements (x_lanes: xindex).
  const bool row_lanes = rows() && !config_.x_lanes;
  if ((row_lanes && !in_rloop_) || probe_ || (tile_dim_ >= 0 && target_ == Target::cuda)) return "";
  const bool cpu_tile = tile_dim_ >= 0;
  const Sym& tile = row_lanes ? rindex_ : cpu_tile ? xb_ : col_tiles_ ? xcol_ : xindex_;
  std::int64_t vec = row_lanes ? config_.rvec : config_.xvec;
  int start_id = row_lanes ? 1003 : cpu_tile ? 1009 : col_tiles_ ? 1013 : 1002;
  Sym start = Sym::symbol(row_lanes    ? "roffset"
                          : cpu_tile   ? "boffset"
                          : col_tiles_ ? "xcoff"
                                       : "xoffset",
                          start_id, {.nonnegative = true});
  // Shifted rows' tiles start anywhere in the row (vec 0 for the lane tests); a row-major stream's
  // tile, at rnumel * xindex + roffset, starts on a vector wherever its pointer does.
  const bool shifted = row_lanes && row_shift_;
  auto base = tile_base(offset, tile, start, shifted ? 0 : vec, &assumed_);
  if (!base) return "";
  width = row_lanes ? "RVEC" : "XVEC";
  // A tile that starts on a 16-byte (or, for an 8-byte tile, 8-byte) vector whenever its pointer is
  // 16-byte aligned: the kernel may test its pointers once (KILN_ALIGNED) instead of every access.
  std::int64_t bytes = vec * static_cast<std::int64_t>(itemsize(dt)), item = static_cast<std::int64_t>(itemsize(dt));
  std::int64_t vbytes = bytes % 16 == 0 ? 16 : bytes == 8 ? 8 : 0;
  if (target_ != Target::cuda || !vbytes) return index_code(*base);
  if (shifted ? !(*base - start == rnumel_ * xindex_) : !multiple_of(*base, vbytes / item, start_id, vec, &assumed_)) {
    if (shifted || !aligned_at_sizes(*base, vbytes / item, start_id, vec)) {
      unaligned_tiles_ = true;
      return index_code(*base);
    }
  }
  width += ", KILN_ALIGNED";
  if (std::find(aligned_ptrs_.begin(), aligned_ptrs_.end(), ptr) == aligned_ptrs_.end()) aligned_ptrs_.push_back(ptr);
  return index_code(*base);
}

// A contiguous load's template arguments: the access's width and alignment, and via::plain in
// kernels that evaluate special functions (prelude's load16).
inline std::string KernelWriter::load_via(std::string width) const {
  if (!plain_loads_) return width;
  if (width.find("KILN_ALIGNED") == std::string::npos) width += ", kiln::align::test";
  return width + ", kiln::via::plain";
}

// Loads that are the same for every row (weights, biases) are made once, before the row loop, when
// hoist_mode() says so: into registers (blocks of several rows, by default; they cost occupancy:
// layer_norm's w and b take 64 of a thread's 128 registers) or, with KILN_TUNE_HOIST=2, into shared
// memory when they fit (one copy a block, read back per row with conflict-free 16-byte loads: a row
// of the array is a thread's tiles, padded by one tile).
inline bool KernelWriter::weights_shared() const {
  std::int64_t bytes = 0;
  for (kiln::dtype ct : column_types_)
    bytes += std::int64_t{config_.row_threads} * (config_.riters + 1) * config_.rvec *
             static_cast<std::int64_t>(itemsize(ct));
  return hoist_mode() == 2 && bytes <= 40 * 1024;
}
inline std::string KernelWriter::hoist_row_invariants(std::string& signature) const {
  const bool shared = weights_shared();
  std::string pre;
  for (std::size_t i = 0; i < column_types_.size(); ++i) {
    std::string tile = "kiln::tile<" + detail::c_type(column_types_[i]) + ", RVEC>",
                name = "weights" + std::to_string(i);
    if (!shared) {
      pre += "  " + tile + " " + name + "[RITERS];\n";
      continue;
    }
    // Outside the alignment split's two bodies: one array a block.
    signature += "  __shared__ __align__(16) " + tile + " " + name + "_rows[ROW_THREADS][RITERS + 1];\n";
    pre += "  " + tile + "* const " + name + " = " + name + "_rows[threadIdx.x % ROW_THREADS];\n";
  }
  std::string in = shared ? "  " : "";  // the first row's threads fill the shared arrays
  if (shared) pre += "  if (threadIdx.x < ROW_THREADS) {\n";
  pre += in + "  KILN_R_TILES(roffset) {\n" + in + "    auto rindex = roffset + kiln::arange<RVEC, ix>();\n";
  for (const auto& l : column_loads_) pre += in + "    " + l + "\n";
  pre += in + "  }\n";
  if (shared) pre += "  }\n  __syncthreads();\n";
  return pre;
}

// Whether a register cache's load goes to the prefetch loop before the row's first loop
// (Tuning::row_prefetch): a GPU row of static length held in registers, the cache made by the
// first loop of the row, not split in two halves, of values of 4 bytes or more, and a load that
// reads only what the loop's head defines (no value the loop computes, no other cache). ptxas
// issues the row's loads back to back there; written where the first loop uses them, it had
// interleaved each tile's load with the previous tile's arithmetic (rms_norm over 1001 f32
// columns: one tile in flight a warp, 80% of the copy ceiling; its backward 1.6x faster so). A
// 16-bit tile read element by element needs a register an element in flight, twice its cache's
// (softmax over 3073 bf16 columns: 128 -> 165 registers, 1.23x slower); rows of symbolic length
// measured level (geomean 1.001, worst 1.04x): benchmarks/NOTES.md item 168.
inline bool KernelWriter::prefetched(const std::string& load, kiln::dtype stored) const {
  if (tune_.row_prefetch == 0 || target_ != Target::cuda || config_.x_lanes || loop_id_ != 0 || unmasked_part_ ||
      tail_part_ || loop_head_.empty() || !rnumel_.is_constant() || itemsize(stored) < 4)
    return false;
  for (const char* computed : {"tmp", "acc", "kept", "weights", "cache"})
    if (load.find(computed) != std::string::npos) return false;
  return true;
}

namespace detail {
// A load's call without the widening of 16-bit values (a cache keeps them 16-bit, widened on use).
inline std::string unwidened(std::string code) {
  const std::string contig = "kiln::load_contig<", gather = "kiln::load(";
  if (code.rfind(contig, 0) == 0)
    code.replace(0, contig.size(), "kiln::load_contig_raw<");
  else if (code.rfind(gather, 0) == 0)
    code.replace(0, gather.size(), "kiln::load_raw(");
  return code;
}
}  // namespace detail

// A looped GPU row of static length that later loops read again (layer_norm's x after its
// statistics, softmax's after its max and sum): the first loop keeps its tiles in shared memory,
// the later ones read them there instead of from memory (issue 19 item 3; benchmarks/NOTES.md
// items 105 and 108). Each thread reads back only the tiles it stored (the loops step alike), so no
// barrier is needed. By default only rows whose tiles all fit Tuning::row_smem_whole bytes a block
// (half an SM's, so that two blocks share it); KILN_TUNE_ROW_SMEM's bytes (1: half an SM's) keep a
// longer row's first tiles too, reading the rest again from memory. 16-bit values are kept 16-bit.
inline std::optional<KernelWriter::Value> KernelWriter::kept_row_load(int node, const std::string& code,
                                                                      kiln::dtype ct) {
  // (Not column kernels of one thread a row: each thread's cells would be consecutive, a warp's
  // accesses on one bank.)
  if (target_ != Target::cuda || !rows() || !in_rloop_ || config_.riters > 0 || config_.x_lanes ||
      config_.row_threads < 32 || !rnumel_.is_constant())
    return std::nullopt;
  // The bytes a block may keep: KILN_TUNE_ROW_SMEM's, rows kept in part; by default, whole rows only.
  const bool whole_only = tune_.row_smem < 0;
  const std::int64_t budget = whole_only ? tune_.row_smem_whole : tune_.row_smem;
  if (budget <= 0) return std::nullopt;
  const kiln::dtype st = g_[node].dt;
  const bool narrow = st == kiln::dtype::f16 || st == kiln::dtype::bf16;
  const std::string raw_code = narrow ? detail::unwidened(code) : code;
  const std::string cell = std::string("(unsigned)(roffset") + (row_shift_ ? " + kiln_shift" : "") + ") / RVEC";
  if (auto it = kept_rows_.find(code); it != kept_rows_.end()) {
    const KeptRow& k = it->second;
    std::string kept = "kiln::kept_tile(" + k.name + "[" + cell + "])";
    if (!k.whole) kept = "(" + cell + " < " + std::to_string(k.cells) + "u ? " + kept + " : " + raw_code + ")";
    return bind(narrow ? "kiln::widen(" + kept + ")" : kept, ct);
  }
  // Only what a later loop reads again (a one-loop kernel, the last loop: read once).
  if (final_loop_ || std::none_of(later_reads_.begin(), later_reads_.end(),
                                  [&](int r) { return reaches(r, [&](int v) { return v == node; }); }))
    return std::nullopt;
  // A row's tiles: its length rounded up to whole vectors, one more where tiles start before the row.
  const std::int64_t vec = config_.rvec;
  const std::int64_t cells = (rnumel_.constant_value() + vec - 1) / vec + (row_shift_ ? 1 : 0);
  const std::int64_t cell_bytes = vec * static_cast<std::int64_t>(itemsize(narrow ? st : compute_dtype(st)));
  const std::int64_t room = (budget - kept_row_bytes_) / (config_.rows * cell_bytes);
  const std::int64_t kept_cells = std::min(cells, room);
  if (kept_cells < 1 || (whole_only && kept_cells < cells)) return std::nullopt;
  const bool whole = kept_cells == cells;
  std::string name = "kept_row" + std::to_string(kept_rows_.size());
  kept_rows_[code] = {name, kept_cells, whole};
  cache_decls_.push_back(
      "auto* " + name + " = reinterpret_cast<kiln::tile<" + (narrow ? detail::storage_c_type(st) : detail::c_type(ct)) +
      ", RVEC>*>(kiln_smem + " + std::to_string(kept_row_bytes_) + ") + (threadIdx.x / ROW_THREADS) * " +
      std::to_string(kept_cells) + ";  // " +
      (whole ? "this row's tiles"
             : "the first " + std::to_string(kept_cells) + " of this row's " + std::to_string(cells) + " tiles") +
      ", kept for later loops");
  kept_row_bytes_ += (config_.rows * kept_cells * cell_bytes + 15) / 16 * 16;
  Value raw = bind(raw_code, narrow ? st : ct);
  line(std::string(whole ? "" : "if (" + cell + " < " + std::to_string(kept_cells) + "u) ") + "kiln::keep_tile(" +
       name + "[" + cell + "], " + raw.code + ");");
  return narrow ? bind("kiln::widen(" + raw.code + ")", ct) : raw;
}

inline KernelWriter::Value KernelWriter::load(int node, const std::vector<Sym>& idx, const std::string& extra_mask) {
  std::string ptr = param_for(node, false);
  Sym offset = ravel(idx, strides_of_(node));
  std::string m = load_mask(extra_mask);
  kiln::dtype ct = compute_dtype(g_[node].dt);
  if (probe_) probe_loads_.emplace_back(node, offset);
  if (tile_dim_ >= 0 && extra_mask.empty())
    if (auto v = staged_load(node, offset)) return *v;
  std::string code;
  auto free = offset.free_symbols();
  bool per_tile = std::any_of(free.begin(), free.end(), [&](const Sym& f) { return f == rindex_; });
  bool by_row = std::any_of(free.begin(), free.end(), [&](const Sym& f) { return is_kept_symbol(f); });
  // Lanes along the kept elements: a value that does not vary with the lanes (a row's mean; in a
  // host program of one kept row's column tile, also a per-row scale) is one scalar, in bounds at
  // every step of the reduced elements (the program's row always is).
  const Sym& lanes = col_tiles_ ? xcol_ : xindex_;
  if (config_.x_lanes && extra_mask.empty() &&
      std::none_of(free.begin(), free.end(), [&](const Sym& f) { return f == lanes; }))
    return bind("kiln::load(" + ptr + ", " + index_code(offset) + ", true)", ct);
  // The same for every lane of a tile (a row's mean, read by columns of one row): one scalar at the
  // tile's first lane, which a program's loop keeps in bounds; a GPU column block's is not (every
  // thread of the last block loops, for across_columns' barriers), so there it is tested.
  if (config_.x_lanes && extra_mask.empty() && lane_tile())
    if (auto f = tile_form(offset, xindex_, config_.xvec, &assumed_); f && f->step == 0)
      return bind("kiln::load(" + ptr + ", " + at_first_lane(offset) + ", " +
                      (column_block() && !full_rows_ ? "xoffset < xnumel" : "true") + ")",
                  ct);
  // The same for every lane of a row's tile (a row's target class, mean or rstd read in the row's
  // loop): one scalar under the row's mask, not a gather of the same element lane by lane under the
  // tile's (KILN_TUNE_ROW_SCALARS=1). Lanes past the row get the row's value instead of 0, which
  // nothing reads: reductions, partials and stores take only the row's lanes.
  if (rows() && !config_.x_lanes && in_rloop_ && !per_tile && extra_mask.empty() && row_scalars())
    return bind("kiln::load(" + ptr + ", " + index_code(offset) + ", xmask)", ct);
  {  // a contiguous run, masked lane by lane (a masked-off lane touches no memory)
    std::string width, base = access_base(offset, ptr, g_[node].dt, width);
    if (!base.empty()) code = "kiln::load_contig<" + load_via(width) + ">(" + ptr + ", " + base + ", " + m + ")";
  }
  if (code.empty()) code = "kiln::load(" + ptr + ", " + index_code(offset) + ", " + m + ")";
  // A persistent row: the tiles of a row read in one loop stay in registers for the next loops.
  // Row-invariant arrays past the register budget (launch_config.hpp) are re-read each loop (from L1).
  if (rows() && per_tile && !by_row && !config_.cache_invariants) return bind(code, ct);
  // Not in shifted rows (row_shift_): their tiles hold other columns in each row. The plan keeps
  // weights out of them, but not every load that is the same for every row is a weight's shape (a
  // weight read through a transpose or a reshape, a broadcast argument).
  if (hoist_mode() && rows() && in_rloop_ && config_.riters > 0 && per_tile && !by_row && extra_mask.empty() &&
      target_ == Target::cuda && !row_shift_) {
    // The same for every row (a weight): loaded once per thread, before the row loop.
    std::string width, base = access_base(offset, ptr, g_[node].dt, width);
    std::string col = base.empty()
                          ? "kiln::load(" + ptr + ", " + index_code(offset) + ", rindex < rnumel)"
                          : "kiln::load_contig<" + load_via(width) + ">(" + ptr + ", " + base + ", rindex < rnumel)";
    // A 16-bit weight first read by the last loop is read once a row: from L1, not held widened in
    // registers over every row of the block (bf16 forward norms ran 7-35% faster so: NOTES item 51).
    bool narrow = g_[node].dt == kiln::dtype::f16 || g_[node].dt == kiln::dtype::bf16;
    if (narrow && final_loop_ && !column_cache_.count(col) && tune_.hoist < 0) return bind(code, ct);
    auto [it, fresh_cache] = column_cache_.try_emplace(col, "weights" + std::to_string(column_cache_.size()));
    if (fresh_cache) {
      column_types_.push_back(ct);
      column_loads_.push_back(it->second + "[kiln_it] = " + col + ";");
      if (hoist_mode() != 2) cached_cost_ += hoisted_cost(static_cast<std::int64_t>(itemsize(ct)));
    }
    return bind(it->second + "[kiln_it]", ct);
  }
  if (by_row && per_tile)
    if (auto kept = kept_row_load(node, code, ct)) return *kept;
  bool reused = !final_loop_ || row_cache_.count(code);  // a tile first read by the last loop is read once
  if (rows() && in_rloop_ && config_.riters > 0 && per_tile && reused) {
    // 16-bit inputs stay 16-bit in the register cache (half the registers) and widen on use.
    kiln::dtype st = g_[node].dt;
    bool narrow = st == kiln::dtype::f16 || st == kiln::dtype::bf16;
    std::string raw = narrow ? detail::unwidened(code) : code;
    auto [it, fresh_cache] = row_cache_.try_emplace(code, "cache" + std::to_string(row_cache_.size()));
    auto& written = cache_written_[code];  // in which loop and scope its tiles were stored
    // Both halves of a split loop read the same loads: a cache is made in the first, not the tail.
    if (fresh_cache && tail_part_)
      throw error("codegen: internal: " + plan_.name + "'s split row made a register cache in its tail");
    if (fresh_cache) written = {loop_id_, scope_};
    if (!fresh_cache && written.first == loop_id_ && written.second != scope_) {  // the other half of a split loop
      line(it->second + "[kiln_it] = " + raw + ";");
      written.second = scope_;
    }
    if (fresh_cache) {
      cache_decls_.push_back("kiln::tile<" + (narrow ? detail::storage_c_type(st) : detail::c_type(ct)) +
                             (config_.x_lanes ? ", XVEC> " : ", RVEC> ") + it->second + "[RITERS];");
      cached_cost_ += held_cost(static_cast<std::int64_t>(itemsize(st)));
      if (prefetched(raw, st)) {
        if (prefetch_head_.empty()) prefetch_head_ = loop_head_;
        prefetch_loads_.push_back(it->second + "[kiln_it] = " + raw + ";");
      } else {
        line(it->second + "[kiln_it] = " + raw + ";");
      }
    }
    return narrow ? bind("kiln::widen(" + it->second + "[kiln_it])", ct) : bind_held(it->second + "[kiln_it]", ct);
  }
  return bind(code, ct);
}

}  // namespace kiln::codegen
