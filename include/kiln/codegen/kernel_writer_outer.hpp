// Reductions over outer dims (launch_config.hpp's x_lanes: a column sum, a norm backward's dw and
// db): a program's kept elements are the lanes of its tile and each step of the reduced elements is
// a scalar rindex. How write_rows opens such a program, and the host's two halves of it.
//
// A program (a GPU thread of a column block) takes XVEC kept elements of the flattened kept dims, or,
// by kept rows (col_tiles_, plan()), a column tile of one kept row: xnumel then counts each row's
// tiles, rounded up to whole blocks on the GPU so that a block never straddles two rows.
#pragma once
#include "kernel_writer.hpp"

namespace kiln::codegen {

// The program's head: its kept elements (xindex, or xrow and xcol by kept rows) and, unless the
// host splits it in two halves (write_lane_halves), their mask.
inline void KernelWriter::open_column_program(bool by_cols, bool lane_split) {
  line(column_block() ? "KILN_COLUMN_BLOCK(xoffset) {" : "KILN_COLUMN_PROGRAM(xoffset) {");
  ++indent_;
  if (!by_cols) {
    line("auto xindex = xoffset + kiln::arange<XVEC, ix>();");
    if (!lane_split) line(full_rows_ ? "auto xmask = kiln::full<XVEC>(true);" : "auto xmask = xindex < xnumel;");
    return;
  }
  const Sym span = kept_row_span();
  const std::string row = span.is_constant() ? index_code(span) : "(" + index_code(span) + ")";
  xrow_ = Sym::symbol("xrow", 1011, {.nonnegative = true, .bound = kept_lead_});
  xcol_ = Sym::symbol("xcol", 1012, {.nonnegative = true, .bound = kept_cols_});
  line("const ix xrow = xoffset / " + row + ", xcoff = xoffset % " + row + ";" +
       (column_block() ? "  // one row a block" : ""));
  if (!lane_split) {
    line("auto xcol = xcoff + kiln::arange<XVEC, ix>();");
    line("auto xmask = xcol < " + index_code(kept_cols_) + ";");
  }
}

// Host column programs whose kept elements are no whole number of tiles: the program's body twice,
// for whole tiles unmasked and for the tile with the end, masked (whole_lanes_). Under a mask, a
// host load is a branch a lane that GCC does not vectorise: a column sum over 1031x50021 f32 ran at
// 8 GB/s, over 1031x50016 at 32 (NOTES item 111). Each half starts from the row values known before
// the body (`reduced_before`).
inline void KernelWriter::write_lane_halves(const std::function<void()>& body, bool by_cols,
                                            const std::map<int, Value>& reduced_before) {
  const std::string k = index_code(kept_cols_);
  for (bool whole : {true, false}) {
    line(whole ? "if (" + std::string(by_cols ? "xcoff + XVEC <= " + k : "xoffset + XVEC <= xnumel") + ") {"
               : "} else {");
    ++indent_;
    ++scope_;
    whole_lanes_ = whole;
    final_loop_ = false;
    reduced_ = reduced_before;
    if (by_cols) line("auto xcol = xcoff + kiln::arange<XVEC, ix>();");
    line(whole     ? "auto xmask = kiln::full<XVEC>(true);"
         : by_cols ? "auto xmask = xcol < " + k + ";"
                   : "auto xmask = xindex < xnumel;");
    body();
    --indent_;
  }
  whole_lanes_ = false;
  line("}");
}

}  // namespace kiln::codegen
