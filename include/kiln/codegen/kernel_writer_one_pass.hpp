// One pass over a looped row for two dependent reductions (issue 19; benchmarks/NOTES.md item 101):
// which sums qualify (one_pass_form), and the code that carries them beside the reductions they read
// (the prelude's welford_step / online_exp_step in the loop, squares_about / exp_sum_at after it).
#pragma once
#include "kernel_writer.hpp"

namespace kiln::codegen {

// Whether reduction `red`, which reads plan_.reductions[i..j), can share their loop: a sum of
// square(a - d) or exp(a - d) in a floating type, over values of the row's whole domain, where `a`
// reads none of them and `d` is a row value (size 1 along every reduced dim), so it is known once
// they are reduced. Its lanes keep a summary of `a` (prelude: welford_step, online_exp_step) and
// give their shares at d after the loop. Only for looped rows (a held row reads its registers
// again for free), not over outer dims, on the GPU (the host's loops vectorise the two passes
// better than the pair's selects: softmax over 256x65536 f32 took 11 ms in two, 50 ms in one), over
// rows of 4-byte values or wider (below). KILN_TUNE_ONE_PASS=1 writes it wherever it applies.
inline KernelWriter::OnePass KernelWriter::one_pass_form(int red, std::size_t i, std::size_t j) {
  const bool wanted = tune_.one_pass == 1 || (tune_.one_pass < 0 && target_ == Target::cuda);
  if (!wanted || config_.x_lanes || config_.riters > 0 || g_[red].op != Op::sum) return {};
  kiln::dtype ct = compute_dtype(g_[red].dt);
  if (ct != kiln::dtype::f32 && ct != kiln::dtype::f64) return {};
  auto inline_here = [&](int v) {
    return g_[v].op != Op::arg && !(s_.realized[v] && s_.kernel_of[v] != k_) && !reduced_.count(v);
  };
  const int e = g_[red].in[0];
  const auto& domain = g_[plan_.domain].shape;
  if (!inline_here(e) || (g_[e].op != Op::square && g_[e].op != Op::exp) || g_[e].shape != domain ||
      compute_dtype(g_[e].dt) != ct)
    return {};
  const int sub = g_[e].in[0];
  if (!inline_here(sub) || g_[sub].op != Op::sub || g_[sub].shape != domain || compute_dtype(g_[sub].dt) != ct)
    return {};
  const int a = g_[sub].in[0], d = g_[sub].in[1];
  const auto& ds = g_[d].shape;
  const int lead = static_cast<int>(domain.size()) - static_cast<int>(ds.size());
  for (int rd : plan_.rdims)
    if (rd >= lead && ds[rd - lead] != 1) return {};
  if (reads_any(a, i, j)) return {};
  // d must come from the group's sum of `a` (a mean: squares) or its max (exps), so that a row
  // holding an infinity gives what two passes give: the lanes fold an infinite value into NaN
  // (Welford's inf - inf) or drop a -inf behind a larger one (the online max), which two passes
  // match only where d is itself infinite or NaN whenever `a` holds an infinity (the mean), or
  // never below the row's max (the max).
  const bool squares = g_[e].op == Op::square;
  if (!reads_reduction_of(d, squares ? Op::sum : Op::amax, a, i, j)) return {};
  // The pass saved reads the row's bytes of `a` once more; the step costs about a dozen instructions
  // a value (Welford's division, the online max's exp and selects). An H200 issues ~7 instructions a
  // byte at its copy rate (33 T/s over 4.8 TB/s), so a pass over 4-byte values pays for the step and
  // one over 2-byte values does not: measured on an H200 over rows of 32000-262144 (NOTES 101), one
  // pass took 0.87x the two passes' time on f32 rows and 1.005x (0.81-1.15x) on bf16 rows.
  if (target_ == Target::cuda && tune_.one_pass < 0 && row_bytes_read(a) < 4) return {};
  return {squares ? OnePass::squares : OnePass::exps, a, d, sub, {}};
}

// Whether `node` reads, inside this kernel, a reduction `op` of `a` among plan_.reductions[i..j).
inline bool KernelWriter::reads_reduction_of(int node, Op op, int a, std::size_t i, std::size_t j) {
  return reaches(node, [&](int v) {
    return g_[v].op == op && g_[v].in[0] == a &&
           std::find(plan_.reductions.begin() + i, plan_.reductions.begin() + j, v) != plan_.reductions.begin() + j;
  });
}

// The bytes a value of `node` reads from buffers that vary along the reduced dims (the row's own
// data, not its weights), summed over the buffers it reads inside this kernel.
inline std::int64_t KernelWriter::row_bytes_read(int node) {
  std::int64_t bytes = 0;
  const auto& domain = g_[plan_.domain].shape;
  reaches(node, [&](int v) {
    if (g_[v].op != Op::arg && !(s_.realized[v] && s_.kernel_of[v] != k_)) return false;
    const auto& shape = g_[v].shape;
    const int lead = static_cast<int>(domain.size()) - static_cast<int>(shape.size());
    bool along = false;
    for (int rd : plan_.rdims) along = along || (rd >= lead && shape[rd - lead] != 1);
    if (along || shape.size() != domain.size()) bytes += static_cast<std::int64_t>(itemsize(g_[v].dt));
    return false;  // every buffer it reads
  });
  return bytes;
}

// The lanes' summary of a one-pass sum, declared before its loop (accumulator `acc`).
inline void KernelWriter::declare_one_pass(OnePass& p, const std::string& acc, kiln::dtype ct) {
  const std::string zero = "kiln::full<RVEC>(" + detail::literal(0, ct) + ")";
  if (p.kind == OnePass::squares) {
    line("// " + acc + ": a sum of squares about a row value known after the loop: Welford's lanes");
    for (const char* part : {"_n", "_shift", "_mean", "_m2"}) p.accs.push_back(acc + part);
    line("auto " + p.accs[0] + " = " + zero + ", " + p.accs[2] + " = " + zero + ", " + p.accs[3] + " = " + zero + ";");
    line(detail::c_type(ct) + " " + p.accs[1] + " = " + detail::literal(NAN, ct) + ";  // the thread's first value");
    return;
  }
  line("// " + acc + ": a sum of exp(x - d), d a row value known after the loop, online (one exp a value)");
  p.accs = {acc + "_max", acc + "_sum"};
  line("auto " + p.accs[0] + " = kiln::full<RVEC>(-" + detail::literal(INFINITY, ct) + "), " + p.accs[1] + " = " +
       zero + ";");
}

// Its step in the loop, at the domain index idx.
inline void KernelWriter::step_one_pass(const OnePass& p, const std::vector<Sym>& idx, kiln::dtype ct) {
  Value a = cast(emit(p.a, broadcast_index(p.a, p.sub, idx)), ct);
  std::string args;
  for (const auto& acc : p.accs) args += acc + ", ";
  line(std::string(p.kind == OnePass::squares ? "kiln::welford_step(" : "kiln::online_exp_step(") + args + a.code +
       ", rmask);");
}

// Its value after the loop: each lane's share at the row value, summed over the row.
inline KernelWriter::Value KernelWriter::reduce_one_pass(const OnePass& p, const std::vector<Sym>& idx, int red) {
  kiln::dtype ct = compute_dtype(g_[red].dt);
  Value d = cast(emit(p.d, broadcast_index(p.d, p.sub, idx)), ct);
  std::string share = p.kind == OnePass::squares ? "kiln::squares_about(" : "kiln::exp_sum_at(";
  for (const auto& acc : p.accs) share += acc + ", ";
  return bind("kiln::row_sum<ROW_THREADS>(" + share + d.code + "))", g_[red].dt);
}

}  // namespace kiln::codegen
