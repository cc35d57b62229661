// Exported launchers: the host code that k::export_kernels writes beside a program's kernels, so
// a codebase can run them without kiln or NVRTC. One launch function per program checks every
// size against what the kernels were compiled for (a static size must be equal, a symbolic size is
// bound at its first sight and must agree everywhere else), places the intermediates in one
// workspace and launches the kernels with the grids Program::run computes. A mismatch returns an
// error code and a message before anything is launched: never an out-of-bounds access.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../launch/program.hpp"
#include "export_launcher_text.hpp"
#include "export_spec.hpp"

namespace kiln::runtime {

// Writes the header and the host half of the .cu for one program.
class LauncherWriter {
 public:
  LauncherWriter(const Program& p, LauncherSpec spec) : p_(p), spec_(std::move(spec)), outs_(exported_outputs(p)) {
    for (std::size_t i = 0; i < outs_.size(); ++i) {
      const auto& o = outs_[i];
      if (o.how == ExportedOutput::in_place) spec_.args[o.from].written = true;
      if (o.how == ExportedOutput::copy_of_arg && !spec_.args[o.from].strides.empty())
        throw error("k::export_kernels: output " + std::to_string(i) + " is the strided argument " +
                    spec_.args[o.from].name + " itself; return a contiguous copy of it instead");
    }
  }

  std::string header() const;
  std::string host_source() const;

 private:
  const std::string& name() const { return spec_.name; }
  int num_sizes() const { return p_.env.num_symbols(); }
  const std::string& symbol_name(int id) const {
    auto [node, dim] = p_.env.source[id];
    return p_.env[node][dim].symbol_name();
  }
  std::string shape_params() const;
  std::string launch_params(bool defaults) const;
  std::string shape_args() const;
  std::string size_locals() const;
  std::string numel_of_arg(const ExportedArg& a) const;
  std::string numel_of_node(int node) const;
  std::string buffer_of(int node) const;
  std::string check_shapes_fn() const;
  std::string plan_workspace_fn() const;
  std::string output_shape_fn() const;
  std::string launcher_fn() const;
  std::string pointer_checks() const;
  std::string launch_kernel(const CompiledKernel& k) const;
  std::string kernel_arg(const codegen::Param& prm) const;
  std::string copies() const;
  std::string describe() const;
  bool has_rows() const;
  std::vector<int> intermediates() const;

  const Program& p_;
  LauncherSpec spec_;
  std::vector<ExportedOutput> outs_;
};

// ---- signatures ---------------------------------------------------------------------------------

inline std::string LauncherWriter::shape_params() const {
  std::string s;
  for (const auto& a : spec_.args)
    if (a.shape.size() > 0)
      s += (s.empty() ? "" : ", ") + std::string("const int64_t ") + a.name + "_shape[" +
           std::to_string(a.shape.size()) + "]";
  return s;
}

inline std::string LauncherWriter::shape_args() const {
  std::string s;
  for (const auto& a : spec_.args)
    if (a.shape.size() > 0) s += (s.empty() ? "" : ", ") + a.name + "_shape";
  return s;
}

inline std::string LauncherWriter::launch_params(bool defaults) const {
  std::vector<std::string> ps;
  for (const auto& a : spec_.args) {
    ps.push_back((a.written ? "" : "const ") + detail::header_type(a.dt) + "* " + a.name);
    std::string rank = std::to_string(a.shape.size());
    if (a.shape.size() > 0) ps.push_back("const int64_t " + a.name + "_shape[" + rank + "]");
    if (!a.strides.empty()) ps.push_back("const int64_t " + a.name + "_strides[" + rank + "]");
  }
  for (const auto& o : outs_)
    if (o.how != ExportedOutput::in_place) ps.push_back(detail::header_type(p_.graph[o.node].dt) + "* " + o.name);
  for (std::size_t i = 0; i < spec_.scalars.size(); ++i)
    ps.push_back("double scalar" + std::to_string(i) + (defaults ? " = " + detail::number(spec_.scalars[i]) : ""));
  ps.push_back(std::string("void* workspace") + (defaults ? " = nullptr" : ""));
  ps.push_back(std::string("cudaStream_t stream") + (defaults ? " = 0" : ""));
  std::string s;
  for (std::size_t i = 0; i < ps.size(); ++i) s += (i ? ",\n    " : "\n    ") + ps[i];
  return s;
}

// Locals named like the kernels' size parameters, so symbolic expressions print as C.
inline std::string LauncherWriter::size_locals() const {
  std::string s;
  for (int i = 0; i < num_sizes(); ++i)
    s += "  [[maybe_unused]] const long long " + symbol_name(i) + " = s[" + std::to_string(i) + "];\n";
  return s;
}

inline std::string LauncherWriter::numel_of_arg(const ExportedArg& a) const {
  std::string s = "1LL";
  for (int d = 0; d < a.shape.size(); ++d) s += " * " + a.name + "_shape[" + std::to_string(d) + "]";
  return s;
}

inline std::string LauncherWriter::numel_of_node(int node) const {
  Sym n(1);
  for (const Sym& d : p_.env[node]) n = n * d;
  std::string s = "(";  // (appended: GCC 12's -Wrestrict misfires on "(" + std::string&&)
  s += n.c_expr();
  return s += ")";
}

// ---- the header ---------------------------------------------------------------------------------

// The comment block that says what the launcher was exported for.
inline std::string LauncherWriter::describe() const {
  std::string s = "// Kernels (cubin: " + name() + "_" + spec_.arch + ".cubin):\n";
  for (const auto& k : p_.kernels) s += "//   " + k.src.name + " (" + schedule::kind_name(k.src.kind) + ")\n";
  s += "// Arguments: device pointers to contiguous tensors (strided ones take their strides):\n";
  for (const auto& a : spec_.args) {
    std::string shape = a.node >= 0 ? detail::shape_text(p_.env[a.node]) : a.shape.str() + ", not read by the kernels";
    s += "//   " + a.name + ": " + std::string(kiln::name(a.dt)) + " " + shape +
         (a.strides.empty() ? "" : ", strides " + a.strides.str()) + (a.written ? ", updated in place" : "") + "\n";
  }
  bool any = false;
  for (const auto& o : outs_) any = any || o.how != ExportedOutput::in_place;
  s += any ? "// Outputs: device buffers the caller allocates (" + name() + "_output_shape gives their shapes):\n"
           : "// Outputs: none besides the arguments updated in place.\n";
  for (const auto& o : outs_)
    if (o.how != ExportedOutput::in_place)
      s += "//   " + o.name + ": " + std::string(kiln::name(p_.graph[o.node].dt)) + " " +
           detail::shape_text(p_.env[o.node]) + "\n";
  for (std::size_t i = 0; i < spec_.scalars.size(); ++i)
    s += "// scalar" + std::to_string(i) + ": a C++ scalar of the function (" + detail::number(spec_.scalars[i]) +
         " when exported)\n";
  if (num_sizes() > 0) {
    s += "// Symbolic sizes:";
    for (int i = 0; i < num_sizes(); ++i) s += " " + symbol_name(i);
    s += " (each at least 2, equal wherever they repeat); every other size is fixed.\n";
  } else {
    s += "// Every size is fixed: exported with static shapes.\n";
  }
  return s;
}

inline std::string LauncherWriter::header() const {
  bool half = false;
  for (const auto& a : spec_.args) half = half || a.dt == kiln::dtype::f16 || a.dt == kiln::dtype::bf16;
  for (const auto& o : outs_)
    half = half || p_.graph[o.node].dt == kiln::dtype::f16 || p_.graph[o.node].dt == kiln::dtype::bf16;
  std::string sp = shape_params();
  std::string s =
      "// " + name() +
      ".h: kernels exported ahead of time by kiln (k::export_kernels). Plain C++ and the\n"
      "// CUDA runtime: compile " +
      name() + ".cu with nvcc (-std=c++17) and link it; no kiln, no NVRTC.\n//\n" + describe() +
      "#pragma once\n#include <cstddef>\n#include <cstdint>\n\n#include <cuda_runtime.h>\n" +
      (half ? "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n" : "") +
      "\n#ifndef KILN_EXPORT_STATUS\n#define KILN_EXPORT_STATUS\n"
      "enum kiln_export_status {\n  kiln_export_success = 0,\n  kiln_export_invalid_argument = 1,  // a null pointer, "
      "a bad output index\n"
      "  kiln_export_shape_mismatch = 2,    // a size or stride the kernels were not exported for\n"
      "  kiln_export_cuda_error = 3,        // the CUDA runtime failed (allocation, launch)\n};\n#endif\n\n";
  s += "// C linkage: dlsym and foreign-function interfaces find the launcher by its name.\nextern \"C\" {\n\n";
  s += "// Launches the kernels on `stream` (asynchronous). Returns kiln_export_success, or an error code with\n"
       "// the reason in " +
       name() +
       "_last_error(); sizes are checked before anything runs. Intermediates live\n"
       "// in `workspace` (" +
       name() +
       "_workspace_bytes bytes, 256-byte aligned); when it is null they are\n"
       "// allocated and freed on the stream.\n"
       "// Outputs must not overlap the arguments.\n";
  s += "int " + name() + "(" + launch_params(true) + ");\n\n";
  s += "// The bytes of workspace a launch with these shapes needs.\n";
  s += "int " + name() + "_workspace_bytes(" + sp + (sp.empty() ? "" : ", ") + "size_t* bytes);\n\n";
  s += "// The shape of output `output` for these argument shapes (its rank is fixed: see above).\n";
  s += "int " + name() + "_output_shape(int output" + (sp.empty() ? "" : ", " + sp) + ", int64_t* shape);\n\n";
  s += "// Why the last call on this thread failed (empty after a success).\n";
  s += "const char* " + name() + "_last_error();\n\n}  // extern \"C\"\n";
  return s;
}

// ---- the host source ----------------------------------------------------------------------------

// Checks every argument dim: static sizes equal, symbolic sizes bound once and then equal.
inline std::string LauncherWriter::check_shapes_fn() const {
  std::string sp = shape_params();
  std::string s = "// Checks the argument shapes against the exported ones and binds the symbolic sizes s[].\n";
  s += "int check_shapes(" + sp + (sp.empty() ? "" : ", ") + "long long* s) {\n";
  if (num_sizes() > 0) s += "  const char* bound_by[num_sizes] = {};  // the dim that bound each size first\n";
  s += "  for (int i = 0; i < num_sizes; ++i) s[i] = -1;\n";
  for (const auto& a : spec_.args) {
    if (a.shape.size() == 0) continue;
    s += "  if (" + a.name + "_shape == nullptr) return fail(kiln_export_invalid_argument, \"" + name() + ": " +
         a.name + "_shape is null\");\n";
    if (a.node < 0) continue;
    for (int d = 0; d < a.shape.size(); ++d) {
      const Sym& dim = p_.env[a.node][d];
      std::string at = a.name + "_shape[" + std::to_string(d) + "]";
      if (dim.is_constant())
        s += "  if (!check_size(" + at + ", " + std::to_string(dim.constant_value()) + "LL, " + detail::quoted(at) +
             ")) return kiln_export_shape_mismatch;\n";
      else
        s += "  if (!bind_size(s[" + std::to_string(dim.symbol_id()) + "], bound_by[" +
             std::to_string(dim.symbol_id()) + "], " + at + ", " + detail::quoted(at) + ", " +
             detail::quoted(dim.symbol_name()) + ")) return kiln_export_shape_mismatch;\n";
    }
  }
  return s + "  return kiln_export_success;\n}\n\n";
}

// Intermediates: realized nodes that are neither arguments nor outputs.
inline std::vector<int> LauncherWriter::intermediates() const {
  std::vector<int> out;
  for (int b : p_.buffers) {
    bool is_output = false;
    for (const auto& o : outs_) is_output = is_output || o.node == b;
    if (!is_output) out.push_back(b);
  }
  return out;
}

inline std::string LauncherWriter::plan_workspace_fn() const {
  std::vector<int> temps = intermediates();
  std::string s = "// Offsets of the intermediates in the workspace, 256-byte aligned; returns its size.\n";
  s += "size_t plan_workspace([[maybe_unused]] const long long* s, [[maybe_unused]] size_t* offset) {\n" +
       size_locals() + "  size_t bytes = 0;\n";
  for (std::size_t i = 0; i < temps.size(); ++i) {
    int n = temps[i];
    s += "  offset[" + std::to_string(i) + "] = bytes;  // %" + std::to_string(n) + ": " +
         std::string(kiln::name(p_.graph[n].dt)) + " " + detail::shape_text(p_.env[n]) + "\n";
    s += "  bytes += (size_t(" + numel_of_node(n) + ") * " + std::to_string(itemsize(p_.graph[n].dt)) +
         " + 255) / 256 * 256;\n";
  }
  return s + "  return bytes;\n}\n\n";
}

inline std::string LauncherWriter::output_shape_fn() const {
  std::string sp = shape_params(), sa = shape_args();
  std::string s =
      "int " + name() + "_output_shape(int output" + (sp.empty() ? "" : ", " + sp) + ", int64_t* shape) {\n";
  s += "  error_message[0] = '\\0';\n  long long s[num_sizes];\n";
  s += "  if (int status = check_shapes(" + sa + (sa.empty() ? "" : ", ") + "s)) return status;\n" + size_locals();
  s += "  if (shape == nullptr) return fail(kiln_export_invalid_argument, \"" + name() +
       "_output_shape: shape is null\");\n";
  s += "  switch (output) {\n";
  for (std::size_t o = 0; o < outs_.size(); ++o) {
    s += "    case " + std::to_string(o) + ":";
    const auto& dims = p_.env[outs_[o].node];
    for (std::size_t d = 0; d < dims.size(); ++d) s += " shape[" + std::to_string(d) + "] = " + dims[d].c_expr() + ";";
    s += " return kiln_export_success;\n";
  }
  s += "  }\n  return fail(kiln_export_invalid_argument, \"" + name() +
       "_output_shape: output %d does not exist (there are " + std::to_string(outs_.size()) + ")\", output);\n}\n\n";
  return s;
}

// The pointer a kernel parameter refers to: an argument, an output or a slice of the workspace.
inline std::string LauncherWriter::buffer_of(int node) const {
  if (p_.graph[node].op == Op::arg) return spec_.args[p_.graph[node].slot].name;
  for (const auto& o : outs_)
    if (o.node == node && (o.how == ExportedOutput::own || o.how == ExportedOutput::in_place))
      return o.how == ExportedOutput::in_place ? spec_.args[o.from].name : o.name;
  std::vector<int> temps = intermediates();
  for (std::size_t i = 0; i < temps.size(); ++i)
    if (temps[i] == node) return "ws.base + offset[" + std::to_string(i) + "]";
  throw error("export_kernels: no buffer for node %" + std::to_string(node));
}

inline std::string LauncherWriter::kernel_arg(const codegen::Param& prm) const {
  std::string type = codegen::detail::storage_c_type(prm.dt);
  switch (prm.kind) {
    case codegen::Param::in_ptr:
      return "(const " + type + "*)(" + buffer_of(prm.ref) + ")";
    case codegen::Param::out_ptr:
      return "(" + type + "*)(" + buffer_of(prm.ref) + ")";
    case codegen::Param::scalar:
      return "scalar" + std::to_string(prm.ref);
    case codegen::Param::size:
      return symbol_name(prm.ref);
  }
  return "";
}

// One launch: a program per XBLOCK elements (pointwise) or per ROWS rows, row programs capped at
// four full-occupancy waves of the device (they loop over the rest). Program::run caps them at 16
// (or, for register-cached blocks of several rows, 64) waves of each kernel's measured occupancy
// instead; row programs give the same results either way.
inline std::string LauncherWriter::launch_kernel(const CompiledKernel& k) const {
  const auto& c = k.src.config;
  bool poi = k.src.kind == schedule::Kind::poi;
  std::int64_t per_program = poi ? c.xblock : c.rows;
  std::string s = "  {  // " + k.src.name + "\n    const long long xnumel = " + k.src.xnumel.c_expr() + ";\n";
  s += "    long long programs = (xnumel + " + std::to_string(per_program - 1) + ") / " + std::to_string(per_program) +
       ";\n";
  if (k.src.partial_groups > 0)  // column partials: a program a row group, exactly
    s += "    programs = " + std::to_string(k.src.partial_groups) + "LL;\n";
  else if (!poi)
    s += "    if (programs > sms * " + std::to_string(row_grid_limit(1, c.threads)) + "LL) programs = sms * " +
         std::to_string(row_grid_limit(1, c.threads)) + "LL;\n";
  s += "    if (programs > 2147483647LL) return fail(kiln_export_invalid_argument, \"" + name() + ": " + k.src.name +
       " needs %lld blocks, more than a grid holds\", programs);\n";
  const std::string shared = std::to_string(c.shared_bytes);
  if (c.shared_bytes > 0)  // the default limit is 48 KiB less the kernel's static shared memory
    s += "    if (cudaError_t e = cudaFuncSetAttribute(" + k.src.name + ", cudaFuncAttributeMaxDynamicSharedMemorySize, " +
         shared + "))\n      return fail(kiln_export_cuda_error, \"" + name() + ": " + k.src.name +
         " asks for " + shared + " bytes of shared memory: %s\", cudaGetErrorString(e));\n";
  s += "    if (programs > 0) {\n      " + k.src.name + "<<<(unsigned)programs, " + std::to_string(c.threads) + ", " +
       shared + ", stream>>>(";
  for (std::size_t i = 0; i < k.src.params.size(); ++i)
    s += (i ? ",\n          " : "\n          ") + kernel_arg(k.src.params[i]);
  s += ");\n      if (cudaError_t e = cudaGetLastError())\n        return fail(kiln_export_cuda_error, \"" + name() +
       ": launching " + k.src.name + ": %s\", cudaGetErrorString(e));\n    }\n  }\n";
  return s;
}

inline std::string LauncherWriter::pointer_checks() const {
  std::string s;
  auto check = [&](const std::string& ptr, const std::string& numel) {
    s += "  if (" + ptr + " == nullptr && " + numel + " != 0) return fail(kiln_export_invalid_argument, \"" + name() +
         ": " + ptr + " is null\");\n";
  };
  for (const auto& a : spec_.args) check(a.name, numel_of_arg(a));
  for (const auto& o : outs_)
    if (o.how != ExportedOutput::in_place) check(o.name, numel_of_node(o.node));
  for (const auto& a : spec_.args) {  // strided arguments: the strides are constants of the kernels
    if (a.strides.empty()) continue;
    s += "  if (" + a.name + "_strides == nullptr) return fail(kiln_export_invalid_argument, \"" + name() + ": " +
         a.name + "_strides is null\");\n";
    for (int d = 0; d < a.strides.size(); ++d)
      s += "  if (!check_size(" + a.name + "_strides[" + std::to_string(d) + "], " + std::to_string(a.strides[d]) +
           "LL, \"" + a.name + "_strides[" + std::to_string(d) + "]\")) return kiln_export_shape_mismatch;\n";
  }
  return s;
}

// Outputs that are copies: an argument returned unchanged, or a value returned twice.
inline std::string LauncherWriter::copies() const {
  std::string s;
  for (const auto& o : outs_) {
    if (o.how != ExportedOutput::copy_of_arg && o.how != ExportedOutput::copy_of_output) continue;
    std::string from = o.how == ExportedOutput::copy_of_arg ? spec_.args[o.from].name : outs_[o.from].name;
    s += "  if (cudaError_t e = cudaMemcpyAsync(" + o.name + ", " + from + ", size_t" + numel_of_node(o.node) + " * " +
         std::to_string(itemsize(p_.graph[o.node].dt)) +
         ", cudaMemcpyDeviceToDevice, stream))\n    return fail(kiln_export_cuda_error, \"" + name() + ": copying " +
         o.name + ": %s\", cudaGetErrorString(e));\n";
  }
  return s;
}

inline bool LauncherWriter::has_rows() const {
  for (const auto& k : p_.kernels)
    if (k.src.kind != schedule::Kind::poi) return true;
  return false;
}

inline std::string LauncherWriter::launcher_fn() const {
  std::string sa = shape_args();
  std::string s = "int " + name() + "(" + launch_params(false) + ") {\n";
  s += "  error_message[0] = '\\0';\n  long long s[num_sizes];\n";
  s += "  if (int status = check_shapes(" + sa + (sa.empty() ? "" : ", ") + "s)) return status;\n" + size_locals();
  s += pointer_checks();
  s += "  size_t offset[num_intermediates];\n  const size_t bytes = plan_workspace(s, offset);\n";
  s += "  Workspace ws;\n  if (int status = ws.acquire(workspace, bytes, stream)) return status;\n";
  if (has_rows()) s += "  long long sms = 0;\n  if (int status = multiprocessors(&sms)) return status;\n";
  for (const auto& k : p_.kernels) s += launch_kernel(k);
  return s + copies() + "  return kiln_export_success;\n}\n";
}

inline std::string LauncherWriter::host_source() const {
  std::size_t temps = intermediates().size();
  std::string sp = shape_params(), sa = shape_args();
  std::string s = "\n// ---- the launcher ------------------------------------------------------------------------\n";
  s += "#include \"" + name() + ".h\"\n\n#include <cstdarg>\n#include <cstdio>\n\nnamespace {\n\n";
  s += "constexpr const char* launcher_name = " + detail::quoted(name()) + ";\n";
  s += "constexpr int num_sizes = " + std::to_string(std::max(1, num_sizes())) + ";\n";
  s += "constexpr int num_intermediates = " + std::to_string(std::max<std::size_t>(1, temps)) + ";\n";
  s += launcher_helpers;
  s += "\n" + check_shapes_fn() + plan_workspace_fn() + "}  // namespace\n\n";
  s += "const char* " + name() + "_last_error() { return error_message; }\n\n";
  s += "int " + name() + "_workspace_bytes(" + sp + (sp.empty() ? "" : ", ") + "size_t* bytes) {\n";
  s += "  error_message[0] = '\\0';\n  long long s[num_sizes];\n  size_t offset[num_intermediates];\n";
  s += "  if (int status = check_shapes(" + sa + (sa.empty() ? "" : ", ") + "s)) return status;\n";
  s += "  if (bytes == nullptr) return fail(kiln_export_invalid_argument, \"" + name() +
       "_workspace_bytes: bytes is null\");\n";
  s += "  *bytes = plan_workspace(s, offset);\n  return kiln_export_success;\n}\n\n";
  return s + output_shape_fn() + launcher_fn();
}

}  // namespace kiln::runtime
