// Guards: what a compiled program assumed about its inputs, as explicit data. A call replays a
// program only when every guard holds; a failed guard names itself (KILN_LOGS=recompiles). The
// check runs on the cache-hit path, so it compares numbers only: no strings, no allocation.
#pragma once
#include <string>
#include <vector>

#include "../graph/graph.hpp"
#include "../ir/shape_env.hpp"

namespace kiln::guards {

struct ArgGuard {
  kiln::dtype dt;
  Device device;
  int rank;
  Dims shape;       // static dims (symbolic dims hold -1)
  bool contiguous;  // contiguous strides required; otherwise `strides` exactly
  Dims strides;
  bool read = true;  // false: the program never reads it (its sizes and strides are not guarded)
};

struct GuardSet {
  std::vector<ArgGuard> args;
  std::vector<Attrs> attrs;            // every node's attributes, in capture order
  std::vector<Op> ops;                 // the op of each (filled when some are symbolic)
  std::vector<std::uint8_t> symbolic;  // per attribute: its symbolic fields (graph.hpp sym_bits)
  // Dynamic shapes: per node and dim, the constant it must equal (>= 0) or the symbol it binds.
  std::vector<std::vector<std::int64_t>> node_const;
  std::vector<std::vector<int>> node_symbol;
  bool dynamic = false;
  // Symbolic sizes under which some kernels index in int (codegen's narrow_indices): the nodes and
  // arguments they touch hold at most index_limit elements (an argument: its reach through its
  // strides), and each kernel's index span, its programs' rows or elements past the end included,
  // stays below 2^31 (index_spans: products of two sizes over the program's symbols); 0 none.
  std::int64_t index_limit = 0;
  std::vector<int> index_nodes, index_args;
  std::vector<std::pair<Sym, Sym>> index_spans;

  std::vector<std::string> describe() const;
  std::string describe_failure(int index) const;
};

inline std::string arg_name(int i) { return "args[" + std::to_string(i) + "]"; }

inline GuardSet make_guards(const graph::Graph& g, const ir::ShapeEnv& env, const std::vector<const Tensor*>& args,
                            std::vector<Attrs> attrs) {
  GuardSet gs;
  gs.dynamic = env.is_dynamic();
  for (const auto& n : g.nodes) gs.dynamic = gs.dynamic || n.sym_attrs;  // re-inferred with each call's values
  gs.attrs = std::move(attrs);
  for (std::size_t i = 0; i < args.size(); ++i) {
    const Tensor& t = *args[i];
    ArgGuard a{t.dtype(), t.device(), t.dim(), t.shape(), t.is_contiguous(), t.is_contiguous() ? Dims{} : t.strides()};
    gs.args.push_back(a);
  }
  // An argument the graph never reads (a lambda parameter left unused) pins no shape or layout.
  for (auto& a : gs.args) a.read = false;
  for (const auto& n : g.nodes)
    if (n.op == Op::arg && n.slot >= 0 && n.slot < static_cast<int>(gs.args.size()))
      gs.args[static_cast<std::size_t>(n.slot)].read = true;
  for (auto& a : gs.args)
    if (!a.read) std::fill(a.shape.begin(), a.shape.end(), -1);
  if (gs.dynamic) {
    gs.node_const.resize(g.size());
    gs.node_symbol.resize(g.size());
    for (int n = 0; n < g.size(); ++n)
      for (const Sym& d : env[n]) {
        // A size that follows from others (an expression: a padded split's chunk length) is
        // inference's to check: -2.
        gs.node_const[n].push_back(d.is_constant() ? d.constant_value() : d.is_symbol() ? -1 : -2);
        gs.node_symbol[n].push_back(d.is_symbol() ? d.symbol_id() : -1);
      }
    for (int n = 0; n < g.size(); ++n)
      if (g[n].op == Op::arg)
        for (int k = 0; k < g[n].shape.size(); ++k)
          if (gs.node_symbol[n][k] >= 0) gs.args[g[n].slot].shape[k] = -1;
  }
  return gs;
}

// Returns -1 when the arguments satisfy the argument guards, else the index of the failed guard
// (see describe()). Dims that are symbolic are checked by check_shapes.
inline int check_args(const GuardSet& gs, const Tensor* const* args, std::size_t nargs) {
  if (nargs != gs.args.size()) return 0;
  for (std::size_t i = 0; i < nargs; ++i) {
    const Tensor& t = *args[i];
    const ArgGuard& a = gs.args[i];
    int base = static_cast<int>(i) * 4;
    if (t.dtype() != a.dt) return base + 0;
    if (!(t.device() == a.device)) return base + 1;
    if (t.dim() != a.rank) return base + 2;
    for (int d = 0; d < a.rank; ++d)
      if (a.shape[d] >= 0 && t.shape()[d] != a.shape[d]) return base + 2;
    if (!a.read) continue;
    if (a.contiguous ? !t.is_contiguous() : !(t.strides() == a.strides)) return base + 3;
  }
  return -1;
}

// Dynamic mode: the inferred shapes of this call must keep every constant dim and bind each
// symbol consistently. Returns -1 or the failing node.
template <class ShapeOf>
int check_shapes(const GuardSet& gs, ShapeOf&& shape_of, std::int64_t* symbols, int nsym) {
  for (int s = 0; s < nsym; ++s) symbols[s] = -1;
  for (std::size_t n = 0; n < gs.node_const.size(); ++n) {
    const Dims& shape = shape_of(static_cast<int>(n));
    for (std::size_t k = 0; k < gs.node_const[n].size(); ++k) {
      std::int64_t v = shape[static_cast<int>(k)];
      if (gs.node_const[n][k] >= 0) {
        if (v != gs.node_const[n][k]) return static_cast<int>(n);
        continue;
      }
      if (gs.node_const[n][k] == -2) continue;
      std::int64_t& bound = symbols[gs.node_symbol[n][k]];
      if (v <= 1 || (bound >= 0 && bound != v)) return static_cast<int>(n);
      bound = v;
    }
  }
  return -1;
}

// Whether a dynamic call stays within gs.index_limit (see GuardSet): `shape_of` gives the call's
// inferred node shapes, `symbols` its symbols' values.
template <class ShapeOf>
bool within_index_limit(const GuardSet& gs, const Tensor* const* args, std::size_t nargs, ShapeOf&& shape_of,
                        Bindings symbols) {
  if (gs.index_limit <= 0) return true;
  const std::int64_t limit = gs.index_limit;
  auto fits = [&](const Dims& shape, const Dims* strides) {
    std::int64_t reach = 1;
    for (int d = 0; d < shape.size(); ++d)
      if (shape[d] == 0) return true;
    for (int d = 0; d < shape.size(); ++d) {
      const std::int64_t n = shape[d], st = strides ? ((*strides)[d] < 0 ? -(*strides)[d] : (*strides)[d]) : 0;
      if (n > limit || st > limit) return false;
      if (strides)
        reach += (n - 1) * st;
      else if (n > limit / reach)  // an element count: overflow-safe
        return false;
      else
        reach *= n;
      if (reach > limit) return false;
    }
    return true;
  };
  for (int n : gs.index_nodes)
    if (!fits(shape_of(n), nullptr)) return false;
  for (int a : gs.index_args)
    if (a < static_cast<int>(nargs)) {
      if (!fits(args[a]->shape(), &args[a]->strides())) return false;
    }
  for (const auto& [x, r] : gs.index_spans) {
    const std::int64_t xs = x.eval(symbols), rs = r.eval(symbols);
    if (xs > limit || rs > limit || (rs > 0 && xs > (std::int64_t{1} << 31) / rs)) return false;
  }
  return true;
}

// The compact cache key of a call: what every guard set pins exactly and cheaply (each argument's
// dtype, device, rank and contiguity; every attribute). Programs are found by this key in constant
// time; sizes, strides and symbolic shapes are then checked against the few programs under it.
// A hash: two keys that collide only share a bucket, and the guards still tell them apart.
namespace detail {
constexpr std::uint64_t mix(std::uint64_t h, std::uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 29);
}
inline std::uint64_t hash_attrs(std::uint64_t h, const Attrs& a) {
  h = mix(h, static_cast<std::uint64_t>(a.dims.size()));
  for (auto d : a.dims) h = mix(h, static_cast<std::uint64_t>(d));
  h = mix(mix(mix(mix(h, static_cast<std::uint64_t>(a.a)), static_cast<std::uint64_t>(a.b)),
              static_cast<std::uint64_t>(a.c)),
          static_cast<std::uint64_t>(a.d));
  return mix(h, static_cast<std::uint64_t>(static_cast<std::uint32_t>(a.custom)) << 16 |
                    static_cast<std::uint64_t>(a.dt) << 2 | std::uint64_t{a.keepdim} << 1 | std::uint64_t{a.all});
}

// An attribute hashed without its symbolic fields (graph.hpp's sym_bits; a slice's bounds, a
// reshape's sizes): calls that differ only there share a bucket.
inline std::uint64_t hash_symbolic_attrs(std::uint64_t h, Op op, const Attrs& a) {
  Attrs masked = a;
  if (op == Op::slice)
    masked.b = masked.c = masked.d = 0;
  else
    for (auto& d : masked.dims) d = 0;
  return hash_attrs(h, masked);
}
inline std::uint64_t hash_arg(std::uint64_t h, kiln::dtype dt, Device d, int rank, bool contiguous) {
  return mix(h, static_cast<std::uint64_t>(dt) | static_cast<std::uint64_t>(d.is_cuda()) << 8 |
                    static_cast<std::uint64_t>(static_cast<std::uint32_t>(d.index)) << 16 |
                    static_cast<std::uint64_t>(rank) << 48 | std::uint64_t{contiguous} << 56);
}
}  // namespace detail

// The key of a call. `symbolic` (per attribute: nonzero when its symbolic fields are left out) and
// `ops` (the op of each attribute) may be null: every attribute is then hashed whole.
inline std::uint64_t call_key(const Tensor* const* args, int nargs, const Attrs* const* attrs, int nattrs,
                              const std::uint8_t* symbolic = nullptr, const Op* ops = nullptr) {
  std::uint64_t h = detail::mix(0, static_cast<std::uint64_t>(nargs) << 32 | static_cast<std::uint32_t>(nattrs));
  for (int i = 0; i < nargs; ++i)
    h = detail::hash_arg(h, args[i]->dtype(), args[i]->device(), args[i]->dim(), args[i]->is_contiguous());
  for (int i = 0; i < nattrs; ++i)
    h = symbolic && symbolic[i] ? detail::hash_symbolic_attrs(h, ops[i], *attrs[i]) : detail::hash_attrs(h, *attrs[i]);
  return h;
}
// The exact key of a call: its shapes and strides too. Programs without symbolic sizes are found
// by it, so a function with a thousand static programs finds one as fast as with one.
// `key` is the call's call_key without symbolic fields left out.
inline std::uint64_t exact_call_key(std::uint64_t key, const Tensor* const* args, int nargs) {
  std::uint64_t h = key;
  for (int i = 0; i < nargs; ++i) {
    const Tensor& t = *args[i];
    for (auto d : t.shape()) h = detail::mix(h, static_cast<std::uint64_t>(d));
    if (!t.is_contiguous())
      for (auto st : t.strides()) h = detail::mix(h, static_cast<std::uint64_t>(st) ^ 0x5bd1e995u);
  }
  return h;
}
inline std::uint64_t exact_guard_key(const GuardSet& gs);

// The key of the calls a guard set admits (equal to call_key of each of them, under the same
// `symbolic` and `ops`).
inline std::uint64_t guard_key(const GuardSet& gs, const std::uint8_t* symbolic = nullptr, const Op* ops = nullptr) {
  std::uint64_t h =
      detail::mix(0, static_cast<std::uint64_t>(gs.args.size()) << 32 | static_cast<std::uint32_t>(gs.attrs.size()));
  for (const ArgGuard& a : gs.args) h = detail::hash_arg(h, a.dt, a.device, a.rank, a.contiguous);
  for (std::size_t i = 0; i < gs.attrs.size(); ++i)
    h = symbolic && symbolic[i] ? detail::hash_symbolic_attrs(h, ops[i], gs.attrs[i])
                                : detail::hash_attrs(h, gs.attrs[i]);
  return h;
}

// (Only for guard sets without symbolic sizes: every shape is exact.)
inline std::uint64_t exact_guard_key(const GuardSet& gs) {
  std::uint64_t h = guard_key(gs);
  for (const ArgGuard& a : gs.args) {
    for (auto d : a.shape) h = detail::mix(h, static_cast<std::uint64_t>(d));
    if (!a.contiguous)
      for (auto st : a.strides) h = detail::mix(h, static_cast<std::uint64_t>(st) ^ 0x5bd1e995u);
  }
  return h;
}

inline std::vector<std::string> GuardSet::describe() const {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const ArgGuard& a = args[i];
    std::string shape = "[";
    for (int d = 0; d < a.rank; ++d)
      shape += (d ? ", " : "") + (a.shape[d] < 0 ? std::string("s?") : std::to_string(a.shape[d]));
    out.push_back(arg_name(i) + ".dtype == " + std::string(name(a.dt)));
    out.push_back(arg_name(i) + ".device == " + a.device.str());
    out.push_back(arg_name(i) + ".shape == " + shape + "]");
    out.push_back(a.contiguous ? arg_name(i) + " is contiguous" : arg_name(i) + ".strides == " + a.strides.str());
  }
  if (dynamic) out.push_back("symbolic sizes: dims sharing a symbol stay equal, sizes 0 and 1 stay specialised");
  int symbolic_attrs = 0;
  for (auto b : symbolic) symbolic_attrs += b != 0;
  if (symbolic_attrs)
    out.push_back("symbolic attributes: the bounds or sizes of " + std::to_string(symbolic_attrs) +
                  " views are each call's values (kernel arguments)");
  out.push_back("attributes (dims, view sizes) of " + std::to_string(attrs.size()) + " nodes unchanged");
  if (index_limit > 0)
    out.push_back(std::to_string(index_nodes.size()) + " nodes and " + std::to_string(index_args.size()) +
                  " arguments at most " + std::to_string(index_limit) + " elements, " +
                  std::to_string(index_spans.size()) + " kernels' index spans below 2^31 (they index in 32 bits)");
  return out;
}

inline std::string GuardSet::describe_failure(int index) const {
  auto all = describe();
  return index >= 0 && index < static_cast<int>(all.size()) ? all[index] : "guard " + std::to_string(index);
}

}  // namespace kiln::guards
