// The kernel skeletons: the pointwise program (one tile of xindex per step) and the row program
// (one row per thread group: reduction loops over rindex, then row-level and full-row stores).
#pragma once
#include "kernel_writer.hpp"

namespace kiln::codegen {

inline void KernelWriter::store(int node, const std::vector<Sym>& idx) {
  std::string ptr = param_for(node, true);
  // A cast to the buffer's own 16-bit dtype is the store's rounding: store the value before it.
  const auto& n = g_[node];
  bool store_rounds = n.op == Op::cast && (n.dt == kiln::dtype::f16 || n.dt == kiln::dtype::bf16) &&
                      compute_dtype(g_[n.in[0]].dt) == kiln::dtype::f32 &&
                      !(s_.realized[n.in[0]] && s_.kernel_of[n.in[0]] != k_);
  Value v = store_rounds ? emit(n.in[0], broadcast_index(n.in[0], node, idx)) : emit(node, idx);
  kiln::dtype ct = compute_dtype(g_[node].dt);
  std::string val = v.literal ? detail::literal(v.value, ct) : cast(v, ct).code;
  Sym offset = ravel(idx, strides_of_(node));  // (a buffer with room for a GEMM is strided)
  // A column block's per-column results are in all RT threads of the column: the first stores them.
  const std::string m = column_block() && !in_rloop_ ? "(" + mask() + " & kiln::column_leader<XT>())" : mask();
  std::string width, base = access_base(offset, ptr, g_[node].dt, width);
  // Unshifted GPU rows of 16-bit values: most tiles of a row of odd length start off a vector with
  // every lane live; they store without a test a lane (measured on an H100: norm backwards over 197
  // and 1001 bf16 columns 0.70-0.94x; NOTES item 172). Shifted rows start their tiles on vectors.
  if (width == "RVEC" && target_ == Target::cuda && rows() && !row_shift_ && itemsize(g_[node].dt) == 2 &&
      tune_.tile_stores != 0)
    width += ", kiln::align::tile";
  if (!base.empty()) {
    line("kiln::store_contig<" + width + ">(" + ptr + ", " + base + ", " + val + ", " + m + ");");
    return;
  }
  line("kiln::store(" + ptr + ", " + index_code(offset) + ", " + val + ", " + m + ");");
}

inline std::string KernelWriter::reduction_identity(Op op, kiln::dtype ct) {
  if (op == Op::sum) return detail::literal(0, ct);
  bool fl = is_floating(ct);
  if (fl) return op == Op::amax ? "-" + detail::literal(INFINITY, ct) : detail::literal(INFINITY, ct);
  // The identity in the compute type's own range: i64's limits cast to int would be -1 and 0, and
  // any nonzero value cast to bool is true.
  const bool max = op == Op::amax;
  switch (ct) {
    case kiln::dtype::boolean:
      return max ? "false" : "true";
    case kiln::dtype::i32:
      return max ? "(int)(-2147483647 - 1)" : "(int)2147483647";
    default:
      return "(" + detail::c_type(ct) + ")" + (max ? "(-9223372036854775807LL - 1)" : "9223372036854775807LL");
  }
}

inline void KernelWriter::write_pointwise() {
  line("KILN_POINTWISE_LOOP(xoffset) {");
  ++indent_;
  line("auto xindex = xoffset + kiln::arange<XVEC, ix>();");
  line(exact_tiles_ ? "auto xmask = kiln::full<XVEC>(true);" : "auto xmask = xindex < xnumel;");
  auto idx = domain_index();
  for (int s : plan_.stores) store(s, idx);
  --indent_;
  line("}");
}

inline void KernelWriter::write_rows() {
  section_ = Section::before_rows;
  const bool partials_in_memory = open_partials();
  // Host reductions over outer dims (config_.x_lanes): a program's kept elements are the lanes of
  // xindex, its reductions' accumulators a tile of them, and the reduced elements a scalar rindex.
  const bool x_lanes = config_.x_lanes;
  const std::string lanes = x_lanes ? "XVEC" : "RVEC";
  section_ = Section::row_open;
  const bool by_cols = x_lanes && col_tiles_;  // a kept row by column tiles (plan())
  const bool lane_split = x_lanes && target_ == Target::cpu && (!full_rows_ || by_cols);
  if (x_lanes) {
    open_column_program(by_cols, lane_split);
  } else {
    line("KILN_ROW(xindex) {");
    ++indent_;
    // (A host row program stops at xnumel: its test is KILN_HOST_ROWS_IN, true on the host and the
    // test itself where the source runs on a GPU's grid.)
    line(full_rows_                   ? "const bool xmask = true;"
         : target_ == Target::cpu     ? "const bool xmask = KILN_HOST_ROWS_IN(xindex < xnumel);"
                                      : "const bool xmask = xindex < xnumel;");
    // With weights, unsigned: known to lie in 0 .. RVEC-1, the lane tests of the tiles inside the
    // row fold away, and with them most of the registers the weights' tested loads took (rms_norm
    // over 3073 f32 columns: 158 -> 120); without weights that measured slower (NOTES 118).
    if (row_shift_)
      line(std::string("const ix kiln_shift = ") +
           (shifted_weights_ ? "(ix)((unsigned)(rnumel * xindex) % RVEC)" : "(rnumel * xindex) % RVEC") +
           ";  // the row's first element in its vector");
  }
  section_ = Section::body;  // the row's register caches go between the two: write() puts them there
  const auto reduced_before = reduced_;
  auto program_body = [&] {
  // Rows of a length no whole number of vectors: each loop is written twice, over the row's whole
  // vectors with no mask and over the vector that holds its end, masked. On the host a masked access
  // is a branch a lane, which the compiler does not vectorise (3-5x, NOTES 102); on the GPU, rows of
  // symbolic length (where no row shift applies) test one mask a vector instead of one a lane
  // (NOTES 103). Both halves are one loop to the register caches (loop_id_).
  enum class Part { whole, full, tail };
  // (GPU rows of symbolic length held in registers at a length off the vector test each lane, as
  // the static kernel at that length does.)
  const bool split =
      tune_.row_split != 0 && !x_lanes && !full_tiles_ && !vector_rows_ && !row_shift_ &&
      (target_ == Target::cpu || (tune_.vector_masks != 0 && !rnumel_.is_constant() && config_.riters == 0));
  auto open_loop = [&](Part part) {
    const bool held = config_.riters > 0;
    loop_head_.clear();
    auto head = [&](const std::string& l) {  // a line of the loop's head, kept for a prefetch loop
      line(l);
      loop_head_.push_back(l);
    };
    head(x_lanes              ? (!column_block() ? "KILN_R_STEPS(rindex) {"
                                 : held          ? "KILN_R_COLUMN_TILES(rindex) {"
                                                 : "KILN_R_COLUMN_STEPS(rindex) {")
         : part == Part::full ? (held ? "KILN_R_TILES_FULL(roffset) {" : "KILN_R_LOOP_FULL(roffset, rnumel) {")
         : part == Part::tail ? (held ? "KILN_R_TILES_TAIL(roffset) {" : "KILN_R_LOOP_TAIL(roffset, rnumel) {")
         : held               ? (row_shift_ ? "KILN_R_TILES_SHIFTED(roffset, kiln_shift) {" : "KILN_R_TILES(roffset) {")
         : row_shift_         ? "KILN_R_LOOP_SHIFTED(roffset, rnumel, kiln_shift) {"
                              : "KILN_R_LOOP(roffset, rnumel) {");
    ++indent_;
    ++scope_;
    in_rloop_ = true;
    unmasked_part_ = part == Part::full;
    tail_part_ = part == Part::tail;
    if (x_lanes) {  // a scalar step: the row's mask is the lanes'
      line("auto rmask = xmask;");
      return;
    }
    head("auto rindex = roffset + kiln::arange<RVEC, ix>();");
    // (Held tiles inside every length served: all lanes live, the test folded after unrolling.)
    const std::string live = held && part == Part::whole && live_tiles_ > (row_shift_ ? 1 : 0)
                                 ? (row_shift_ ? "kiln_it >= 1 && " : "") + std::string("kiln_it < ") +
                                       std::to_string(live_tiles_) + " ? kiln::full<RVEC>(xmask) : "
                                 : "";
    if (part == Part::full)
      head("auto rmask = kiln::full<RVEC>(xmask);");
    else if (full_tiles_ || (vector_rows_ && config_.riters == 0))  // a looped row's vectors are all in it
      head("auto rmask = kiln::full<RVEC>(xmask);");
    else if (vector_rows_)  // each vector wholly in the row or past it: one test a vector
      head("auto rmask = " + live + "kiln::full<RVEC>(roffset < rnumel && xmask);");
    else if (row_shift_)
      head("auto rmask = " + live + "(rindex >= 0) & (rindex < rnumel) & xmask;");
    else
      head("auto rmask = " + live + "(rindex < rnumel) & xmask;");
  };
  auto close_loop = [&] {
    in_rloop_ = false;
    unmasked_part_ = false;
    tail_part_ = false;
    ++scope_;
    --indent_;
    line("}");
  };
  // One loop over the row: body() once, or once for each half of a split row.
  auto loop = [&](const std::function<void()>& body, bool may_split = true) {
    for (Part part : split && may_split ? std::vector<Part>{Part::full, Part::tail} : std::vector<Part>{Part::whole}) {
      open_loop(part);
      body();
      close_loop();
    }
    ++loop_id_;
  };
  // Reductions, several to a loop when none of them reads another, or when one reads the others
  // only through a row value it can be summed at after the loop (one_pass_form).
  std::size_t i = 0;
  while (i < plan_.reductions.size()) {
    std::size_t j = i + 1;
    std::vector<OnePass> pass(1);
    for (; j < plan_.reductions.size(); ++j) {
      if (!depends_on_any(plan_.reductions[j], i, j)) {
        pass.emplace_back();
        continue;
      }
      OnePass p = one_pass_form(plan_.reductions[j], i, j);
      if (p.kind == OnePass::none) break;
      pass.push_back(p);
    }
    std::vector<std::string> accs;
    std::vector<char> two(j - i);  // a maximum or minimum in two chains (two_chains)
    for (std::size_t r = i; r < j; ++r) {
      int red = plan_.reductions[r];
      kiln::dtype ct = compute_dtype(g_[red].dt);
      accs.push_back("acc" + std::to_string(accumulators_++));  // in order, not by node (see scalar_param)
      OnePass& p = pass[r - i];
      if (p.kind == OnePass::none) {
        line("auto " + accs.back() + " = kiln::full<" + lanes + ">(" + reduction_identity(g_[red].op, ct) + ");");
        if ((two[r - i] = two_chains(red))) line("auto " + accs.back() + "_odd = " + accs.back() + ";");
        continue;
      }
      declare_one_pass(p, accs.back(), ct);
    }
    auto idx = domain_index();
    // What the loops after this one read (kept_row_load keeps only tiles they read again): the
    // later reductions, the full-row stores and the column partials of the last loop.
    later_reads_.assign(plan_.reductions.begin() + static_cast<std::ptrdiff_t>(j), plan_.reductions.end());
    for (int s : plan_.stores)
      if (g_[s].shape == g_[plan_.domain].shape && !is_reduction(g_[s].op)) later_reads_.push_back(s);
    for (int p : plan_.partials) later_reads_.push_back(p);
    // A GPU loop carrying Welford's lanes is not split: its body twice held them longer (a dynamic
    // f32 layer_norm: 40 -> 52 registers, 3 -> 2 blocks an SM, 8% slower; the online softmax's
    // loop went 39 -> 35 registers split, and faster).
    const bool carries_pair =
        std::any_of(pass.begin(), pass.end(), [](const OnePass& p) { return p.kind == OnePass::squares; });
    loop([&] {
      for (std::size_t r = i; r < j; ++r) {
        int red = plan_.reductions[r];
        kiln::dtype ct = compute_dtype(g_[red].dt);
        if (const OnePass& p = pass[r - i]; p.kind != OnePass::none) {
          step_one_pass(p, idx, ct);
          continue;
        }
        Value v = cast(emit(g_[red].in[0], idx), ct);
        const std::string& acc = accs[r - i];
        const std::string fn = g_[red].op == Op::amax ? "kiln::maximum" : "kiln::minimum";
        std::string step = g_[red].op == Op::sum ? acc + " + " + v.code : fn + "(" + acc + ", " + v.code + ")";
        // A boolean step can come out an int tile (a literal 1 or 0 among its operands): back to bool.
        if (ct == kiln::dtype::boolean) step = "kiln::cast<" + detail::c_type(ct) + ">(" + step + ")";
        // A host step under a mask known to be all true is the step itself: the select kept GCC from
        // holding a 512-bit accumulator in a register (a store and a load a step: NOTES 71).
        if (two[r - i] && host_rows_unmasked()) {
          line("if (kiln_it & 1) " + acc + "_odd = " + fn + "(" + acc + "_odd, " + v.code + "); else " + acc + " = " + step + ";");
          continue;
        }
        line(acc + " = " + (host_rows_unmasked() ? step : "kiln::where(rmask, " + step + ", " + acc + ")") + ";");
      }
    }, /*may_split=*/!carries_pair || target_ == Target::cpu);
    for (std::size_t r = i; r < j; ++r) {
      int red = plan_.reductions[r];
      if (pass[r - i].kind != OnePass::none) continue;  // after the others, which their row values read
      const char* fn = g_[red].op == Op::sum ? "row_sum" : g_[red].op == Op::amax ? "row_max" : "row_min";
      if (two[r - i])
        line(accs[r - i] + " = kiln::" + (g_[red].op == Op::amax ? "maximum" : "minimum") + "(" + accs[r - i] + ", " + accs[r - i] + "_odd);");
      // Two or more reductions a register-cached row of its own block: each its own shared slot, one
      // barrier each (prelude's across_row). Measured on an H200: W7 -3.2% in two runs; blocks of
      // several rows (W3, W4) +0.4%; looped rows +13% (ptxas gave the dynamic layer_norm 58
      // registers, not 38, without the first barrier), so both keep two barriers.
      bool slots = target_ == Target::cuda && plan_.reductions.size() >= 2 && config_.riters > 0 && config_.rows == 1 &&
                   row_slots();
      std::string slot = slots ? ", " + std::to_string(r) : "";
      if (x_lanes) {  // each lane summed its own column (a column block: over its RT threads too)
        reduced_[red] = column_block() ? bind("kiln::across_columns<XT, RT>(kiln::op_" +
                                                  std::string(g_[red].op == Op::sum    ? "sum"
                                                              : g_[red].op == Op::amax ? "max"
                                                                                       : "min") +
                                                  "(), " + accs[r - i] + ")",
                                              g_[red].dt)
                                       : bind(accs[r - i], g_[red].dt);
        continue;
      }
      reduced_[red] = bind("kiln::" + std::string(fn) + "<ROW_THREADS" + slot + ">(" + accs[r - i] + ")", g_[red].dt);
    }
    for (std::size_t r = i; r < j; ++r)  // the one-pass sums, each at its row value
      if (pass[r - i].kind != OnePass::none) reduced_[plan_.reductions[r]] = reduce_one_pass(pass[r - i], idx, plan_.reductions[r]);
    i = j;
  }
  // Row-level stores (reductions others read, per-row epilogues), then full-row stores.
  std::vector<int> full;
  for (int s : plan_.stores) {
    if (g_[s].shape == g_[plan_.domain].shape && !is_reduction(g_[s].op))
      full.push_back(s);
    else
      store(s, row_index(s));
  }
  if (!full.empty() || !plan_.partials.empty()) {
    final_loop_ = true;
    auto idx = domain_index();
    loop([&] {
      for (int s : full) store(s, idx);
      for (int p : plan_.partials) {  // the value summed, at this row's tile (below the [S, R, K] view)
        kiln::dtype ct = compute_dtype(g_[p].dt);
        Value v = cast(emit(g_[g_[p].in[0]].in[0], idx), ct);
        if (partials_in_memory) {
          const std::string out = param_for(p, true), at = "KILN_ROW_GROUP * rnumel + roffset";
          line("kiln::store_contig<RVEC>(" + out + ", " + at +
               ", kiln::load_contig<RVEC, kiln::align::test, kiln::via::plain>(" + out + ", " + at + ", rmask) + " +
               v.code + ", rmask);");
          continue;
        }
        std::string acc = "part" + std::to_string(p) + "[kiln_it]";
        line(acc + " = " + acc + " + " +
             (host_rows_unmasked() ? v.code : "kiln::where(rmask, " + v.code + ", " + detail::literal(0, ct) + ")") + ";");
      }
    });
    // The next row's loads of the partials come after this row's stores (vector stores are asm the
    // compiler does not see into).
    if (partials_in_memory) line("kiln::memory_order_fence();");
  }
  };  // program_body
  if (lane_split)
    write_lane_halves(program_body, by_cols, reduced_before);
  else
    program_body();
  --indent_;
  line("}");
  store_partials(partials_in_memory);
}

// Whether reduction plan_.reductions[j] reads any of plan_.reductions[i..j) inside this kernel.
inline bool KernelWriter::depends_on_any(int red, std::size_t i, std::size_t j) { return reads_any(g_[red].in[0], i, j); }

// Whether `node` reads any of plan_.reductions[i..j) inside this kernel.
inline bool KernelWriter::reads_any(int node, std::size_t i, std::size_t j) {
  return reaches(node, [&](int v) {
    return std::find(plan_.reductions.begin() + i, plan_.reductions.begin() + j, v) != plan_.reductions.begin() + j;
  });
}

inline bool KernelWriter::holds_partials() {
  plan();
  return plan_.partials.empty() || ks_.partial_groups > 0;
}

inline KernelSource KernelWriter::write() {
  if (!holds_partials())
    throw error("codegen: internal: " + plan_.name + " was planned with column partials its rows cannot hold");
  KernelSource ks = ks_;
  // Tile symbols get ids past the size symbols: they are never kernel parameters.
  xindex_ = Sym::symbol("xindex", 1000, {.nonnegative = true, .bound = xnumel_});
  rindex_ = Sym::symbol("rindex", 1001, {.nonnegative = true, .bound = rnumel_});

  if (rows())
    write_rows();
  else if (tile_dim_ >= 0 || probe_)
    write_tiled();
  else if (col_tiles_)
    write_col_tiles();
  else
    write_pointwise();
  if (probe_) return ks;

  // The signature: inputs, outputs, scalars, sizes (noted while printing the sizes themselves).
  const std::string xnumel_code = index_code(kept_tiles_xnumel()), rnumel_code = index_code(rnumel_);
  std::stable_sort(params_.begin(), params_.end(), [](const Param& a, const Param& b) { return a.kind < b.kind; });
  const bool narrow = narrow_indices();
  std::ostringstream os;
  os << "// " << ks.name << ": " << (config_.x_lanes ? "columns" : rows() ? "rows" : "pointwise") << " over "
     << (rows() ? "[" + xnumel_.str() + ", " + rnumel_.str() + "]" : "[" + xnumel_.str() + "]")
     << (col_tiles_ ? " as rows by column tiles" : "")
     << (config_.x_lanes ? ", lanes along the kept elements" : "")
     << (tile_dim_ < 0                ? ""
         : target_ == Target::cuda ? " in " + std::to_string(tile_) + "x" + std::to_string(tile_) + " tiles of dims (" +
                                         std::to_string(tile_dim_) + ", last), transposed inputs staged in shared memory"
                                   : " in tiles of " + std::to_string(tile_) + " rows of dim " +
                                         std::to_string(tile_dim_) + " by " + std::to_string(config_.xvec) +
                                         " lanes of the last (transposed inputs gathered from L1)")
     << "\n";
  if (target_ == Target::cuda && rows() && config_.riters > 0 && !config_.x_lanes)
    ks.config.min_blocks =
        min_blocks_for(ks.config.threads, cached_cost_ * config_.riters * config_.rvec, tune_);
  // A held row of symbolic length: its sizes, divisors and masks cost registers a static length's
  // do not (a dynamic layer_norm over 4096 f32 columns: 144 against 127, one 256-thread block an SM
  // instead of two, 1.6x its static kernel). Ask ptxas for two blocks, taken only without spilling
  // (runtime/compile/nvrtc.hpp), as many as the same kernel at a static length fits.
  if (dyn_held_unshifted_ && ks.config.min_blocks == 0 && ks.config.threads <= 512 && tune_.occupancy < 0)
    ks.config.min_blocks = 2;
  if (ks.config.min_blocks > 0)
    os << "KILN_KERNEL KILN_HELD_BOUNDS(" << ks.config.threads << ", " << ks.config.min_blocks << ") " << ks.name << "(";
  else
    os << "KILN_KERNEL KILN_BOUNDS(" << ks.config.threads << ") " << ks.name << "(";
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Param& pr = params_[i];
    os << (i ? ", " : "");
    if (pr.kind == Param::in_ptr)
      os << "const " << detail::storage_c_type(pr.dt) << "* __restrict__ " << pr.name;
    else if (pr.kind == Param::out_ptr)
      os << detail::storage_c_type(pr.dt) << "* __restrict__ " << pr.name;
    else if (pr.kind == Param::scalar)
      os << "double " << pr.name;
    else
      os << "i64 " << pr.name << (narrow && !sizes_.empty() ? "_arg" : "");
  }
  os << " KILN_PROGRAM_PARAMS) {\n";
  os << (narrow ? "  typedef int ix;  // every index fits in 32 bits\n" : "  typedef i64 ix;\n");
  if (index_bound_) {  // sizes in int too, at most 2^30 (the program's guard): 32-bit divisions by them
    os << "  const ix";
    bool first = true;
    for (const Param& pr : params_)
      if (pr.kind == Param::size) os << (first ? " " : ", ") << pr.name << " = (ix)" << pr.name << "_arg", first = false;
    os << ";  // at most 2^30 (the program's guard)\n";
  }
  note_index_bound(ks);
  ks.hoisted_weights = target_ != Target::cuda || column_types_.empty() ? 0 : weights_shared() ? 2 : 1;
  ks.assumed_multiples = assumed_.used;
  ks.assumed_by = assumed_.by > 0 ? assumed_.by : 1;
  const auto& c = ks.config;
  if (rows() && c.x_lanes)
    os << "  constexpr ix XVEC = " << c.xvec << ", RUNROLL = " << c.runroll  // (host kernels compile for the GPU too)
       << ";\n"
       << (column_block() ? "  constexpr int XT = " + std::to_string(c.threads / c.row_threads) +
                                ", RT = " + std::to_string(c.row_threads) +
                                (c.riters > 0 ? ", RITERS = " + std::to_string(c.riters) : "") + ";\n"
                          : "")
       << "  const ix xnumel = " << xnumel_code << ", rnumel = " << rnumel_code << ";\n";
  else if (rows())
    os << "  constexpr ix ROWS = " << c.rows << ", RVEC = " << c.rvec
       << ";\n  constexpr int ROW_THREADS = " << c.row_threads << ", RITERS = " << c.riters
       << ", RUNROLL = " << c.runroll << ";\n  const ix xnumel = " << xnumel_code << ", rnumel = " << rnumel_code
       << ";\n";
  else if (tile_dim_ >= 0 && target_ == Target::cuda)
    os << "  constexpr int TILE = " << tile_ << ", TROWS = " << c.threads / tile_ << ";\n";
  else if (tile_dim_ >= 0)
    os << "  constexpr ix TILE = " << tile_ << ", XVEC = " << c.xvec << ";\n";
  else
    os << "  constexpr ix XBLOCK = " << c.xblock << ", XVEC = " << c.xvec << ", THREADS = " << c.threads
       << ";\n  const ix xnumel = " << xnumel_code << ";\n";
  for (const auto& d : stage_decls_) os << "  " << d << "\n";
  if (kept_row_bytes_ > 0) {  // looped rows kept in shared memory (kept_row_load)
    os << "  extern __shared__ __align__(16) unsigned char kiln_smem[];  // " << kept_row_bytes_ << " bytes\n";
    ks.config.shared_bytes = kept_row_bytes_;
  }
  std::string signature = os.str();
  ks.params = params_;
  // The body's sections in order: before the rows, the row-invariant loads, the row loop's head,
  // the row's register caches, the rest.
  std::string caches;
  for (const auto& d : cache_decls_) caches += "    " + d + "\n";
  if (!prefetch_loads_.empty()) {  // the first loop's cached tiles, all loaded before it uses one
    caches += "    " + prefetch_head_[0] + "  // the row's cached tiles, all in flight at once\n";
    for (std::size_t i = 1; i < prefetch_head_.size(); ++i) caches += "      " + prefetch_head_[i] + "\n";
    for (const auto& l : prefetch_loads_) caches += "      " + l + "\n";
    caches += "    }\n";
  }
  std::string hoisted = column_loads_.empty() ? "" : hoist_row_invariants(signature);
  std::string body = section(Section::before_rows) + hoisted + section(Section::row_open) + caches +
                     section(Section::stage) + (staged_.empty() ? "" : "    __syncthreads();\n") +
                     section(Section::body);
  body = split_on_alignment(body);
  ks.source = signature + body + "}\n";
  ks.xnumel = kept_tiles_xnumel();
  if (tile_dim_ >= 0 && target_ == Target::cpu) {  // as many programs as tiles: XBLOCK elements each
    const auto& p = env_[plan_.domain];
    Sym a = p[tile_dim_], b = p[p.size() - 1];
    ks.xnumel = znumel_ * floordiv(a + Sym(tile_ - 1), Sym(tile_)) *
                floordiv(b + Sym(config_.xvec - 1), Sym(config_.xvec)) * Sym(config_.xblock);
  }
  ks.rnumel = rnumel_;
  for (int v : plan_.members)
    if (info(g_[v].op).cls != OpClass::leaf && !is_view(g_[v].op)) ks.fused_ops.push_back(std::string(name(g_[v].op)));
  return ks;
}

}  // namespace kiln::codegen
