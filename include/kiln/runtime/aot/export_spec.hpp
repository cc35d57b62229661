// What an exported launcher is written for: its tensor arguments (with their shapes and strides at
// export time) and its outputs, with where each output comes from.
#pragma once
#include <string>
#include <vector>

#include "../launch/program.hpp"

namespace kiln::runtime {

// One tensor parameter of an exported launcher: an argument of the function or a tensor it captured.
struct ExportedArg {
  std::string name;  // arg0, arg1, ... then capture0, ...
  kiln::dtype dt;
  Dims shape;            // at export time
  Dims strides;          // empty when contiguous; else the launcher takes and checks them
  int node = -1;         // its graph node; -1 when the kernels never read it
  bool written = false;  // k::assign writes into it
};

// What a launcher is written for, besides the program itself.
struct LauncherSpec {
  std::string name;               // a C identifier: the launcher and the prefix of its helpers
  std::vector<ExportedArg> args;  // indexed by arg slot
  std::vector<double> scalars;    // values at export time: the defaults of the scalar parameters
  std::string arch;               // the cubin's architecture (comments only)
};

// Where an output comes from: a kernel writes it (own), it is an argument unchanged (copied),
// the same value as an earlier output (copied), or k::assign writes it into an argument (no parameter).
struct ExportedOutput {
  enum How { own, copy_of_arg, copy_of_output, in_place } how = own;
  int node = -1, from = -1;  // from: the argument slot or the earlier output
  std::string name;          // out0, out1, ... (in_place: the argument's name)
};

inline std::vector<ExportedOutput> exported_outputs(const Program& p) {
  std::vector<ExportedOutput> outs;
  int numbered = 0;
  for (std::size_t o = 0; o < p.graph.outputs.size(); ++o) {
    ExportedOutput e;
    e.node = p.graph.outputs[o];
    int into = o < p.graph.output_into.size() ? p.graph.output_into[o] : -1;
    if (into >= 0) {
      e.how = ExportedOutput::in_place, e.from = into;
    } else if (p.arg_of_output[o] >= 0) {
      e.how = ExportedOutput::copy_of_arg, e.from = p.arg_of_output[o];
    } else {
      for (std::size_t earlier = 0; earlier < o; ++earlier)
        if (outs[earlier].node == e.node && outs[earlier].how == ExportedOutput::own)
          e.how = ExportedOutput::copy_of_output, e.from = static_cast<int>(earlier);
    }
    if (e.how != ExportedOutput::in_place) e.name = "out" + std::to_string(numbered++);
    outs.push_back(e);
  }
  return outs;
}

}  // namespace kiln::runtime
