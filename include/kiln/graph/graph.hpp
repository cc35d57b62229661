// The flattened graph: a run-time node table that every stage after capture works on. Each node is
// one op with input ids, its run-time attributes, and (after inference) its shape and dtype.
#pragma once
#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "../expr/custom_op.hpp"
#include "../expr/node.hpp"

namespace kiln::graph {

// Inputs a node can have: four for ops, five for the backward of a four-input custom op, six for
// the fused attention backward's (q, k, v, the output's cotangent, the row statistics, the scale),
// and two more for the tensors an inlined score_mod reads (autodiff/score_mod.hpp).
inline constexpr int max_inputs = 8;

// Attributes that may become symbolic, as bits of Node::sym_attrs: a slice's start and step (kernel
// arguments) and its stop, a reshape's or expand's sizes (they only change shapes, re-inferred at
// each call). A reduction's dims and a permutation stay static.
namespace sym_bits {
inline constexpr std::uint8_t start = 1, step = 2, sizes = 4;
}
constexpr bool has_symbolic_attrs(Op op) {
  return op == Op::slice || op == Op::slice_backward || op == Op::reshape || op == Op::expand;
}
// The bits in which two attributes of a node of op `op` differ, if they differ only in fields that
// may be symbolic; 0xff when they differ in anything else (then they are different programs).
inline std::uint8_t symbolic_difference(Op op, const Attrs& x, const Attrs& y) {
  if (!has_symbolic_attrs(op)) return x == y ? 0 : 0xff;
  Attrs a = x, b = y;
  std::uint8_t bits = 0;
  if (op == Op::slice) {
    if (a.b != b.b) bits |= sym_bits::start;
    if (a.d != b.d) bits |= sym_bits::step;
    if (a.c != b.c) bits |= sym_bits::sizes;
    a.b = b.b, a.c = b.c, a.d = b.d;
  } else if (a.dims.size() == b.dims.size()) {
    if (!(a.dims == b.dims)) bits |= sym_bits::sizes;
    a.dims = b.dims;
  }
  return a == b ? bits : 0xff;
}
// Whether attributes match when the fields in `bits` are free.
inline bool attrs_match(Op op, std::uint8_t bits, const Attrs& x, const Attrs& y) {
  if (!bits) return x == y;
  std::uint8_t d = symbolic_difference(op, x, y);
  return d != 0xff && (d & ~bits) == 0;
}
// Copies a call's values of the symbolic fields into a node's attributes.
inline void apply_symbolic(Op op, const Attrs& call, Attrs& node) {
  if (op == Op::slice || op == Op::slice_backward)
    node.b = call.b, node.c = call.c, node.d = call.d;
  else
    node.dims = call.dims;
}

struct Node {
  Op op = Op::arg;
  std::array<int, max_inputs> in{-1, -1, -1, -1, -1, -1, -1, -1};
  int n_in = 0;
  int slot = -1;         // arg: argument index; scalar: scalar slot
  bool weak = false;     // a C++ scalar (or computed only from scalars): lower promotion priority
  bool floating = true;  // scalar: floating-point C++ type
  double value = 0;      // constant: its value (constants come from rewrite rules, never from users)
  Attrs attrs;
  // The captured attributes this node came from (its index in a call's gathered attrs), and which
  // of them are symbolic (sym_bits): values of each call, re-applied before inference, never
  // simplified away, merged only with nodes of the same capture.
  int capture = -1;
  std::uint8_t sym_attrs = 0;
  bool unsized = false;  // structural graphs only: attributes that depend on sizes, resolved later
  // Filled by infer_shapes:
  kiln::dtype dt = kiln::dtype::f32;
  Dims shape;

  constexpr int input(int i) const { return in[i]; }
  // In a structural graph (no sizes: graph/flatten_type.hpp) nodes whose attributes are unknown carry
  // where they came from in `capture`, so that two of them merge only when they come from one place.
  constexpr bool same_structure(const Node& o) const {
    return op == o.op && in == o.in && slot == o.slot && attrs == o.attrs && floating == o.floating &&
           (op != Op::constant || value == o.value) && sym_attrs == o.sym_attrs &&
           (!(sym_attrs || unsized) || capture == o.capture);
  }
};

struct Graph {
  std::vector<Node> nodes;
  std::vector<int> outputs;
  std::vector<int> output_into;  // per output: the argument slot it is written into (k::assign), else -1
  int num_args = 0;
  int num_scalars = 0;
  // A graph without sizes, built from an expression's type at C++ compile time (k::structure):
  // the passes then build what needs sizes as structural nodes instead of reading shapes.
  bool structural = false;

  constexpr const Node& operator[](int i) const { return nodes[i]; }
  constexpr Node& operator[](int i) { return nodes[i]; }
  constexpr int size() const { return static_cast<int>(nodes.size()); }

  // Number of non-leaf operations (what explain reports as ops_captured / ops_decomposed).
  constexpr int count_ops() const {
    int c = 0;
    for (auto& n : nodes) c += info(n.op).cls != OpClass::leaf;
    return c;
  }

  std::string str() const;
};

// A hash of what same_structure compares (equal structure, equal key).
constexpr std::uint64_t structure_key(const Node& n) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  mix(static_cast<std::uint64_t>(n.op));
  for (int k = 0; k < max_inputs; ++k) mix(static_cast<std::uint64_t>(n.in[k]));
  mix(static_cast<std::uint64_t>(n.slot));
  mix(static_cast<std::uint64_t>(n.attrs.a) ^ (static_cast<std::uint64_t>(n.attrs.b) << 21) ^
      (static_cast<std::uint64_t>(n.attrs.c) << 42) ^ static_cast<std::uint64_t>(n.attrs.d) * 31);
  mix(static_cast<std::uint64_t>(n.attrs.custom));
  for (auto d : n.attrs.dims) mix(static_cast<std::uint64_t>(d));
  mix(static_cast<std::uint64_t>(n.attrs.dt) | (std::uint64_t(n.attrs.keepdim) << 8) |
      (std::uint64_t(n.attrs.all) << 9));
  if (n.op == Op::constant) mix(std::bit_cast<std::uint64_t>(n.value));
  return h;
}

// Common-subexpression elimination as a graph grows: adding a node returns the id of an identical
// one already added through this index, in constant expected time (a hash of the structure, then
// same_structure on the candidates). Scalars are never merged: their values may differ at the next
// call; nor are grad_leaf nodes: each is one wrt argument of one gradient call, an independent
// input even where two wrap the same expression (autodiff/expand_gradients.hpp). Nodes appended to
// the graph by other means are not merge targets. An open-addressing table of (key, id) on a
// std::vector, so that it also runs in constant expressions (k::structure).
class CseIndex {
 public:
  constexpr int find(const Graph& g, const Node& n, std::uint64_t key) const {
    if (n.op == Op::scalar || n.op == Op::grad_leaf || slots_.empty()) return -1;
    for (std::size_t i = home(key);; i = (i + 1) & (slots_.size() - 1)) {
      const Slot& s = slots_[i];
      if (s.id < 0) return -1;
      if (s.key == key && g[s.id].same_structure(n)) return s.id;
    }
  }
  constexpr void insert(std::uint64_t key, int id) {
    if ((used_ + 1) * 2 > slots_.size()) grow();
    std::size_t i = home(key);
    while (slots_[i].id >= 0) i = (i + 1) & (slots_.size() - 1);
    slots_[i] = {key, id};
    ++used_;
  }
  // Indexes every node of g (a graph to extend).
  constexpr void index_all(const Graph& g) {
    for (int i = 0; i < g.size(); ++i) insert(structure_key(g[i]), i);
  }
  // Adds n to g or returns the id of an identical node.
  constexpr int add(Graph& g, Node n) {
    const std::uint64_t k = structure_key(n);
    if (int at = find(g, n, k); at >= 0) return at;
    g.nodes.push_back(std::move(n));
    insert(k, g.size() - 1);
    return g.size() - 1;
  }

 private:
  struct Slot {
    std::uint64_t key = 0;
    int id = -1;
  };
  constexpr std::size_t home(std::uint64_t key) const {
    return static_cast<std::size_t>((key * 0x9e3779b97f4a7c15ull) >> 20) & (slots_.size() - 1);
  }
  // Doubles the table (ids of equal keys keep their insertion order along each probe run).
  constexpr void grow() {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(std::max<std::size_t>(64, old.size() * 2), Slot{});
    used_ = 0;
    std::vector<Slot> live;
    for (const Slot& s : old)
      if (s.id >= 0) live.push_back(s);
    std::sort(live.begin(), live.end(), [](const Slot& a, const Slot& b) { return a.id < b.id; });
    for (const Slot& s : live) insert(s.key, s.id);
  }
  std::vector<Slot> slots_;
  std::size_t used_ = 0;
};

// Depth-first over the nodes reachable from `stack` through inputs, each once: visit(v) says
// whether to go on into v's inputs (false stops there: a buffer, an argument, another kernel).
template <class Visit>
void walk_inputs(const Graph& g, std::vector<int> stack, Visit&& visit) {
  std::vector<bool> seen(g.size(), false);
  while (!stack.empty()) {
    const int v = stack.back();
    stack.pop_back();
    if (v < 0 || seen[v]) continue;
    seen[v] = true;
    if (!visit(v)) continue;
    for (int c = 0; c < g[v].n_in; ++c) stack.push_back(g[v].in[c]);
  }
}
// The inputs of the nodes `of`, the start of a walk below them.
inline std::vector<int> inputs_of(const Graph& g, const std::vector<int>& of) {
  std::vector<int> in;
  for (int v : of) in.insert(in.end(), g[v].in.begin(), g[v].in.begin() + g[v].n_in);
  return in;
}

inline std::string attrs_str(const Node& n) {
  std::ostringstream os;
  auto cls = info(n.op).cls;
  if (cls == OpClass::reduce || n.op == Op::softmax || n.op == Op::log_softmax || n.op == Op::mean || n.op == Op::var ||
      n.op == Op::logsumexp || n.op == Op::numel)
    os << ", dims=" << (n.attrs.all ? std::string("all") : n.attrs.dims.str()) << (n.attrs.keepdim ? ", keepdim" : "");
  else if (n.op == Op::reshape) {  // a size that is the input's along dim d prints as in<d>
    os << ", [";
    for (int i = 0; i < n.attrs.dims.size(); ++i) {
      const std::int64_t s = n.attrs.dims[i];
      os << (i ? ", " : "");
      if (Attrs::is_input_dim(s))
        os << "in" << Attrs::input_dim_of(s);
      else
        os << s;
    }
    os << "]" << (n.attrs.keepdim ? ", zero-padded" : "");
  } else if ((n.op == Op::expand && n.n_in == 1) || n.op == Op::permute || n.op == Op::iota)
    os << ", " << n.attrs.dims.str();
  else if ((n.op == Op::slice || n.op == Op::slice_backward) && n.n_in == 2)  // sized from its second input
    os << ", dim=" << n.attrs.a << (n.attrs.keepdim ? ", at the end" : ", from " + std::to_string(n.attrs.b)) << ":"
       << n.attrs.d;
  else if (n.op == Op::slice || n.op == Op::slice_backward)
    os << ", dim=" << n.attrs.a << ", " << n.attrs.b << ":" << n.attrs.c << ":" << n.attrs.d;
  else if (n.op == Op::shape_of && n.n_in == 2)
    os << ", joined along " << n.attrs.a;
  else if (n.op == Op::transpose)
    os << ", " << n.attrs.a << ", " << n.attrs.b;
  else if (n.op == Op::cast)
    os << ", " << name(n.attrs.dt);
  if (n.op == Op::iota) os << ", dim=" << n.attrs.a;
  if (n.op == Op::iota_of) os << ", " << n.attrs.dims.str() << ", dim=" << n.attrs.a << ", of dim " << n.attrs.b;
  if (n.op == Op::gelu && n.attrs.a) os << ", approximate=tanh";
  if (is_custom(n.op)) os << ", " << custom_ops::name_of(n.attrs.custom);
  if ((n.op == Op::attention_flash || n.op == Op::attention_lse || n.op == Op::attention_grad) && n.attrs.custom >= 0)
    os << ", score_mod " << n.attrs.custom;  // inlined (autodiff/score_mod.hpp)
  if (n.sym_attrs) os << ", symbolic attrs of capture " << n.capture;
  if (n.op == Op::custom_backward) os << ", grad of input " << n.attrs.a;
  return os.str();
}

// One node a line, like an FX graph printout: %id = op(inputs, attrs) : dtype[shape]
inline std::string Graph::str() const {
  std::ostringstream os;
  for (int i = 0; i < size(); ++i) {
    const Node& n = nodes[i];
    os << "  %" << i << " = " << name(n.op) << "(";
    if (n.op == Op::arg) os << "arg" << n.slot;
    if (n.op == Op::scalar) os << "s" << n.slot;
    if (n.op == Op::constant) os << n.value;
    for (int k = 0; k < n.n_in; ++k) os << (k ? ", " : "") << "%" << n.in[k];
    os << attrs_str(n) << ") : " << name(n.dt) << n.shape.str() << "\n";
  }
  os << "  return";
  for (std::size_t i = 0; i < outputs.size(); ++i)
    os << " %" << outputs[i]
       << (i < output_into.size() && output_into[i] >= 0 ? " -> arg" + std::to_string(output_into[i]) : "");
  os << "\n";
  return os.str();
}

}  // namespace kiln::graph
