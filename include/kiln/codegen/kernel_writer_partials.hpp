// Column partial sums in row kernels (schedule/partials.hpp): a norm backward's dw and db summed by
// its dx kernel, each row group writing one row of a [groups, K] buffer that a small kernel sums.
//
// Held rows keep one register tile a row tile, across the rows, and store them once at the end. A
// GPU block is one row group: its row slots' tiles are folded into the first slot's, which stores
// them (the prelude's fold_row_slots), so narrow rows, many to a block, still write one row of
// sums a block (GPT-2's 768-column norms: launch_config.hpp's partial_row_slots).
// Looped GPU rows (a row length past the held range, or symbolic: the held kernel's twin) keep them
// in the output instead: the block (one row group) zeroes its row of the buffer, then each row's tile
// adds to it with a load and a store (write_rows' last loop). A thread adds to the same columns in
// every row (looped rows are not shifted where there are partials), so only the zeroing, which maps
// threads to columns otherwise at a row's tail, waits for the block.
#pragma once
#include "kernel_writer.hpp"

namespace kiln::codegen {

// Before the rows: the register tiles at zero, or the group's row of the buffer zeroed. Returns
// whether the partials are kept in the buffer.
inline bool KernelWriter::open_partials() {
  const bool in_memory = !plan_.partials.empty() && config_.riters == 0;
  for (int p : plan_.partials) {
    if (in_memory) {
      line("KILN_R_LOOP(roffset, rnumel) {");
      line("  auto rindex = roffset + kiln::arange<RVEC, ix>();");
      line("  kiln::store_contig<RVEC>(" + param_for(p, true) +
           ", KILN_ROW_GROUP * rnumel + roffset, kiln::full<RVEC>(" + detail::literal(0, g_[p].dt) +
           "), rindex < rnumel);");
      line("}");
      continue;
    }
    std::string acc = "part" + std::to_string(p), ct = detail::c_type(g_[p].dt);
    line("kiln::tile<" + ct + ", RVEC> " + acc + "[RITERS];");
    line("KILN_R_TILES(roffset) " + acc + "[kiln_it] = kiln::full<RVEC>(" + detail::literal(0, g_[p].dt) + ");");
  }
  if (in_memory) line("__syncthreads();  // the group's partial sums are zero");
  return in_memory;
}

// After the rows: each row group's register tiles, once (partials in the buffer were written as the
// rows went).
inline void KernelWriter::store_partials(bool in_memory) {
  if (in_memory) return;
  const bool fold = target_ == Target::cuda && config_.rows > 1 && !plan_.partials.empty();
  if (fold) {
    for (int p : plan_.partials)
      line("kiln::fold_row_slots<ROWS, ROW_THREADS, RITERS>(part" + std::to_string(p) + ");");
    line("if (KILN_FIRST_ROW_SLOT) {");
    ++indent_;
  }
  for (int p : plan_.partials) {
    std::string out = param_for(p, true);
    line("KILN_R_TILES(roffset) {");
    line("  auto rindex = roffset + kiln::arange<RVEC, ix>();");
    line("  kiln::store_contig<RVEC>(" + out + ", KILN_ROW_GROUP * rnumel + roffset, part" + std::to_string(p) +
         "[kiln_it], rindex < rnumel);");
    line("}");
  }
  if (fold) {
    --indent_;
    line("}");
  }
}

}  // namespace kiln::codegen
