// Held-row GPU kernels written again from ptxas's answer for the compiled function (its local
// memory, the blocks an SM it leaves), after the first compile of a program (lower.hpp's
// build_program): spilling rows looped, weights that cost blocks an SM moved to shared memory.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "../codegen/launch_config.hpp"
#include "../core/driver_device.hpp"
#include "../debug/log.hpp"
#include "launch/program.hpp"

namespace kiln::runtime {

// The blocks of a compiled GPU kernel an SM holds at once (registers, shared memory).
inline int resident_blocks(const CompiledKernel& kern) {
  return driver::resident_blocks(kern.cuda, kern.src.config.threads,
                                 static_cast<std::size_t>(kern.src.config.shared_bytes));
}

// Held-row GPU kernels (the "per" kind) whose row ptxas could not keep in registers, written again
// looped (`rewrite(k, tuning)` writes kernel k under a tuning; then compile the program again): the
// compiled function's local memory against what holding the row saves (codegen/launch_config.hpp's
// held_row_spills) — ptxas's answer instead of the row cache rule's estimate, which prices the
// caches, not the kernel around them. Not where a tuning sets the tiles (KILN_TUNE_ROW_ITERS,
// autotuning), nor for column partials (the schedule hosted them for the held row: looped, they
// would keep them in memory, which pays only where the buffer stays in L2); not in
// export_kernels, which plans without a GPU. A held twin inside a chain (lower.hpp's plan_kernels) that spills
// leaves the chain. Returns whether a kernel changed.
template <class Rewrite>
bool loop_spilled_rows(Program& p, Rewrite&& rewrite) {
  if (p.device.is_cpu() || p.autotune || p.tuning.row_iters >= 0) return false;
  const std::int64_t spill_floor = p.tuning.spill_floor >= 0 ? p.tuning.spill_floor : codegen::min_spill_bytes;
  auto local_bytes = [](const CompiledKernel& kern) { return driver::local_bytes(kern.cuda); };
  auto spills = [&](const CompiledKernel& kern) {
    return codegen::held_row_spills(local_bytes(kern), kern.src.config.riters, kern.src.config.threads,
                                    resident_blocks(kern), spill_floor);
  };
  bool changed = false;
  for (std::size_t k = 0; k < p.kernels.size(); ++k) {
    CompiledKernel& kern = p.kernels[k];
    if (kern.extern_node >= 0 || !kern.cuda || kern.src.kind != schedule::Kind::per || kern.src.config.riters <= 0 ||
        kern.src.partial_groups > 0)
      continue;
    // A held twin inside the chain (NOTES item 175) that spills leaves it: the looped kernel at the
    // chain's end serves its lengths.
    for (CompiledKernel* t = &kern; t->looped && t->looped->looped;) {
      const CompiledKernel& middle = *t->looped;
      if (middle.cuda && middle.src.config.riters > 0 && spills(middle)) {
        t->looped = middle.looped;
        changed = true;
      } else {
        t = t->looped.get();
      }
    }
    if (!spills(kern)) continue;
    codegen::Tuning looped_rows;
    looped_rows.row_iters = 0;
    std::optional<codegen::KernelSource> looped = rewrite(static_cast<int>(k), looped_rows);
    if (!looped || looped->config.riters != 0) continue;
    // A looped form that took a size assumption the held one did not needs, for sizes that break
    // it, the twin that assumes nothing, as plan_kernels writes for a specialised kernel.
    std::optional<codegen::KernelSource> twin;
    if (codegen::specialised(*looped) && !kern.looped) {
      codegen::Tuning unspecialised = looped_rows;
      unspecialised.dynamic_rows = 0;
      twin = rewrite(static_cast<int>(k), unspecialised);
      if (!twin || codegen::specialised(*twin)) continue;  // keep the held row, which serves every size
    }
    if (debug::log_enabled(debug::Channel::fusion))
      debug::log(debug::Channel::fusion, kern.src.name + ": " + std::to_string(local_bytes(kern)) +
                                             " bytes of local memory a thread where holding its row saves " +
                                             std::to_string(codegen::held_row_saves(kern.src.config.riters)) +
                                             "; written looped as " + looped->name);
    kern.src = std::move(*looped);
    if (!codegen::specialised(kern.src)) {
      kern.looped.reset();  // the kernel is its own twin now
    } else if (twin) {
      kern.looped = std::make_shared<CompiledKernel>();
      kern.looped->src = std::move(*twin);
    } else {
      while (kern.looped->looped) kern.looped = kern.looped->looped;  // no held twin after a looped kernel
    }
    changed = true;
  }
  return changed;
}

// A held row of symbolic length compiled with the live tiles of the compiling call's length (plan_kernels)
// whose chain's held middle twin, serving the same lengths and more, holds more blocks an SM: the
// middle one takes its place (KILN_TUNE_FULLER_TWINS=1). ptxas's answer, not an estimate: more live
// tiles cost cross_entropy over 3073 bf16 columns fewer registers (208 -> 168) and rms_norm more (91
// -> 105, a block of 64 threads fewer an SM; NOTES item 177). Returns whether a kernel changed.
inline bool keep_fuller_twins(Program& p) {
  if (p.device.is_cpu() || p.autotune || p.tuning.fuller_twins != 1) return false;
  bool changed = false;
  for (CompiledKernel& kern : p.kernels) {
    if (kern.extern_node >= 0 || !kern.cuda || kern.src.config.riters <= 0 || !kern.looped) continue;
    const CompiledKernel& middle = *kern.looped;
    if (!middle.cuda || middle.src.config.riters <= 0 || middle.src.held_max < kern.src.held_max ||
        middle.src.held_min >= kern.src.held_min)
      continue;
    const int blocks = resident_blocks(kern), middle_blocks = resident_blocks(middle);
    if (middle_blocks <= blocks) continue;
    if (debug::log_enabled(debug::Channel::fusion))
      debug::log(debug::Channel::fusion, kern.src.name + ": " + std::to_string(blocks) +
                                             " block(s) an SM with the compiling call's live tiles, " +
                                             std::to_string(middle_blocks) +
                                             " with its middle twin's, which replaces it");
    std::shared_ptr<CompiledKernel> keep = kern.looped;
    kern.src = keep->src;
    kern.cuda = keep->cuda;
    kern.grid_limit = keep->grid_limit;
    kern.looped = keep->looped;
    changed = true;
  }
  return changed;
}

// Held-row GPU kernels that keep their weights in registers (blocks of several rows) and that ptxas
// left fewer blocks an SM than their bound asked for (the bound spilled, so compile_cubin kept them
// unbounded), written again with the weights in shared memory (KILN_TUNE_HOIST=2's form) and
// compiled again; kept only where the compiled kernel then holds more blocks an SM, else the
// register form comes back (from the caches). ptxas's answer, not an estimate: a static kernel
// whose dead lanes ptxas drops fits its bound and keeps its registers (rms_norm's backward over
// 3073 f32 columns: 126 registers, two blocks), where the same kernel of symbolic length took 156
// and one block, and ran 0.73 ms against 0.49 with the weights shared (benchmarks/NOTES.md items 170-
// 171). Not where a tuning places the weights (KILN_TUNE_HOIST, autotuning). Compiles the program
// again where a kernel changed; returns whether one did.
template <class Rewrite>
bool share_held_weights(Program& p, Rewrite&& rewrite, const std::string& name) {
  if (p.device.is_cpu() || p.autotune || p.tuning.hoist >= 0 || p.tuning.held_weights == 0) return false;
  struct Before {
    std::size_t k;
    codegen::KernelSource src;
    int blocks;
  };
  std::vector<Before> before;
  for (std::size_t k = 0; k < p.kernels.size(); ++k) {
    CompiledKernel& kern = p.kernels[k];
    if (kern.extern_node >= 0 || !kern.cuda || kern.src.hoisted_weights != 1 || kern.src.config.min_blocks <= 0)
      continue;
    const int blocks = resident_blocks(kern);
    if (blocks >= kern.src.config.min_blocks) continue;
    codegen::Tuning shared_weights;
    shared_weights.hoist = 2;
    std::optional<codegen::KernelSource> shared = rewrite(static_cast<int>(k), shared_weights);
    // Past shared memory's room the weights stay in registers; a kernel that now assumes a size
    // its twin-less form did not would need a twin (loop_spilled_rows writes one): left alone.
    if (!shared || shared->hoisted_weights != 2 || (codegen::specialised(*shared) && !kern.looped)) continue;
    before.push_back({k, std::move(kern.src), blocks});
    kern.src = std::move(*shared);
  }
  if (before.empty()) return false;
  auto restore = [&](Before& b) { p.kernels[b.k].src = std::move(b.src); };
  try {
    compile_program(p, name);
  } catch (const compile_error&) {  // its other shared memory and the weights past the static limit
    for (Before& b : before) restore(b);
    compile_program(p, name);
    return true;
  }
  bool restored = false;
  for (Before& b : before) {
    CompiledKernel& kern = p.kernels[b.k];
    const int blocks = resident_blocks(kern);
    const bool keep = blocks > b.blocks;
    if (debug::log_enabled(debug::Channel::fusion))
      debug::log(debug::Channel::fusion,
                 kern.src.name + ": " + std::to_string(b.blocks) + " block(s) an SM where its bound asked for " +
                     std::to_string(b.src.config.min_blocks) + "; with its weights in shared memory " +
                     std::to_string(blocks) + (keep ? ", kept" : ", the registers' form kept"));
    if (!keep) restore(b), restored = true;
  }
  if (restored) compile_program(p, name);
  return true;
}

}  // namespace kiln::runtime
