// Reshaping reductions before fusion: a reduction over size-1 dims is a reshape, and a long
// reduction with few outputs (a bias gradient over 16384 rows, a full sum) is split in two stages
// — partial results over S chunks, then a short reduction of the partials — so that enough
// programs run at once. The first stage is a kernel of kind "split".
#pragma once
#include <algorithm>
#include <limits>

#include "../rewrite/builder.hpp"

namespace kiln::schedule {

inline constexpr std::int64_t split_stage_mark = 1;  // attrs.c of a first-stage reduction

namespace detail {

struct ReductionShape {
  Dims in;    // input shape
  Dims dims;  // reduced dims, sorted
  std::int64_t kept = 1, reduced = 1;
  bool prefix = true, suffix = true;  // reduced dims are the outermost / innermost ones
};

inline ReductionShape describe_reduction(const graph::Graph& g, const graph::Node& n) {
  ReductionShape r;
  r.in = g[n.in[0]].shape;
  int rank = r.in.size();
  for (int d = 0; d < rank; ++d) {
    bool red = n.attrs.all || std::any_of(n.attrs.dims.begin(), n.attrs.dims.end(),
                                          [&](std::int64_t x) { return (x < 0 ? x + rank : x) == d; });
    if (red) r.dims.push_back(d);
    (red ? r.reduced : r.kept) *= r.in[d];
  }
  for (int i = 0; i < r.dims.size(); ++i) {
    r.prefix = r.prefix && r.dims[i] == i;
    r.suffix = r.suffix && r.dims[i] == rank - r.dims.size() + i;
  }
  return r;
}

// The number of chunks: enough partial results to fill the machine, each chunk still long (>= 64),
// a power of two. The chunks cover the first S * floor(R / S) of the R reduced positions; the rest
// (fewer than S) is reduced apart and combined (split_reductions): an odd row count (87381 rows of
// a layer_norm's dw) would otherwise leave one thread a column walking every row. A power of two
// that divides R, when one reaches at least half the wanted chunks, avoids that remainder; row
// reductions (inner dims) take only such a divisor.
// hosted: a row reduction reads the same [rows, columns] domain, so a row kernel may compute the
// first stage itself (schedule/partials.hpp), a program a chunk: then at least 256 chunks, and on a
// GPU chunks of 16 rows or more (`min_chunk`; 64 under KILN_TUNE_PARTIALS=1, the rule before): a
// chunk's partials, 4 bytes a column written and 4 read again, stay at an eighth of what a norm
// backward's row kernel reads of its two 16-bit arrays (x, dy) over the chunk; 64 rows left
// GPT-2's 8192 rows of 768 columns 128 chunks, too few blocks to host them (NOTES item 154).
// Column partials: a thread per (chunk, kept element) walks its chunk with strided loads, so
// ~256K threads (an H200 holds 270K) keep enough loads in flight; 64K left W5's dw/db stage at
// 34% of DRAM bandwidth.
inline constexpr std::int64_t column_threads = 262144;

// gpu: the program runs on a GPU (else the host, whose first stages walk down columns a scalar a
// lane unless a row kernel hosts them: there wide column sums stay one stage, as before).
inline std::int64_t choose_splits(const ReductionShape& r, bool hosted = false, bool gpu = true,
                                  std::int64_t min_chunk = 64) {
  if (r.dims.empty()) return 1;
  // Outer dims reduced: one thread a kept element, so fewer than column_threads of them leave
  // loads out of flight on a GPU (a layer_norm backward's dw over 2670x50257 bf16: 197 blocks,
  // 0.5 waves, 1.37 ms of its 1.59; NOTES item 110), when there are rows enough for two chunks.
  // On the host, fewer than 32768 (a column sum over 1031x50021 f32 split ran 1.5x slower on two
  // cores).
  // Inner dims reduced: up to 512 threads share a row, so only a handful of rows is too few.
  const std::int64_t wide = gpu ? column_threads : 32768;
  bool few = r.prefix && !r.suffix ? r.kept < wide && r.reduced >= 1024 : r.kept < 128 && r.reduced >= 16384;
  if (!few) return 1;
  std::int64_t target = r.prefix && !r.suffix ? std::max(column_threads, hosted ? 256 * r.kept : 0) : 65536;
  std::int64_t want = std::max<std::int64_t>(2, target / std::max<std::int64_t>(r.kept, 1));
  std::int64_t s = 1, exact = 1;
  if (!(hosted && gpu)) min_chunk = 64;
  while (s * 2 <= want && r.reduced / (s * 2) >= min_chunk) s *= 2;
  while (exact * 2 <= s && r.reduced % (exact * 2) == 0) exact *= 2;
  // Rows (inner dims reduced) split only by a divisor: unsplit, a row still has up to 512 threads.
  // Outer dims (laid out [S, R/S, K]) and full reductions ([S, R/S]) take any S, the rest reduced
  // apart: two chunks of a 174762-element mean were two threads (40 ms on an H200).
  if (!r.prefix) return exact;
  return exact * 2 >= s ? exact : s;
}

// How a two-stage reduction combines two partial results (the chunks and the remainder).
constexpr Op combine_op(Op reduction) {
  return reduction == Op::amax ? Op::maximum : reduction == Op::amin ? Op::minimum : Op::add;
}

}  // namespace detail

// The dims of g that are a split's chunk counts (S, and 16 and S/16 of its middle step) as bits a
// node: constants of the schedule, never symbols. As a symbol such a size would share one with any
// equal size at the compiling call (duck sizing), say a chunk length of 64 beside 64 chunks, and
// fail at the next length.
inline std::vector<std::uint32_t> chunk_count_dims(const graph::Graph& g) {
  std::vector<std::uint32_t> bits(static_cast<std::size_t>(g.size()), 0);
  for (int i = 0; i < g.size(); ++i) {
    const graph::Node& n = g[i];
    if (!is_reduction(n.op) || n.attrs.c != split_stage_mark || n.attrs.dims.size() != 1) continue;
    const int d = static_cast<int>(n.attrs.dims[0]), in = n.in[0];  // 1: outer dims reduced; 2: inner
    const bool middle = is_reduction(g[g[in].in[0]].op) && g[g[in].in[0]].attrs.c == split_stage_mark;
    bits[i] |= 1u << (d - 1);
    if (g[in].op == Op::reshape) bits[in] |= middle ? (1u << (g[in].shape.size() - 1)) - 1 : 1u << (d - 1);
  }
  return bits;
}

// Rewrites reductions as described above; other nodes are copied unchanged. partials (a Tuning's
// `partials`): row kernels may compute the first stage of column sums over their own rows
// (partials.hpp) unless 0, which also sets how many chunks such sums get (1: as before rows of any
// width were hosted on a GPU). gpu: the
// program's device is a GPU (choose_splits). symbolic: the program will have symbolic sizes, so
// split sums over outer dims read zero-padded chunks (any length).
inline graph::Graph split_reductions(const graph::Graph& g, int partials = -1, bool gpu = true, bool symbolic = false) {
  std::vector<Dims> row_domains;  // inputs of reductions over their last dim alone
  for (const auto& n : g.nodes) {
    if (!is_reduction(n.op)) continue;
    auto r = detail::describe_reduction(g, n);
    if (r.in.size() >= 2 && r.suffix && r.dims.size() == 1) row_domains.push_back(r.in);
  }
  return rewrite::rebuild_graph(g, [&](rewrite::Builder& b, const graph::Node& n, const int* in) {
    if (!is_reduction(n.op)) return b.rebuild(n, in);
    auto r = detail::describe_reduction(g, n);
    // Over size-1 dims only: a view, in the reduction's dtype (a sum of booleans or i32 is i64).
    if (r.reduced == 1 && r.in.product() > 0) return b.cast(b.reshape(in[0], n.shape), n.dt);
    // A column sum over every dim but the last of a row reduction's input: what a row kernel may
    // host (2-D only under partials 1, the rule before).
    auto row_domain = [&](const Dims& in) {
      return std::find(row_domains.begin(), row_domains.end(), in) != row_domains.end();
    };
    const bool all_but_last = partials != 0 && n.op == Op::sum && r.prefix && r.dims.size() + 1 == r.in.size() &&
                              (partials != 1 || r.in.size() == 2);
    bool hosted = all_but_last && row_domain(r.in);
    // A sum over a view that only merges leading dims (a linear's [B * T, d] view of [B, T, d],
    // whose bias gradient it sums) sums the tensor behind the view instead where a row kernel over
    // that tensor may host it: the chunks are the same rows.
    int source = in[0];
    if (all_but_last && !hosted && partials != 1 && b[source].op == Op::reshape && !b[source].unsized) {
      const Dims t = b[b[source].in[0]].shape;
      if (t.size() > r.in.size() && t.back() == r.in.back() && t.product() == r.in.product() && row_domain(t)) {
        source = b[source].in[0];
        r.in = t;
        r.dims = Dims{};
        for (int d = 0; d + 1 < t.size(); ++d) r.dims.push_back(d);
        hosted = true;
      }
    }
    std::int64_t s = detail::choose_splits(r, hosted, gpu, partials == 1 ? 64 : 16);
    if (s == 1 || !(r.prefix || r.suffix)) return b.rebuild(n, in);
    // prefix: [S, R/S, K] reduce 1 then 0; suffix: [K, S, R/S] reduce 2 then 1. A full reduction
    // (K = 1) is [S, R/S]: its chunks are rows, contiguous, read by a row kernel's threads side by
    // side, where [S, R/S, 1] made them columns, a thread's lanes R/S apart (cross_entropy's mean
    // over 32768 rows: a gather a lane).
    const std::int64_t chunk = r.reduced / s, covered = s * chunk;
    const bool full = r.prefix && r.kept == 1;
    auto kept_last = [&](Dims d) {
      if (!full) d.push_back(r.kept);
      return d;
    };
    Dims shape = r.prefix ? kept_last(Dims{s, chunk}) : Dims{r.kept, s, chunk};
    // 16-bit sums keep their partial results in f32, as one accumulation would.
    bool narrow = n.dt == kiln::dtype::f16 || n.dt == kiln::dtype::bf16;
    int wide = narrow ? b.cast(source, kiln::dtype::f32) : source;
    // Outer dims reduced: the chunk length is left to inference ([S, -1, K]). A sum in a program
    // with symbolic sizes reads its input through a zero-padded reshape (graph/infer_views.hpp): the last
    // chunks run past the input's end and read 0, so one program serves every length (a
    // layer_norm backward with shapes::dynamic was compiled again at every new row count: its
    // chunks and a rest covered exactly the first call's rows). With static sizes a length that is
    // no multiple of S keeps the rest below (the padded chunks' tests measured up to 1.16x slower
    // there: a column sum over 4194x32000 bf16, NOTES item 121), except a sum a GPU row kernel may
    // host: its blocks visit every row whatever their number, so padded chunks let it take the sums
    // of an odd row count too (the sweep's layer_norm backward over 43690 rows of 3072 columns
    // re-read x and dy in a split kernel; NOTES item 154), and are read only where it does not.
    const bool padded_host = hosted && gpu && partials != 1 && n.op == Op::sum;
    if (r.prefix && (covered == r.reduced || (symbolic && n.op == Op::sum) || padded_host)) {
      Attrs view;
      view.dims = kept_last(Dims{s, -1});
      view.keepdim = n.op == Op::sum && (symbolic || covered != r.reduced);  // zero-padded
      // Padded, the kept length is the input's own (a dynamic norm backward over 16K+ rows named
      // the compiling call's K and compiled again at every other row length).
      if (view.keepdim && !full) view.dims[2] = Attrs::input_dim(r.in.size() - 1);
      Attrs first;
      first.dims = {1};
      first.c = split_stage_mark;
      first.d = n.attrs.d;
      int partial = b.op(n.op, {b.op(Op::reshape, {wide}, view)}, first);
      if (s >= 256) {
        // Many chunks (256 for a layer_norm's dw over 16384 rows): summed in two steps of 16, so
        // that each step still has a thread a (step, kept element); one step of 256 left 16 SMs busy.
        Attrs mid = first;
        mid.d = 0;
        partial = b.op(n.op, {b.reshape(partial, kept_last(Dims{16, s / 16}))}, mid);
      }
      Attrs second;
      second.dims = {0};
      second.d = n.attrs.d;
      const int total = b.op(n.op, {partial}, second);
      return b.reshape(narrow ? b.cast(total, n.dt) : total, n.shape);
    }
    // Otherwise (static sizes, or a maximum or minimum, over a length no multiple of S; inner dims,
    // split only by a divisor) the input as [R, K] (or [K, R]), cut into the covered rows and the rest. A full
    // reduction's is [R, 1] (the rest summed over both dims), not [R]: a reshape of a 1-D input
    // into its own shape is no reshape, and without it the program ran at any length, its first
    // stage covering the compiling call's rows and one program the rest (symbolic sizes); [R, 1]
    // fails inference at another R and recompiles, as a full reduction of a 2-D input does.
    const int rdim = r.prefix ? 0 : 1;
    int flat =
        covered == r.reduced ? wide : b.reshape(wide, r.prefix ? Dims{r.reduced, r.kept} : Dims{r.kept, r.reduced});
    auto rows = [&](std::int64_t start, std::int64_t stop) {
      Attrs cut;
      cut.a = rdim, cut.b = start, cut.c = stop, cut.d = 1;
      return b.op(Op::slice, {flat}, cut);
    };
    int x = b.reshape(covered == r.reduced ? wide : rows(0, covered), shape);
    Attrs first;
    first.dims = {r.prefix ? 1 : 2};
    first.c = split_stage_mark;
    first.d = n.attrs.d;
    int partial = b.op(n.op, {x}, first);
    if (r.prefix && s >= 256) {
      // Many chunks (256 for a layer_norm's dw over 16384 rows): summed in two steps of 16, so that
      // each step still has a thread a (step, kept element); one step of 256 left 16 SMs busy.
      Attrs mid = first;
      mid.d = 0;
      partial = b.op(n.op, {b.reshape(partial, kept_last(Dims{16, s / 16}))}, mid);
    }
    Attrs second;
    second.dims = {r.prefix ? 0 : 1};
    second.d = n.attrs.d;
    int total = b.op(n.op, {partial}, second);
    if (covered != r.reduced) {  // the remaining rows, fewer than S, reduced alone
      Attrs rest;
      rest.dims = full ? Dims{0, 1} : Dims{rdim};
      rest.d = n.attrs.d;
      // The rest runs to the end of the rows, not to this call's R: a program reused at more rows
      // (symbolic sizes) sums them there, one at fewer fails inference and recompiles; a rest
      // ending at R dropped every later row.
      const int rest_rows = rows(covered, std::numeric_limits<std::int64_t>::max());
      total = b.op(detail::combine_op(n.op), {total, b.op(n.op, {rest_rows}, rest)});
    }
    return b.reshape(narrow ? b.cast(total, n.dt) : total, n.shape);
  });
}

}  // namespace kiln::schedule
