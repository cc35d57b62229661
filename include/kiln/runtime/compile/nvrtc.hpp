// NVRTC: compiles one generated CUDA C++ translation unit to a CUBIN for one GPU architecture, on
// any machine (no GPU or driver needed), dumping the source and keeping the log when it fails.
#pragma once
#include <link.h>
#include <nvrtc.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "../../codegen/launch_config.hpp"
#include "../../core/config.hpp"
#include "../../core/error.hpp"

namespace kiln::runtime {

// 13000 for NVRTC 13.0, the same encoding as CUDA_VERSION.
inline int nvrtc_version() {
  int major = 0, minor = 0;
  nvrtcVersion(&major, &minor);
  return major * 1000 + minor * 10;
}

namespace detail {

namespace fs = std::filesystem;

// The folder of the libnvrtc this process loaded, or empty (NVRTC linked statically).
inline fs::path loaded_nvrtc_dir() {
  fs::path found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* out) {
        std::string name = info->dlpi_name ? info->dlpi_name : "";
        std::string file = fs::path(name).filename().string();
        if (file.rfind("libnvrtc.", 0) != 0 && file.rfind("libnvrtc_", 0) != 0) return 0;
        *static_cast<fs::path*>(out) = fs::path(name).parent_path();
        return 1;
      },
      &found);
  return found;
}

// Where cuda_fp16.h and cuda_bf16.h live (NVRTC 13 does not build them in). An explicit
// CUDA_HOME / CUDA_PATH wins; then the toolkit the loaded libnvrtc came from, whose headers match
// its version; then the conventional /usr/local/cuda. Empty when none has them.
inline std::string find_toolkit_include() {
  std::vector<fs::path> candidates;
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"})
    if (const char* v = kiln::config::env(var); v && *v) candidates.push_back(fs::path(v) / "include");
  if (fs::path lib = loaded_nvrtc_dir(); !lib.empty()) {
    candidates.push_back(lib.parent_path() / "include");                // <toolkit>/lib64/..
    candidates.push_back(lib.parent_path().parent_path() / "include");  // /usr/lib/<triple>/../..
  }
  candidates.push_back("/usr/local/cuda/include");
  for (const fs::path& dir : candidates) {
    std::error_code ec;
    if (fs::exists(dir / "cuda_fp16.h", ec)) return dir.string();
  }
  return {};
}

inline const std::string& toolkit_include() {
  static const std::string dir = find_toolkit_include();
  return dir;
}

inline bool sets_language_standard(const std::vector<std::string>& options) {
  for (const std::string& o : options)
    if (o.rfind("-std=", 0) == 0 || o.rfind("--std=", 0) == 0 || o == "-std" || o == "--std") return true;
  return false;
}

// Releases the program however compilation ends.
class Program {
 public:
  Program(const std::string& source, const std::string& file_name) {
    result_ = nvrtcCreateProgram(&program_, source.c_str(), file_name.c_str(), 0, nullptr, nullptr);
  }
  ~Program() {
    if (program_) nvrtcDestroyProgram(&program_);
  }
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;

  nvrtcResult created() const { return result_; }
  nvrtcProgram get() const { return program_; }

  std::string log() const {
    std::size_t size = 0;
    if (nvrtcGetProgramLogSize(program_, &size) != NVRTC_SUCCESS || size <= 1) return {};
    std::string text(size, '\0');
    nvrtcGetProgramLog(program_, text.data());
    text.resize(size - 1);  // the terminating NUL
    return text;
  }

 private:
  nvrtcProgram program_ = nullptr;
  nvrtcResult result_ = NVRTC_SUCCESS;
};

inline std::string file_safe(const std::string& name) {
  std::string out = name.empty() ? "kernel" : name;
  for (char& c : out)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.')) c = '_';
  return out;
}

}  // namespace detail

// Where generated sources are dumped: KILN_DEBUG_DIR, else <tmp>/kiln-<uid>.
inline std::filesystem::path debug_dir() {
  if (const char* d = kiln::config::env("KILN_DEBUG_DIR"); d && *d) return d;
  std::error_code ec;
  std::filesystem::path tmp = std::filesystem::temp_directory_path(ec);
  if (ec) tmp = "/tmp";
  return tmp / ("kiln-" + std::to_string(getuid()));
}

// Writes the source to <debug_dir>/<kernel_name>.cu and returns its path (or why it could not).
inline std::string dump_source(const std::string& source, const std::string& kernel_name) {
  std::filesystem::path dir = debug_dir();
  std::filesystem::path path = dir / (detail::file_safe(kernel_name) + ".cu");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << source;
  out.close();
  if (!out) return "(could not write " + path.string() + ")";
  return path.string();
}

// Whether compile_cubin asks ptxas for one block an SM more than it gave held-row kernels alone
// where their own bounds spill: KILN_TUNE_HELD_BOUND_STEPS=0 keeps the rule before (their own
// bounds or none). Part of the disk cache's key (cached_cubin.hpp).
inline bool held_bound_steps() { return kiln::config::env_int("KILN_TUNE_HELD_BOUND_STEPS", 0, 1).value_or(1) != 0; }

// The exact options compile_cubin passes for this architecture ("sm_90a") and these extras.
// C++17 unless the extras choose a standard; no --use_fast_math unless they ask for it.
inline std::vector<std::string> nvrtc_options(const std::string& arch, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> options{"--gpu-architecture=" + arch, "-default-device"};
  if (!detail::sets_language_standard(extra)) options.push_back("-std=c++17");
  if (const std::string& include = detail::toolkit_include(); !include.empty()) options.push_back("-I" + include);
  options.insert(options.end(), extra.begin(), extra.end());
  return options;
}

// The same, space-separated: for logs and cache keys.
inline std::string nvrtc_options_string(const std::string& arch, const std::vector<std::string>& extra = {}) {
  std::string joined;
  for (const std::string& o : nvrtc_options(arch, extra)) joined += (joined.empty() ? "" : " ") + o;
  return joined;
}

[[noreturn]] inline void throw_compile_error(const std::string& source, const std::string& kernel_name,
                                             const std::string& arch, const std::string& log) {
  throw compile_error("NVRTC: compiling " + kernel_name + " for " + arch + " failed", log,
                      dump_source(source, kernel_name));
}

namespace detail {

using codegen::register_step, codegen::sm_registers;  // (codegen/launch_config.hpp)

// The held-row kernels of a translation unit, declared `KILN_HELD_BOUNDS(threads, blocks) name(`
// (codegen/prelude.hpp), each with the registers a thread has when that many blocks share an SM,
// in whole steps: 256 threads x 6 blocks leave 40, not 42 (ptxas's cap under that bound; a kernel
// it gave 42 alone holds only 5 blocks).
struct HeldBound {
  std::string kernel;
  long registers;
  long threads = 0, blocks = 0;
};
// KILN_HELD_BOUND's value that leaves every kernel its own bound: more blocks than an SM holds.
inline constexpr long own_bounds = 64;
inline std::vector<HeldBound> held_bounds(const std::string& source) {
  std::vector<HeldBound> found;
  const std::string mark = "KILN_HELD_BOUNDS(";
  for (auto at = source.find(mark); at != std::string::npos; at = source.find(mark, at + 1)) {
    const char* p = source.c_str() + at + mark.size();
    char* end = nullptr;
    long threads = std::strtol(p, &end, 10), blocks = 0;
    if (end == p || *end != ',') continue;  // the macro's own definition
    blocks = std::strtol(end + 1, &end, 10);
    if (*end != ')' || threads <= 0 || blocks <= 0) continue;
    std::size_t name = source.find_first_not_of(' ', static_cast<std::size_t>(end - source.c_str()) + 1);
    std::size_t paren = source.find('(', name);
    if (name == std::string::npos || paren == std::string::npos) continue;
    found.push_back({source.substr(name, paren - name),
                     sm_registers / (threads * blocks) / register_step * register_step, threads, blocks});
  }
  return found;
}

// Whether a ptxas entry name is `kernel`'s: the name itself (extern "C"), or mangled at global
// scope, _Z<length><name><parameters> (an export's static kernels); never a longer name it begins
// (kernel_12 for kernel_1).
inline bool names(const std::string& entry, const std::string& kernel) {
  return entry == kernel || entry.rfind("_Z" + std::to_string(kernel.size()) + kernel, 0) == 0;
}

// Calls f(h, registers) for each of `held` that ptxas's -v log reports, with the registers it used.
template <class F>
void each_held(const std::string& log, const std::vector<HeldBound>& held, F&& f) {
  std::string entry;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    if (auto at = line.find("Compiling entry function '"); at != std::string::npos) {
      entry = line.substr(at + 26, line.find('\'', at + 26) - (at + 26));
    } else if (auto used = line.find("Used "); used != std::string::npos && !entry.empty()) {
      long registers = std::strtol(line.c_str() + used + 5, nullptr, 10);
      for (const HeldBound& h : held)
        if (names(entry, h.kernel)) f(h, registers);
    }
  }
}

// Whether ptxas (its -v log) gave one of `held` more registers than its bound leaves a thread.
inline bool exceeds(const std::string& log, const std::vector<HeldBound>& held) {
  bool any = false;
  each_held(log, held, [&](const HeldBound& h, long registers) { any = any || registers > h.registers; });
  return any;
}

// The fewest blocks an SM that ptxas's registers (its -v log) leave one of `held` that took more
// than its bound leaves: a warp's registers are allocated 256 at a time (8 a thread), 64K an SM.
// 0 where none of them did.
inline long blocks_alone(const std::string& log, const std::vector<HeldBound>& held) {
  long fewest = 0;
  each_held(log, held, [&](const HeldBound& h, long registers) {
    if (registers <= h.registers || h.threads <= 0) return;
    long blocks = sm_registers / (h.threads * ((registers + register_step - 1) / register_step * register_step));
    fewest = fewest == 0 ? blocks : std::min(fewest, blocks);
  });
  return fewest;
}

// The bytes ptxas spilled (stores), over the whole unit: its -v log.
inline long spilled(const std::string& log) {
  long bytes = 0;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);)
    if (auto at = line.find(" bytes spill stores"); at != std::string::npos) {
      auto start = line.find_last_of(", .", at - 1);
      bytes += std::strtol(line.c_str() + (start == std::string::npos ? 0 : start + 1), nullptr, 10);
    }
  return bytes;
}

}  // namespace detail

// NVRTC options that make ptxas report every kernel's registers and spills. NVRTC 12.9 and later
// keep a cache of their own, and a unit they found there comes back without ptxas's report: a
// second process compiling the same held kernel took it for one within its bound and ran it
// unbounded (a norm backward at 141 registers, one block an SM: 1.6x slower).
inline std::vector<std::string> ptxas_report_options() {
  std::vector<std::string> options{"--ptxas-options=-v"};
  if (nvrtc_version() >= 12090) options.push_back("--no-cache");
  return options;
}

// Compiles source (a whole translation unit defining kernel_name) to a CUBIN for arch, which must
// be a real architecture (sm_XY or sm_XYa). Throws kiln::compile_error with NVRTC's log.
// A unit with held-row kernels (KILN_HELD_BOUNDS) is compiled with ptxas's register report, and
// again with their bounds on (KILN_HELD_BOUND) when one of them took more registers than its bound
// leaves (launch_config.hpp's min_blocks_for); a bounded CUBIN is taken when ptxas fitted it
// without spilling more than a few words beyond the first (a norm backward's f32 kernel, squeezed
// from 125 registers to 64, ran 1.8x slower). Where the kernels' own bounds spill, one block an SM
// more than ptxas gave them alone is asked for (held_bound_steps). `held_bound` says which bound
// the CUBIN took, 0 for none (an export writes it into its source).
inline std::vector<char> compile_cubin(const std::string& source, const std::string& kernel_name,
                                       const std::string& arch, const std::vector<std::string>& extra_options = {},
                                       int* held_bound = nullptr) {
  std::string log;
  auto compile = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> options = nvrtc_options(arch, extra);
    std::vector<const char*> argv;
    for (const std::string& o : options) argv.push_back(o.c_str());
    detail::Program program(source, detail::file_safe(kernel_name) + ".cu");
    if (program.created() != NVRTC_SUCCESS)
      throw_compile_error(source, kernel_name, arch, nvrtcGetErrorString(program.created()));
    nvrtcResult r = nvrtcCompileProgram(program.get(), static_cast<int>(argv.size()), argv.data());
    log = program.log();
    if (r != NVRTC_SUCCESS) throw_compile_error(source, kernel_name, arch, log.empty() ? nvrtcGetErrorString(r) : log);
    std::size_t size = 0;
    if (nvrtcGetCUBINSize(program.get(), &size) != NVRTC_SUCCESS || size == 0)
      throw_compile_error(source, kernel_name, arch,
                          "NVRTC produced no CUBIN: '" + arch + "' is not a real architecture (use sm_XY)");
    std::vector<char> cubin(size);
    if (nvrtcGetCUBIN(program.get(), cubin.data()) != NVRTC_SUCCESS)
      throw_compile_error(source, kernel_name, arch, "nvrtcGetCUBIN failed");
    return cubin;
  };
  if (held_bound) *held_bound = 0;
  std::vector<detail::HeldBound> held = detail::held_bounds(source);
  if (held.empty()) return compile(extra_options);
  std::vector<std::string> report = extra_options;
  for (std::string& option : ptxas_report_options()) report.push_back(std::move(option));
  std::vector<char> cubin = compile(report);
  if (!detail::exceeds(log, held)) return cubin;
  const long spilled = detail::spilled(log);
  const long alone = detail::blocks_alone(log, held);
  std::vector<long> caps{detail::own_bounds};
  if (held_bound_steps() &&
      std::any_of(held.begin(), held.end(), [&](const detail::HeldBound& h) { return h.blocks > alone + 1; }))
    caps.push_back(alone + 1);
  for (long cap : caps) {
    std::vector<std::string> bounded = report;
    bounded.push_back("-DKILN_HELD_BOUND=" + std::to_string(cap));
    std::vector<char> fitted = compile(bounded);
    if (detail::spilled(log) > spilled + 16) continue;
    if (held_bound) *held_bound = static_cast<int>(cap);
    return fitted;
  }
  return cubin;
}

}  // namespace kiln::runtime
