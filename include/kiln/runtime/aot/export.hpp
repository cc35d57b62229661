// k::export_kernels: kernels ahead of time, like AOTInductor. Lowers a function for the CUDA
// target for the given argument shapes (CPU tensors are enough: nothing here needs a GPU) and
// writes the program's generated source with a host launcher (<name>.cu, built by plain nvcc),
// a small header declaring the launcher (<name>.h) and the kernels' cubin (<name>_<arch>.cubin,
// NVRTC), so a codebase can ship the fused kernels without kiln or NVRTC at run time.
#pragma once
#include <cctype>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "../api.hpp"
#if KILN_DEFINITIONS  // the writer: only where the runtime is compiled (core/linkage.hpp)
#include "export_launcher.hpp"
#endif

namespace kiln {

struct export_options {
  std::string name = {};  // the launcher's name (a C identifier); default: the folder's name
  std::string arch = {};  // e.g. "sm_90a"; default: the arguments' GPU, else this machine's GPU, else sm_90
  ::kiln::shapes shapes = ::kiln::shapes::automatic;  // automatic: the function's option (static first)
};

// What export_kernels wrote.
struct exported_kernels {
  std::string name;                  // the launcher
  std::string arch;                  // the cubin's architecture
  std::filesystem::path source;      // <name>.cu: prelude, kernels and launcher
  std::filesystem::path header;      // <name>.h
  std::filesystem::path cubin;       // <name>_<arch>.cubin
  std::vector<std::string> kernels;  // the generated kernels, in launch order
  std::vector<std::filesystem::path> files() const { return {source, header, cubin}; }
};

namespace detail {

// The helpers of export_lowered (below), which only the TU that defines it parses.
#if KILN_DEFINITIONS
inline bool is_identifier(const std::string& s) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
  return true;
}

// The launcher's name: the option, else the folder's name made into a C identifier.
inline std::string export_name(const std::filesystem::path& dir, const export_options& o) {
  if (!o.name.empty()) {
    if (!is_identifier(o.name)) throw error("k::export_kernels: name '" + o.name + "' is not a C identifier");
    return o.name;
  }
  std::filesystem::path p = dir.filename().empty() ? dir.parent_path() : dir;
  std::string s = p.filename().string();
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  if (s.empty() || s == "_" || s == "__") return "kiln_kernels";
  return std::isdigit(static_cast<unsigned char>(s[0])) ? "kiln_" + s : s;
}

inline std::string export_arch(Device device, const export_options& o) {
  if (!o.arch.empty()) return o.arch;
  if (device.is_cuda()) return driver::arch(device.index);
  if (driver::available()) return driver::arch(0);
  return "sm_90";
}

// A dynamic launcher binds each symbol from an argument dim and trusts every other node's sizes
// to follow. That holds when each symbol is some argument's size and re-inferring the graph for
// other values of the symbols gives the env's sizes again; a reshape or slice whose size is its
// own symbol fails this and must be exported with static shapes.
inline void check_sizes_follow_arguments(const runtime::Program& p, const std::vector<runtime::ExportedArg>& args) {
  const ir::ShapeEnv& env = p.env;
  for (int s = 0; s < env.num_symbols(); ++s)
    if (env.field[s] != ir::AttrField::none)  // a slice bound of each call: the launcher has no attributes
      throw error("k::export_kernels: the slice at node %" + std::to_string(env.source[s].first) +
                  " starts at a position that changes with the call (its bounds, or a start counted from the end of "
                  "a symbolic size); export with .shapes = k::shapes::static_");
  for (int s = 0; s < env.num_symbols(); ++s) {
    bool bound = false;
    for (const auto& a : args)
      for (int d = 0; a.node >= 0 && d < a.shape.size(); ++d)
        bound = bound || env[a.node][d] == env[env.source[s].first][env.source[s].second];
    if (!bound)
      throw error("k::export_kernels: the symbolic size " + env[env.source[s].first][env.source[s].second].str() +
                  " of node %" + std::to_string(env.source[s].first) +
                  " is no argument's size; export with .shapes = k::shapes::static_");
  }
  for (std::int64_t round = 1; round <= 2; ++round) {
    std::vector<std::int64_t> values(env.example);
    for (int s = 0; s < env.num_symbols(); ++s) values[s] += round * (s + 1);
    std::vector<Tensor> probes(args.size());
    for (const auto& a : args) {
      if (a.node < 0) continue;
      Dims shape;
      for (const Sym& d : env[a.node]) shape.push_back(d.eval(values));
      probes[p.graph[a.node].slot] = Tensor::wrap(nullptr, shape, a.dt, cpu);
    }
    graph::Graph g = p.graph;
    std::string why;
    try {
      graph::infer_shapes(g, [&](int slot) -> const Tensor& { return probes[slot]; });
    } catch (const error& e) {
      why = e.what();
    }
    for (int n = 0; why.empty() && n < g.size(); ++n)
      for (int d = 0; d < g[n].shape.size(); ++d)
        if (g[n].shape[d] != env[n][d].eval(values))
          why = "node %" + std::to_string(n) + " has size " + std::to_string(g[n].shape[d]) +
                " where the kernels assume " + env[n][d].str();
    if (!why.empty())
      throw error("k::export_kernels: the sizes of this program do not all follow its arguments' sizes (" + why +
                  "); export with .shapes = k::shapes::static_");
  }
}

inline void write_file(const std::filesystem::path& path, const char* data, std::size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data, static_cast<std::streamsize>(size));
  out.close();
  if (!out) throw error("k::export_kernels: could not write " + path.string());
}

// The launcher's tensor parameters: the call's arguments, then the tensors the function captured.
inline std::vector<runtime::ExportedArg> exported_args(const runtime::Program& p, const Tensor* const* args, int nargs,
                                                       int ncall) {
  std::vector<runtime::ExportedArg> out(static_cast<std::size_t>(nargs));
  for (int i = 0; i < nargs; ++i) {
    const Tensor& t = *args[i];
    out[i].name = i < ncall ? "arg" + std::to_string(i) : "capture" + std::to_string(i - ncall);
    out[i].dt = t.dtype();
    out[i].shape = t.shape();
    if (!t.is_contiguous()) out[i].strides = t.strides();
  }
  for (int n = 0; n < p.graph.size(); ++n)
    if (p.graph[n].op == Op::arg) out[p.graph[n].slot].node = n;
  return out;
}
#endif

// The lowered graph of export_program planned for CUDA without compiling it, and the three files
// written: an entry point (core/linkage.hpp). args: the call's tensors, then the captured ones.
KILN_DECL exported_kernels export_lowered(graph::Graph g, const runtime::LoweringStats& stats, ::kiln::shapes mode,
                                          const std::vector<const Tensor*>& args, int ncall,
                                          const std::vector<double>& scalars, const std::filesystem::path& dir,
                                          const export_options& o);

// Lowers the program for CUDA without compiling it, then writes the three files.
template <class F, class E, std::size_t NArgs>
exported_kernels export_program(const Function<F>& f, const E& e, const std::array<const Tensor*, NArgs>& call_args,
                                const std::filesystem::path& dir, const export_options& o) {
  graph::Captured cap;
  graph::gather(e, cap, true);  // as graph_builder flattens: views of captured tensors are arguments
  std::vector<const Tensor*> args(call_args.begin(), call_args.end());
  for (int i = 0; i < cap.nt; ++i) args.push_back(cap.tensors[i]);
  Device device = args.empty() ? cpu : args[0]->device();
  for (const Tensor* t : args)
    if (!(t->device() == device))
      throw device_error("k::export_kernels: arguments on different devices: " + device.str() + " and " +
                         t->device().str());
  auto arg = [&](int slot) -> const Tensor& { return *args[slot]; };
  runtime::LoweringStats stats;
  stats.for_gpu = true;  // a CUDA program, from CPU tensors too
  graph::Graph g = graph_builder(f.fn(), e, static_cast<int>(NArgs))(arg, stats);
  ::kiln::shapes mode = o.shapes != shapes::automatic ? o.shapes : f.cache().opts().shapes;
  return export_lowered(std::move(g), stats, mode, args, static_cast<int>(NArgs),
                        std::vector<double>(cap.scalars.begin(), cap.scalars.begin() + cap.ns), dir, o);
}

#if KILN_DEFINITIONS
KILN_DECL exported_kernels export_lowered(graph::Graph g, const runtime::LoweringStats& stats, ::kiln::shapes mode,
                                          const std::vector<const Tensor*>& args, int ncall,
                                          const std::vector<double>& scalars, const std::filesystem::path& dir,
                                          const export_options& o) {
  Device device = args.empty() ? cpu : args[0]->device();
  Device target = device.is_cuda() ? device : Device(cuda);  // CPU tensors give shapes only
  auto arg = [&](int slot) -> const Tensor& { return *args[slot]; };
  ir::ShapeEnv env =
      mode == shapes::dynamic ? ir::make_shape_env(g, [](int, int) { return true; }) : ir::make_static_shape_env(g);
  // Int indices only where the sizes are static: an exported launcher has no guard on its sizes.
  auto tuning = stats.tuning;
  if (tuning.index32 != 0) tuning.index32 = 1;
  tuning.dynamic_rows = 0;  // nor rows held at the example's length (their looped twins are the runtime's)
  // Looped rows kept in shared memory only where KILN_TUNE_ROW_SMEM gives the bytes (more than 1):
  // the exporting machine need not have the target's GPU, whose limit "1" or the default would ask.
  if (tuning.row_smem <= 1) tuning.row_smem = 0;
  auto p = runtime::plan_program(std::move(g), std::move(env), target, arg, false, tuning);
  for (const auto& k : p->kernels)
    if (k.extern_node >= 0)
      throw error("k::export_kernels: the program has a matmul step (" + k.src.name +
                  (p->graph[k.extern_node].op == Op::matmul ? ", a cuBLASLt call" : ", a library step") +
                  "); not exportable yet");

  runtime::LauncherSpec spec;
  spec.name = export_name(dir, o);
  spec.arch = export_arch(device, o);
  spec.args = exported_args(*p, args.data(), static_cast<int>(args.size()), ncall);
  spec.scalars = scalars;
  check_sizes_follow_arguments(*p, spec.args);

  exported_kernels out;
  out.name = spec.name;
  out.arch = spec.arch;
  for (const auto& k : p->kernels) out.kernels.push_back(k.src.name);
  std::string tu = runtime::cuda_translation_unit(*p, runtime::program_body(*p));
  int held_bound = 0;  // the bound the cubin's held-row kernels took: the source must too
  std::vector<char> cubin = runtime::compile_cubin(tu, spec.name, spec.arch, {}, &held_bound);
  runtime::LauncherWriter writer(*p, spec);
  std::string source =
      "// " + spec.name +
      ".cu: kernels exported ahead of time by kiln (k::export_kernels) with their launcher.\n"
      "// Build: nvcc -std=c++17 -arch=" +
      spec.arch + " -c " + spec.name +
      ".cu (no kiln, no NVRTC).\n"
      "#define KILN_KERNEL static __global__ void\n" +
      (held_bound ? "#define KILN_HELD_BOUND " + std::to_string(held_bound) + "  // as its cubin was compiled\n" : "") +
      "#pragma nv_diag_suppress 177  // kernels declare all their block constants, used or not\n" + tu +
      writer.host_source();
  std::string header = writer.header();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw error("k::export_kernels: could not create " + dir.string() + ": " + ec.message());
  out.source = dir / (spec.name + ".cu");
  out.header = dir / (spec.name + ".h");
  out.cubin = dir / (spec.name + "_" + spec.arch + ".cubin");
  write_file(out.source, source.data(), source.size());
  write_file(out.header, header.data(), header.size());
  write_file(out.cubin, cubin.data(), cubin.size());
  return out;
}
#endif

template <class F, class... T>
exported_kernels export_with(const Function<F>& f, const std::filesystem::path& dir, const export_options& o,
                             const T&... args) {
  static_assert((std::is_same_v<T, Tensor> && ...),
                "k::export_kernels(f, args..., dir): the arguments must be k::Tensor");
  return export_program(f, f.trace_with(args...), std::array<const Tensor*, sizeof...(T)>{&args...}, dir, o);
}
template <class F, class... T>
exported_kernels export_with(const F& fn, const std::filesystem::path& dir, const export_options& o, const T&... args) {
  return export_with(compile(fn), dir, o, args...);
}

template <class F, class Tuple, std::size_t... I>
exported_kernels export_split(const F& f, const Tuple& all, std::index_sequence<I...>, const std::filesystem::path& dir,
                              const export_options& o) {
  return export_with(f, dir, o, std::get<I>(all)...);
}

}  // namespace detail

// k::export_kernels(f, args..., dir) and k::export_kernels(f, args..., dir, k::export_options{...}):
// writes f's fused kernels for these argument shapes and dtypes into dir and returns the paths.
template <class F, class... A>
exported_kernels export_kernels(const F& f, const A&... a) {
  constexpr std::size_t n = sizeof...(A);
  static_assert(n >= 1, "k::export_kernels(f, args..., dir): the folder to write into comes last");
  auto all = std::forward_as_tuple(a...);
  using Last = std::remove_cvref_t<std::tuple_element_t<n - 1, std::tuple<A...>>>;
  if constexpr (std::is_same_v<Last, export_options>) {
    static_assert(n >= 2, "k::export_kernels(f, args..., dir, options): the folder comes before the options");
    return detail::export_split(f, all, std::make_index_sequence<n - 2>{}, std::get<n - 2>(all), std::get<n - 1>(all));
  } else {
    return detail::export_split(f, all, std::make_index_sequence<n - 1>{}, std::get<n - 1>(all), export_options{});
  }
}

}  // namespace kiln
