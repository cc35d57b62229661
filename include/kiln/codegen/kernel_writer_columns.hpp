// Host pointwise kernels with an operand broadcast along the leading dims (a bias): rows by column
// tiles.
//
// The host's pointwise program walks XBLOCK elements of the flattened domain, a tile of 16 lanes a
// step, and GCC vectorises that loop across its steps (8 or 16 tiles at once, each lane an
// instruction). A plain stream then moves whole vectors, but a bias read at `xoffset % C` starts each
// tile at a place no affine function of the step gives, so its lanes become gathers: gelu(x + bias)
// over 4096 x 1024 f32 ran at 2.2x torch.compile on 16 threads and 3.1x on 2 (benchmarks/NOTES.md
// items 63 and 65). Written as rows by column tiles instead, a program takes XROWS whole rows and
// steps through each row's C / XVEC column tiles: every operand's tile starts at an affine function of
// the column step (the bias at xcoff, the rest at xrow * C + xcoff), which the vectoriser moves as
// whole vectors.
//
// Which kernels: host pointwise kernels without transposed tiles whose last dim is a constant with
// at least as many whole tiles as the widest vector has f32 lanes (so a row's steps fill the
// vectoriser's lanes), and where a probe finds a load that varies along the last dim but not along
// some leading dim longer than one. Other kernels keep the flat walk. A row of a length no whole
// number of tiles takes its whole tiles unmasked and then the tile with its end, masked (the flat
// walk's gathers made a bias over rows of 777 f32 2.5-4x one over rows of 784: NOTES 102).
#pragma once
#include "kernel_writer.hpp"

namespace kiln::codegen {

inline void KernelWriter::choose_col_tiles() {
  const auto& p = env_[plan_.domain];
  const int rank = static_cast<int>(p.size());
  if (target_ != Target::cpu || rows() || probe_ || tile_dim_ >= 0 || rank < 2) return;
  if (!p[rank - 1].is_constant()) return;
  const std::int64_t cols = p[rank - 1].constant_value(), lanes = config_.xvec;
  constexpr std::int64_t widest_f32_lanes = 16;  // AVX-512: the most tiles one vector step takes
  if (lanes <= 0 || cols / lanes < widest_f32_lanes) return;
  KernelWriter probe(g_, s_, env_, k_, target_, strides_of_, tune_);
  probe.probe_ = true;
  probe.write();
  bool broadcast = false;
  for (const auto& [node, offset] : probe.probe_loads_) {
    auto free = offset.free_symbols();
    auto has = [&](const Sym& d) { return std::find(free.begin(), free.end(), d) != free.end(); };
    if (!has(probe.dims_[rank - 1])) continue;
    for (int d = 0; d < rank - 1; ++d)
      if (!has(probe.dims_[d]) && !(p[d].is_constant() && p[d].constant_value() == 1)) broadcast = true;
  }
  if (!broadcast) return;
  col_tiles_ = true;
  // A program: as many whole rows as the flat walk's XBLOCK elements hold (at least one).
  const std::int64_t xrows = std::max<std::int64_t>(1, config_.xblock / cols);
  config_.xblock = xrows * cols;
}

// The domain's index: the leading dims from the row, the last dim from the column tile.
inline std::vector<Sym> KernelWriter::col_index() {
  const auto& p = env_[plan_.domain];
  std::vector<Sym> lead(p.begin(), p.end() - 1);
  std::vector<Sym> idx = unravel(xrow_, detail::nonzero(lead));
  idx.push_back(xcol_);
  return idx;
}

inline void KernelWriter::write_col_tiles() {
  const auto& p = env_[plan_.domain];
  std::vector<Sym> lead(p.begin(), p.end() - 1);
  const Sym rows = product(lead);
  xrow_ = Sym::symbol("xrow", 1011, {.nonnegative = true, .bound = rows});
  xcol_ = Sym::symbol("xcol", 1012, {.nonnegative = true, .bound = p[p.size() - 1]});
  const std::int64_t cols = p[p.size() - 1].constant_value();
  const std::string c = std::to_string(cols);
  line("const ix xrows = " + index_code(rows) + ";");
  auto body = [&](const std::string& xmask) {
    ++indent_;
    ++scope_;
    line("auto xcol = xcoff + kiln::arange<XVEC, ix>();");
    line("auto xmask = " + xmask + ";");
    auto idx = col_index();
    for (int s : plan_.stores) store(s, idx);
    --indent_;
    line("}");
  };
  if (cols % config_.xvec == 0) {  // whole rows of whole tiles: the loop bounds test
    line("KILN_COLUMN_TILES(xrow, xcoff, xrows, XBLOCK / " + c + ", " + c + ") {");
    body("kiln::full<XVEC>(true)");
    return;
  }
  line("KILN_COLUMN_ROWS(xrow, xrows, XBLOCK / " + c + ") {");
  ++indent_;
  line("KILN_COLUMNS_FULL(xcoff, " + c + ") {");
  body("kiln::full<XVEC>(true)");
  line("KILN_COLUMNS_TAIL(xcoff, " + c + ") {");
  body("xcol < " + c);
  --indent_;
  line("}");
}

}  // namespace kiln::codegen
