// The flattened graph: a run-time node table that every stage after capture works on. Each node is
// one op with input ids, its run-time attributes, and (after inference) its shape and dtype.
#pragma once
#include <array>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "../expr/custom_op.hpp"
#include "../expr/node.hpp"

namespace kiln::graph {

// Inputs a node can have: four for ops, five for the backward of a four-input custom op.
inline constexpr int max_inputs = 5;

struct Node {
  Op op = Op::arg;
  std::array<int, max_inputs> in{-1, -1, -1, -1, -1};
  int n_in = 0;
  int slot = -1;          // arg: argument index; scalar: scalar slot
  bool weak = false;      // a C++ scalar (or computed only from scalars): lower promotion priority
  bool floating = true;   // scalar: floating-point C++ type
  double value = 0;       // constant: its value (constants come from rewrite rules, never from users)
  Attrs attrs;
  // Filled by infer_shapes:
  kiln::dtype dt = kiln::dtype::f32;
  Dims shape;

  int input(int i) const { return in[i]; }
  bool same_structure(const Node& o) const {
    return op == o.op && in == o.in && slot == o.slot && attrs == o.attrs && floating == o.floating &&
           (op != Op::constant || value == o.value);
  }
};

struct Graph {
  std::vector<Node> nodes;
  std::vector<int> outputs;
  std::vector<int> output_into;  // per output: the argument slot it is written into (k::assign), else -1
  int num_args = 0;
  int num_scalars = 0;

  const Node& operator[](int i) const { return nodes[i]; }
  Node& operator[](int i) { return nodes[i]; }
  int size() const { return static_cast<int>(nodes.size()); }

  // Adds a node, or returns the id of an identical one (common-subexpression elimination).
  // Scalars are never merged: their values may differ at the next call.
  int add(Node n) {
    if (n.op != Op::scalar)
      for (int i = 0; i < size(); ++i)
        if (nodes[i].same_structure(n)) return i;
    nodes.push_back(std::move(n));
    return size() - 1;
  }
  int add(Op op, std::initializer_list<int> inputs, Attrs at = {}) {
    Node n;
    n.op = op;
    for (int i : inputs) n.in[n.n_in++] = i;
    n.attrs = at;
    return add(n);
  }

  // Number of non-leaf operations (what explain reports as ops_captured / ops_decomposed).
  int count_ops() const {
    int c = 0;
    for (auto& n : nodes) c += info(n.op).cls != OpClass::leaf;
    return c;
  }

  std::string str() const;
};

inline std::string attrs_str(const Node& n) {
  std::ostringstream os;
  auto cls = info(n.op).cls;
  if (cls == OpClass::reduce || n.op == Op::softmax || n.op == Op::log_softmax || n.op == Op::mean ||
      n.op == Op::var || n.op == Op::logsumexp || n.op == Op::numel)
    os << ", dims=" << (n.attrs.all ? std::string("all") : n.attrs.dims.str()) << (n.attrs.keepdim ? ", keepdim" : "");
  else if (n.op == Op::reshape || n.op == Op::expand || n.op == Op::permute || n.op == Op::iota)
    os << ", " << n.attrs.dims.str();
  else if (n.op == Op::slice || n.op == Op::slice_backward)
    os << ", dim=" << n.attrs.a << ", " << n.attrs.b << ":" << n.attrs.c << ":" << n.attrs.d;
  else if (n.op == Op::transpose)
    os << ", " << n.attrs.a << ", " << n.attrs.b;
  else if (n.op == Op::cast)
    os << ", " << name(n.attrs.dt);
  if (n.op == Op::iota) os << ", dim=" << n.attrs.a;
  if (n.op == Op::gelu && n.attrs.a) os << ", approximate=tanh";
  if (is_custom(n.op)) os << ", " << custom_ops::name_of(n.attrs.custom);
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
    os << " %" << outputs[i] << (i < output_into.size() && output_into[i] >= 0 ? " -> arg" + std::to_string(output_into[i]) : "");
  os << "\n";
  return os.str();
}

}  // namespace kiln::graph
