// Planning a kernel before a line of it is written: iteration sizes, launch config, kind and
// name, masks, and what a kernel over symbolic sizes takes from the compiling call (held rows).
#pragma once
#include <algorithm>
#include <cstdint>

#include "kernel_writer.hpp"

namespace kiln::codegen {

// Decides everything the source depends on before a line is written: the iteration sizes, the
// launch config (from sizes, dtypes and the tuning), the kind (a row too long for registers is
// looped: "per" becomes "red") and so the name.
inline void KernelWriter::plan() {
  if (planned_) return;
  planned_ = true;
  KernelSource& ks = ks_;
  ks.kind = plan_.kind;
  const auto& p = env_[plan_.domain];
  // Vector width from the narrowest element the kernel moves through memory (16 bytes of it).
  int max_item = 8;
  auto narrow = [&](int v) { max_item = std::min<int>(max_item, static_cast<int>(itemsize(g_[v].dt))); };
  for (int v : plan_.stores) narrow(v);
  for (int v : plan_.members)
    for (int c = 0; c < g_[v].n_in; ++c)
      if (g_[g_[v].in[c]].op == Op::arg || (s_.realized[g_[v].in[c]] && s_.kernel_of[g_[v].in[c]] != k_))
        narrow(g_[v].in[c]);
  max_item = std::max(max_item, 2);
  // Full-size inputs read along the rows (each becomes a register cache in a row kernel).
  std::vector<int> streams;
  for (int v : plan_.members)
    for (int c = 0; c < g_[v].n_in; ++c) {
      int in = g_[v].in[c];
      bool loaded = g_[in].op == Op::arg || (s_.realized[in] && s_.kernel_of[in] != k_);
      if (loaded && g_[in].shape == g_[plan_.domain].shape &&
          std::find(streams.begin(), streams.end(), in) == streams.end())
        streams.push_back(in);
    }
  // What the register caches of a row kernel would cost (launch_config.hpp's RowCaches): the
  // streams, and the row-invariant arrays (a norm's weight and bias): inputs whose shape varies
  // along a reduced dim and along no kept one.
  codegen::RowCaches caches;
  caches.streams = static_cast<int>(streams.size());
  std::vector<int> invariants;
  if (rows()) {
    auto raw_cost = [&](int v) { return held_cost(static_cast<std::int64_t>(itemsize(g_[v].dt))); };
    auto compute_cost = [&](int v) {
      return hoisted_cost(static_cast<std::int64_t>(itemsize(compute_dtype(g_[v].dt))));
    };
    caches.stream_cost = 0;
    for (int v : streams) caches.stream_cost += raw_cost(v);
    auto is_one = [](const Sym& s) { return s.is_constant() && s.constant_value() == 1; };
    for (int v : plan_.members)
      for (int c = 0; c < g_[v].n_in; ++c) {
        int in = g_[v].in[c];
        bool loaded = g_[in].op == Op::arg || (s_.realized[in] && s_.kernel_of[in] != k_);
        if (!loaded || std::find(streams.begin(), streams.end(), in) != streams.end() ||
            std::find(invariants.begin(), invariants.end(), in) != invariants.end())
          continue;
        const auto& s = env_[in];
        if (s.size() > p.size()) continue;  // read through a view: not a broadcast of the domain
        bool along_r = false, along_x = false;
        for (std::size_t j = 0; j < s.size(); ++j) {
          auto d = static_cast<std::int64_t>(p.size() - s.size() + j);
          bool reduced = std::find(plan_.rdims.begin(), plan_.rdims.end(), d) != plan_.rdims.end();
          if (!is_one(s[j])) (reduced ? along_r : along_x) = true;
        }
        if (!along_r || along_x) continue;
        invariants.push_back(in);
        caches.invariant_cost += raw_cost(in);
        caches.hoisted_cost += compute_cost(in);
      }
  }
  // Full-size stores (a row kernel's output rows).
  const auto full_stores = static_cast<std::size_t>(std::count_if(plan_.stores.begin(), plan_.stores.end(), [&](int s) {
    return g_[s].shape == g_[plan_.domain].shape && !is_reduction(g_[s].op);
  }));
  if (rows()) {
    // The walks down a row: one a group of reductions that do not read each other (as write_rows
    // groups them, one-pass forms apart), one more for full-size stores and column partials.
    const std::size_t n = plan_.reductions.size();
    caches.loops = 0;
    for (std::size_t i = 0, j; i < n; i = j, ++caches.loops)
      for (j = i + 1; j < n && !depends_on_any(plan_.reductions[j], i, j);) ++j;
    if (full_stores > 0 || !plan_.partials.empty()) ++caches.loops;
    std::vector<Sym> kept, red;
    for (int i = 0; i < static_cast<int>(p.size()); ++i)
      (std::find(plan_.rdims.begin(), plan_.rdims.end(), i) != plan_.rdims.end() ? red : kept).push_back(p[i]);
    xnumel_ = product(kept);
    rnumel_ = product(red);
  } else {
    xnumel_ = product(p);
  }
  std::vector<std::int64_t> example = env_.example;
  std::int64_t xn = xnumel_.eval(example), rn = rnumel_.eval(example);
  bool column =
      rows() && !p.empty() &&
      std::find(plan_.rdims.begin(), plan_.rdims.end(), static_cast<std::int64_t>(p.size()) - 1) == plan_.rdims.end();
  bool transcendental =
      std::any_of(plan_.members.begin(), plan_.members.end(), [&](int v) { return is_transcendental(g_[v].op); });
  // GPU rows of a constant length no whole number of vectors, read and written contiguously: each
  // row's tiles start on the vector before it (prelude's KILN_R_TILES_SHIFTED), so that the row's
  // accesses are whole aligned vectors but at its two ends. Not where a tile position must mean
  // the same column in every row: column partials. Loads the same for every row are not hoisted in
  // such rows (their tiles hold other columns in each row), and weights' tiles then start anywhere
  // (a tested access, element by element in most rows, from L1), which cost registers. So rows
  // with weights are shifted only where that trade measured a gain: 16-bit rows (unshifted, their
  // full-size arrays move element by element, 2 bytes an access), held in registers (checked
  // below), of one full-size array read in two walks (its reduction, then its output), whose
  // full-size arrays outnumber the weights: rms_norm over 197-50257 bf16 columns ran 1.1-2.2x
  // faster so. Elsewhere it measured slower: f32 rows up to 1.3x, layer_norm (as many weights as
  // full-size arrays) up to 1.4x, norm backwards (two arrays read) and cross_entropy's gradient
  // (three walks) up to 2.3x (NOTES 118). KILN_TUNE_ROW_SHIFT=0 turns it off, 1 keeps rows with
  // weights unshifted (the rule before), 2 shifts every row with weights (for A/Bs: NOTES 122
  // measured it, and weights read as two whole vectors and a funnel shift, slower still).
  // Rows of symbolic length (a sequence length that changes) are shifted too where a static row of
  // the same form would be (no weights, or the weights rule above), each row's shift computed as it
  // starts: where the compiling call's length is no whole number of vectors (the row held at it,
  // serving any length its tiles hold) and in the looped twin, which serves every length (a looped
  // row with weights stays unshifted, below); held rows of a length of whole vectors keep their one
  // test a vector. Not a single row (a full reduction: its shift is 0, and the split loop's unmasked
  // vectors measured 6% faster on cross_entropy's loss over 1335 rows, NOTES 123). Rows with
  // weights of symbolic length ran unshifted before NOTES item 167: dynamic rms_norm over 197 bf16
  // columns at 1.8x its static kernel.
  const std::int64_t vec = row_vector(max_item);
  // Rows whose every full-size array has a row stride of whole vectors (buffers with room for a
  // GEMM, schedule/pad_buffers.hpp) start on a vector as they are: nothing to shift.
  auto row_stride_whole = [&](int v) {
    const std::vector<Sym> st = strides_of_(v);
    return plan_.rdims.size() == 1 && st.size() >= 2 && st.size() == p.size() && st.back() == Sym(1) &&
           st[st.size() - 2].is_constant() && st[st.size() - 2].constant_value() % vec == 0;
  };
  // (Only rows no whole number of vectors long: elsewhere nothing changes.)
  bool rows_on_vectors = rows() && !column && target_ == Target::cuda && !streams.empty() && rnumel_.is_constant() &&
                         rnumel_.constant_value() % vec != 0;
  for (int v : streams) rows_on_vectors = rows_on_vectors && row_stride_whole(v);
  for (int v : plan_.stores)
    if (g_[v].shape == g_[plan_.domain].shape && !is_reduction(g_[v].op))
      rows_on_vectors = rows_on_vectors && row_stride_whole(v);
  rows_on_vectors_ = rows_on_vectors;
  const bool one_row = xnumel_.is_constant() && xnumel_.constant_value() == 1;
  const bool weights_shift =
      tune_.row_shift == 2 || (tune_.row_shift != 1 && max_item == 2 && streams.size() == 1 && caches.loops <= 2 &&
                               streams.size() + full_stores > invariants.size());
  const bool shift_symbolic = !rnumel_.is_constant() && (invariants.empty() || weights_shift) && !one_row &&
                              (rn % vec != 0 || tune_.dynamic_rows == 0);
  row_shift_ = rows() && !column && target_ == Target::cuda && tune_.row_shift != 0 && !streams.empty() &&
               plan_.partials.empty() && !rows_on_vectors &&
               (shift_symbolic || (rnumel_.is_constant() && rnumel_.constant_value() % vec != 0 &&
                                   (invariants.empty() || weights_shift)));
  // GPU rows of symbolic length held as at the compiling call's length (Triton's persistent
  // reduction, its tiles sized from the size hint): the lengths it serves are held_min..held_max;
  // the program launches the kernel written looped at others (runtime's CompiledKernel::looped).
  // At a compiling call's length of whole vectors, only such lengths: one mask test a vector, as at
  // static lengths. Shifted rows (above): any length that the tiles hold with the row's shift.
  // Unshifted rows of another length (rows with weights and bias, f32 rows with weights, norm
  // backwards with column partials): any length the tiles hold, a mask test a lane, as the static
  // kernel at that length does (KILN_TUNE_DYNAMIC_ROWS=1 loops them, the rule before: a dynamic
  // layer_norm over 197 bf16 columns read x three times, 1.9x its static kernel, and its backward
  // kept its column partials in memory, 4x; benchmarks/NOTES.md item 169). Not a single row (a
  // full reduction, one block either way: cross_entropy's mean over 5461 rows measured 1.05-1.09x
  // slower held).
  const bool odd_held = tune_.dynamic_rows != 1 && !one_row;
  const bool held_dynamic = rows() && !column && target_ == Target::cuda && !rnumel_.is_constant() &&
                            tune_.dynamic_rows != 0 && tune_.vector_masks != 0 &&
                            (rn % vec == 0 || row_shift_ || odd_held);
  ks.config = rows() ? row_config(target_, xn, rn, max_item, rnumel_.is_constant() || held_dynamic, column, caches,
                                  tune_, row_shift_)
                     : pointwise_config(target_, xn, max_item, tune_);
  if (row_shift_ && !invariants.empty() && ks.config.riters == 0) {  // a looped row with weights: unshifted
    row_shift_ = false;
    // (Unshifted, a symbolic row is held where held_dynamic says it would be without the shift.)
    const bool static_rows = rnumel_.is_constant() || (held_dynamic && (rn % vec == 0 || odd_held));
    ks.config = row_config(target_, xn, rn, max_item, static_rows, column, caches, tune_, false);
  }
  shifted_weights_ = row_shift_ && !invariants.empty();
  // A static row that 512 threads cannot hold: 1024 threads may (launch_config.hpp's wide_rows).
  if (rows() && !column && target_ == Target::cuda && rnumel_.is_constant() && ks.config.riters == 0 &&
      ks.config.rows == 1 && plan_.partials.empty())
    if (auto wide = wide_rows(xn, rn, max_item, caches, tune_, row_shift_)) ks.config = *wide;
  // GPU rows with column partials keep their sums in registers within a budget (launch_config.hpp's
  // partial_config), which may take more threads a row than the rule; a held row past it is not
  // hosted (holds_partials). A looped row keeps them in the output (partial_buffer_bytes), as a
  // symbolic one's looped twin always does.
  bool cuda_partials = !plan_.partials.empty() && target_ == Target::cuda;
  std::int64_t sum_words = 0, sum_bytes = 4;  // the sums' 4-byte words a lane, all together; the widest's bytes
  for (int q : plan_.partials) {
    const auto bytes = static_cast<std::int64_t>(itemsize(compute_dtype(g_[q].dt)));
    sum_words += std::max<std::int64_t>(1, bytes / 4);
    sum_bytes = std::max(sum_bytes, bytes);
  }
  if (cuda_partials && tune_.partials != 1) {
    if (auto held = partial_config(ks.config, xn, rn, max_item, rnumel_.is_constant() || held_dynamic, caches, tune_,
                                   sum_words))
      ks.config = *held;
    else
      cuda_partials = ks.config.riters == 0 &&
                      (!rnumel_.is_constant() || plan_.partial_groups * rn * sum_words * 4 <= partial_buffer_bytes);
  }
  if (held_dynamic && ks.config.riters > 0) {
    // Right up to the tiles' capacity; past half of it a smaller configuration would do (unless
    // this one is already the smallest: a warp of threads, one tile each).
    const std::int64_t capacity = std::int64_t{ks.config.riters} * ks.config.row_threads * ks.config.rvec;
    ks.held_rnumel = rnumel_;
    ks.held_max = row_shift_ ? capacity - (ks.config.rvec - 1) : capacity;  // a shifted row spans up to rvec - 1 more
    ks.held_min = ks.config.riters == 1 && ks.config.row_threads <= 32 ? 1 : std::min(capacity / 2 + 1, rn);
  }
  ks.tuning = tune_;
  ks.column = column;
  if (cuda_partials || (!plan_.partials.empty() && target_ == Target::cpu && ks.config.riters > 0)) {
    // Column partials: exactly partial_groups programs. On CUDA a block a group, which visits the
    // rows in turn, any number of them (symbolic too), its sums in registers where it holds the
    // row, each of its row slots its own, folded at the end (launch_config.hpp's
    // partial_row_slots), else in the output buffer (write_rows, a slot a block); on the CPU a
    // program over each group's ceil(rows / groups) consecutive rows (static:
    // schedule/partials.hpp), holding the row.
    if (target_ == Target::cuda) {
      std::int64_t row_bytes = 0;
      for (int v : streams) row_bytes += rn * static_cast<std::int64_t>(itemsize(g_[v].dt));
      const std::int64_t fold_bytes =
          std::int64_t{ks.config.riters} * ks.config.row_threads * ks.config.rvec * sum_bytes;
      ks.config.rows =
          ks.config.riters > 0 && tune_.partials != 1
              ? partial_row_slots(plan_.partial_groups, xn, row_bytes, ks.config.row_threads, fold_bytes, tune_)
              : 1;
      ks.config.threads = ks.config.rows * ks.config.row_threads;
    } else {
      ks.config.rows = static_cast<int>((xn + plan_.partial_groups - 1) / plan_.partial_groups);
    }
    ks.partial_groups = plan_.partial_groups;
  }
  // Host column programs whose last kept dim K is a constant no whole number of tiles (the first
  // stage of a split column sum over [S, K], a bias's gradient over odd widths): a program a kept
  // row's column tile (col_tiles_, as host pointwise kernels with a bias), so that every tile's
  // lanes are consecutive columns of one row. The flat walk's tiles straddled two rows and
  // indexed through xindex / K and xindex % K, lane by lane: a column sum over 1024x4099 f32 took
  // 4.2x one over 1024x4096 (NOTES item 114).
  std::vector<Sym> kept;  // the kept dims longer than one
  for (int i = 0; i < static_cast<int>(p.size()); ++i)
    if (std::find(plan_.rdims.begin(), plan_.rdims.end(), i) == plan_.rdims.end() &&
        !(p[i].is_constant() && p[i].constant_value() == 1))
      kept.push_back(p[i]);
  auto by_kept_rows = [&] {
    col_tiles_ = true;
    kept_cols_ = kept.back();
    kept_lead_ = product(std::vector<Sym>(kept.begin(), kept.end() - 1));
  };
  if (rows() && target_ == Target::cpu && ks.config.x_lanes && tune_.column_lanes != 0 && kept.size() >= 2 &&
      kept.back().is_constant() && kept.back().constant_value() > ks.config.xvec &&
      kept.back().constant_value() % ks.config.xvec != 0)
    by_kept_rows();
  config_ = ks.config;
  // GPU kernels over symbolic sizes may take sizes as multiples of their vector (Assumptions); the
  // program's looped twin (KILN_TUNE_DYNAMIC_ROWS=0) assumes nothing.
  if (target_ == Target::cuda && tune_.dynamic_rows != 0)
    assumed_ = Assumptions{&env_.example, rows() && !config_.x_lanes ? config_.rvec : config_.xvec, {}};
  // GPU column blocks over kept dims [..., K] with K symbolic and no whole number of tiles (a
  // dynamic split column sum over [S, K] at an odd K, or this kernel's twin that assumes nothing):
  // a block a run of XT column tiles of one kept row. The flat walk's lanes then cross rows, each
  // dividing its index by K (a run-time value) and testing its own chunk's end: the dynamic split
  // column kernel of a layer_norm backward over 50257 columns took 182 registers against the
  // static kernel's 98 (NOTES item 132), by kept rows 80. A kept row's last block leaves lanes
  // idle, so only where that is at most one lane in eight at the compiling call's K; where K is a
  // whole number of tiles the flat walk's tiles stay in one row and divide once a thread.
  // Timed on an H200 (NOTES item 138): dynamic/static 1.68 -> 1.28 there, a colsum over 12289 bf16
  // columns 2.20 -> 1.37, none slower. KILN_TUNE_COLUMN_ROWS=0 keeps the flat walk.
  if (tune_.column_rows != 0 && column_block() && rows() && tune_.column_lanes != 0 && kept.size() >= 2 &&
      !kept.back().is_constant()) {
    Assumptions probe = assumed_;  // (asking takes no assumption for the kernel)
    const std::int64_t k = kept.back().eval(env_.example), w = kept_block_lanes(), span = (k + w - 1) / w * w;
    if (!multiple_of(kept.back(), config_.xvec, -1, 0, &probe) && k > 0 && (span - k) * 8 <= span) by_kept_rows();
  }
  plain_loads_ = target_ == Target::cuda && (tune_.loads >= 0 ? tune_.loads == 1 : transcendental);
  if (ks.kind == schedule::Kind::per && ks.config.riters == 0) ks.kind = schedule::Kind::red;  // looped, not held
  // Programs that tile the domain exactly need no bounds tests: whole programs of rows, and
  // register tiles that cover a row exactly (a constant mask folds away).
  if (rows()) {
    // A GPU block of one row: its KILN_ROW loop stops at xnumel, so every row it visits is in the
    // domain at any (symbolic) number of rows too. Not by default where the row is shifted: with the
    // row test gone ptxas issued all its tiles' loads at once, rms_norm over 3073 bf16 columns took
    // 96 -> 121 registers and ran 1.11x slower (NOTES item 173). KILN_TUNE_SHIFTED_ROW_TEST=1 keeps
    // that test in static kernels too (measured mixed, 0.85x to 1.64x: NOTES item 174).
    const bool one_row_block =
        target_ == Target::cuda && config_.rows == 1 && !config_.x_lanes && config_.threads == config_.row_threads;
    const bool one_row_live = tune_.live_tiles == 2 || tune_.live_tiles == 3 ||
                              ((tune_.live_tiles < 0 || tune_.live_tiles == 4) && !row_shift_);
    full_rows_ = divides(config_.rows, xnumel_)  // (only at a constant row count)
                     ? !(one_row_block && row_shift_ && tune_.shifted_row_test == 1)
                     : one_row_block && one_row_live;
    full_tiles_ = config_.riters > 0 && !config_.x_lanes && rnumel_.is_constant() &&
                  rnumel_.constant_value() == std::int64_t{config_.riters} * config_.row_threads * config_.rvec;
    exact_tiles_ = full_rows_ && full_tiles_;
    vector_rows_ = tune_.vector_masks != 0 && !config_.x_lanes && rnumel_.is_constant() &&
                   rnumel_.constant_value() % config_.rvec == 0;  // (columns' lanes run across rows)
    dyn_held_unshifted_ = held_dynamic && config_.riters > 0 && !row_shift_;
    // A held row of symbolic length: its first tiles lie inside every length the kernel serves
    // (held_min up), so their lanes need no test, as a static kernel's tiles inside its row fold
    // theirs (a shifted row's first tile starts before the row).
    // By default as many as lie inside the compiling call's length, the kernel then serving
    // lengths from those tiles' end up (shorter ones go to its twins: runtime/lower.hpp's
    // plan_kernels; NOTES item 175).
    if (held_dynamic && config_.riters > 0 && tune_.live_tiles != 0 && tune_.live_tiles != 2) {
      const std::int64_t tile = std::int64_t{config_.row_threads} * config_.rvec;
      if (tune_.live_tiles < 0)
        ks.held_min = std::max(ks.held_min, std::min<std::int64_t>(config_.riters, rn / tile) * tile);
      live_tiles_ = static_cast<int>(std::min<std::int64_t>(config_.riters, ks.held_min / tile));
    }
    if (dyn_held_unshifted_ && rn % config_.rvec == 0) {
      dyn_vector_rows_ = vector_rows_ = true;
      ks.held_multiple = config_.rvec;
    }
  } else {
    choose_tiling(max_item);
    if (tile_dim_ >= 0) {  // GPU: a program loops over tiles (any grid will do); CPU: a program a tile
      const bool gpu = target_ == Target::cuda;
      config_.tile = tile_;
      config_.tile_dim = tile_dim_;
      if (gpu) config_.threads = tile_threads(tile_, max_item, tune_);
      config_.xvec = gpu ? 1 : static_cast<int>(cpu_tile_lanes);  // a thread's lanes, or the CPU tile's
      config_.xblock = std::int64_t{tile_} * (gpu ? tile_ : config_.xvec);
      ks.config = config_;
    } else {
      choose_col_tiles();
      if (col_tiles_) ks.config = config_;
    }
    exact_tiles_ = tile_dim_ < 0 && divides(config_.xblock, xnumel_);
  }
  ks.name =
      ks.kind == plan_.kind ? plan_.name : schedule::kernel_name(ks.kind, plan_.ops, static_cast<std::size_t>(k_));
}

}  // namespace kiln::codegen
