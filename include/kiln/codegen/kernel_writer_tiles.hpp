// Transposed operands of pointwise kernels on the GPU: tiles staged through shared memory.
//
// A pointwise kernel walks its domain in row-major order, so every store and every contiguous input
// moves whole sectors. An input read through a transpose (`transpose(x) + y`) is contiguous along
// another dim `a`: consecutive lanes then touch addresses a row apart, one sector each for 2 or 4
// useful bytes (2.7x torch.compile at f32, 4.9x at bf16 before this file). Such a kernel is written
// in square tiles of dims (a, last): the block first reads each staged input with its lanes along a
// (coalesced for it) into a shared-memory tile, then computes and stores with its lanes along the
// last dim (coalesced for everything else), reading the staged values back across the tile. The
// tile is padded by a column, so both passes are free of bank conflicts.
//
// Which kernels: a probe writes the kernel once with a symbol per dim and records each load's
// offset; an input is staged when its offset is linear in dims a and last with stride 1 along a and
// a stride of neither 0 nor 1 along the last dim. The kernel is tiled when the tiles' occupied
// lanes (a tile overhangs dims that are not multiples of its side) beat the sectors the untiled
// loads use: from the sizes and the element bytes, no size thresholds.
//
// On the CPU the caches do the transposing: a program takes 64 rows of dim a by 16 lanes of the
// last dim, row after row, so the 16 lines of the transposed input that a row gathers from serve
// the next 15 rows from L1 (the untiled walk came back to a line only after a whole row of the last
// dim, from L2 at best: `transpose(x) + y` over 4096^2 f32 ran 11x slower than `x + y`). Tiled when
// each lane of the untiled walk reads its own line and a row of the last dim's lines overflows L1.
#pragma once
#include <unistd.h>

#include "kernel_writer.hpp"

namespace kiln::codegen {

// The coefficient of `s` in e when e is linear in s (a sum of terms, each free of s or a product
// of s and factors free of it); nullopt when s appears otherwise (floordiv, mod, min, max).
inline std::optional<Sym> linear_coefficient(const Sym& e, const Sym& s) {
  auto free = e.free_symbols();
  if (std::none_of(free.begin(), free.end(), [&](const Sym& f) { return f == s; })) return Sym(0);
  if (e == s) return Sym(1);
  if (e.kind() == SymKind::add) {
    Sym sum(0);
    for (const Sym& t : e.args()) {
      auto c = linear_coefficient(t, s);
      if (!c) return std::nullopt;
      sum = sum + *c;
    }
    return sum;
  }
  if (e.kind() == SymKind::mul) {
    Sym rest(1);
    std::optional<Sym> c;
    for (const Sym& f : e.args()) {
      auto fc = linear_coefficient(f, s);
      if (!fc) return std::nullopt;
      if (fc->is_constant() && fc->constant_value() == 0) {
        rest = rest * f;
        continue;
      }
      if (c) return std::nullopt;  // s times s
      c = fc;
    }
    return c ? std::optional<Sym>(*c * rest) : std::optional<Sym>(Sym(0));
  }
  return std::nullopt;
}

inline bool is_const(const Sym& s, std::int64_t v) { return s.is_constant() && s.constant_value() == v; }

// Whether a load at `offset` is contiguous along `a` and strided along `b`: one to stage.
// Strides are sizes or constants: a coefficient holding a tile symbol (ids from 1000) is not one.
inline bool staged_access(const Sym& offset, const Sym& a, const Sym& b) {
  auto ca = linear_coefficient(offset, a), cb = linear_coefficient(offset, b);
  if (!ca || !cb) return false;
  auto fs = cb->free_symbols();
  if (std::any_of(fs.begin(), fs.end(), [](const Sym& f) { return f.symbol_id() >= 1000; })) return false;
  return is_const(*ca, 1) && !is_const(*cb, 0) && !is_const(*cb, 1);
}

// The host's L1 data cache in bytes (32 KiB where the C library cannot say).
inline std::int64_t l1_data_bytes() {
  static const std::int64_t bytes = [] {
    long b = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return b > 0 ? static_cast<std::int64_t>(b) : std::int64_t{32} << 10;
  }();
  return bytes;
}

// Decides the tiling of a pointwise kernel (tile_dim_, tile_) before a line is written.
inline void KernelWriter::choose_tiling(int max_item) {
  const auto& p = env_[plan_.domain];
  const int rank = static_cast<int>(p.size());
  if (rows() || probe_ || rank < 2 || tune_.transpose == 0) return;
  const bool cpu = target_ == Target::cpu;
  // Only kernels that read something through a permute or a strided argument can have one.
  bool permuted = false;
  for (int v : plan_.members) {
    if (g_[v].op == Op::permute) permuted = true;
    for (int c = 0; c < g_[v].n_in; ++c)
      if (int in = g_[v].in[c]; g_[in].op == Op::arg && strides_of_(in) != contiguous_strides(env_[in]))
        permuted = true;
  }
  if (!permuted) return;
  KernelWriter probe(g_, s_, env_, k_, target_, strides_of_, tune_);
  probe.probe_ = true;
  probe.write();
  // GPU: tiles of 32 x 32 elements of 4 bytes or more, 64 x 64 of narrower ones (tile_threads has
  // the threads); the knob's sides (16, 32, 64) override it. CPU: 64 rows of 16 lanes.
  const std::int64_t side = cpu                   ? cpu_tile_rows
                            : tune_.transpose > 1 ? std::clamp<std::int64_t>(next_pow2(tune_.transpose), 16, 64)
                            : max_item >= 4       ? 32
                                                  : 64;
  const std::int64_t lanes = cpu ? cpu_tile_lanes : side, line = cpu ? 64 : 32;  // the memory's unit
  const auto& example = env_.example;
  // Bytes of staged loads for each candidate dim, and the sectors' share their untiled loads use.
  std::vector<double> bytes(rank, 0), untiled(rank, 1);
  for (const auto& [node, offset] : probe.probe_loads_) {
    const Sym& last = probe.dims_[rank - 1];
    for (int a = 0; a < rank - 1; ++a) {
      if (!staged_access(offset, probe.dims_[a], last)) continue;
      auto stride = linear_coefficient(offset, last);
      std::int64_t item = static_cast<std::int64_t>(itemsize(g_[node].dt));
      std::int64_t step = std::abs(stride->eval(example)) * item;  // bytes between neighbouring lanes
      bytes[a] += static_cast<double>(item);
      double share = std::min(1.0, static_cast<double>(item) / static_cast<double>(std::min(step, line)));
      // The CPU's untiled walk finds a line again after a row of the last dim: from L1 if they fit.
      if (cpu && (step < line || p[rank - 1].eval(example) * line <= l1_data_bytes())) share = 1;
      untiled[a] = std::min(untiled[a], share);
    }
  }
  int best = static_cast<int>(std::max_element(bytes.begin(), bytes.end()) - bytes.begin());
  if (bytes[best] == 0) return;
  auto occupied = [&](std::int64_t n, std::int64_t tile) {  // the share of a dim's tiles inside it
    std::int64_t tiles = (std::max<std::int64_t>(n, 1) + tile - 1) / tile;
    return static_cast<double>(n) / static_cast<double>(tiles * tile);
  };
  double tiled = occupied(p[best].eval(example), side) * occupied(p[rank - 1].eval(example), lanes);
  if (tiled <= untiled[best]) return;
  tile_dim_ = best;
  tile_ = static_cast<int>(side);
}


// The domain's index in a tiled kernel: ya (a tile of the thread's values along dim a), xb (its
// place along the last dim), the other dims from the tile's zindex.
inline std::vector<Sym> KernelWriter::tiled_index() {
  const auto& p = env_[plan_.domain];
  const int rank = static_cast<int>(p.size());
  if (probe_) {
    for (int d = 0; d < rank; ++d)
      dims_.push_back(Sym::symbol("d" + std::to_string(d), 1010 + d, {.nonnegative = true, .bound = p[d]}));
    return dims_;
  }
  std::vector<Sym> others;
  for (int d = 0; d < rank - 1; ++d)
    if (d != tile_dim_) others.push_back(p[d]);
  znumel_ = product(others);
  Sym z = Sym::symbol("zindex", 1004, {.nonnegative = true, .bound = znumel_});
  std::vector<Sym> zi = unravel(z, detail::nonzero(others));
  std::vector<Sym> idx;
  std::size_t o = 0;
  for (int d = 0; d < rank; ++d)
    idx.push_back(d == tile_dim_ ? ya_ : d == rank - 1 ? xb_ : zi[o++]);
  return idx;
}

inline void KernelWriter::write_tiled() {
  const auto& p = env_[plan_.domain];
  const int rank = static_cast<int>(p.size());
  if (probe_) {  // the loads' offsets are all it is for
    auto idx = tiled_index();
    for (int s : plan_.stores) store(s, idx);
    return;
  }
  ya_ = Sym::symbol("ya", 1005, {.nonnegative = true, .bound = p[tile_dim_]});
  xb_ = Sym::symbol("xb", 1006, {.nonnegative = true, .bound = p[rank - 1]});
  sa_ = Sym::symbol("sa", 1007, {.nonnegative = true, .bound = p[tile_dim_]});
  sb_ = Sym::symbol("sb", 1008, {.nonnegative = true, .bound = p[rank - 1]});
  auto idx = tiled_index();
  section_ = Section::row_open;
  line("const ix anumel = " + index_code(p[tile_dim_]) + ", bnumel = " + index_code(p[rank - 1]) +
       ", znumel = " + index_code(znumel_) + ";");
  if (target_ == Target::cpu) {  // a program a tile: TILE rows of dim a, one after the other
    line("const ix atiles = (anumel + TILE - 1) / TILE, btiles = (bnumel + XVEC - 1) / XVEC;");
    line("const ix zindex = kiln_pid / (atiles * btiles);");
    line("const ix aoffset = kiln_pid / btiles % atiles * TILE, boffset = kiln_pid % btiles * XVEC;");
    line("const auto xb = boffset + kiln::arange<XVEC, ix>();");
    line("for (ix ya = aoffset; ya < aoffset + TILE; ++ya) {");
    ++indent_;
    section_ = Section::body;
    // Tiles that cover the domain exactly need no bounds tests (a constant mask folds away).
    const bool exact = divides(tile_, p[tile_dim_]) && divides(config_.xvec, p[rank - 1]);
    line(exact ? "const auto xmask = kiln::full<XVEC>(true);" : "const auto xmask = (xb < bnumel) & (ya < anumel);");
    for (int s : plan_.stores) store(s, idx);
    --indent_;
    line("}");
    return;
  }
  line("const ix atiles = (anumel + TILE - 1) / TILE, btiles = (bnumel + TILE - 1) / TILE;");
  line("for (ix kiln_tile = blockIdx.x; kiln_tile < znumel * atiles * btiles; kiln_tile += gridDim.x) {");
  ++indent_;
  line("const ix zindex = kiln_tile / (atiles * btiles);");
  line("const ix aoffset = kiln_tile / btiles % atiles * TILE, boffset = kiln_tile % btiles * TILE;");
  line("// staged inputs, lanes along dim " + std::to_string(tile_dim_));
  line("const ix sa = aoffset + threadIdx.x % TILE;");
  line("const auto sb = boffset + (ix)(threadIdx.x / TILE) + TROWS * kiln::arange<TILE / TROWS, ix>();");
  line("const auto smask = (sb < bnumel) & (sa < anumel);");
  section_ = Section::body;
  line("// the rest, lanes along the last dim");
  line("const ix xb = boffset + threadIdx.x % TILE;");
  line("const auto ya = aoffset + (ix)(threadIdx.x / TILE) + TROWS * kiln::arange<TILE / TROWS, ix>();");
  line("const auto xmask = (ya < anumel) & (xb < bnumel);");
  for (int s : plan_.stores) store(s, idx);
  line("__syncthreads();  // the stage is read before the next tile fills it");
  --indent_;
  line("}");
}

// A staged load: the tile's values enter shared memory in the staging pass (lanes along dim a) and
// come back across it; nullopt when the access is not one to stage.
inline std::optional<KernelWriter::Value> KernelWriter::staged_load(int node, const Sym& offset) {
  if (target_ != Target::cuda || !staged_access(offset, ya_, xb_)) return std::nullopt;
  std::string ptr = param_for(node, false);
  SymMap m;
  m.emplace(ya_, sa_);
  m.emplace(xb_, sb_);
  std::string at = index_code(offset.substitute(m));
  kiln::dtype ct = compute_dtype(g_[node].dt);
  // A block's static shared memory stops at 48 KiB: inputs past it are read unstaged.
  const std::string key = ptr + "[" + at + "]";
  const auto bytes = static_cast<std::int64_t>(tile_) * (tile_ + 1) * static_cast<std::int64_t>(itemsize(ct));
  if (!staged_.count(key) && stage_bytes_ + bytes > 48 * 1024) return std::nullopt;
  auto [it, fresh_stage] = staged_.try_emplace(key, "stage" + std::to_string(staged_.size()));
  if (fresh_stage) {
    stage_bytes_ += bytes;
    stage_decls_.push_back("__shared__ " + detail::c_type(ct) + " " + it->second + "[TILE][TILE + 1];");
    Section was = section_;
    section_ = Section::stage;
    line("kiln::stage_put<TILE, TROWS>(" + it->second + ", kiln::load(" + ptr + ", " + at + ", smask));");
    section_ = was;
  }
  return bind("kiln::stage_get<TILE, TROWS>(" + it->second + ")", ct);
}

}  // namespace kiln::codegen
