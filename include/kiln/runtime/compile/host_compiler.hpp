// Compiling generated C++ with the host compiler into a shared object and loading it, so the same
// block programs that run on a GPU also run on any CPU; results are cached in memory and on disk.
//
// The compiler is found at run time ($KILN_CXX, else $CXX, else c++, g++ or clang++ on PATH) and
// probed once for its identity, OpenMP and glibc's vector math (host_probes.hpp). The cache key covers everything that
// changes the binary: the source, the compiler's command and `--version`, the flags, and the CPU (because of
// -march=native, an entry built on one machine must not load on another sharing the cache).
#pragma once
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <sys/utsname.h>

#include "../../core/config.hpp"
#include "../../core/error.hpp"
#include "../../debug/log.hpp"
#include "disk_cache.hpp"
#include "hash.hpp"
#include "host_probes.hpp"
#include "host_process.hpp"
#include "host_team.hpp"
#include "kernel_cache.hpp"

namespace kiln::runtime {

namespace detail {

inline std::vector<std::string> find_host_compiler() {
  for (const char* var : {"KILN_CXX", "CXX"}) {
    const char* value = kiln::config::env(var);
    std::vector<std::string> words = split_words(value ? value : "");
    if (words.empty()) continue;
    if (std::string exe = find_executable(words[0]); !exe.empty()) {
      words[0] = exe;
      return words;
    }
    // KILN_CXX is an explicit request, so a wrong one is an error; CXX is often set for other tools.
    if (std::string_view(var) == "KILN_CXX")
      throw kiln::compile_error("host compiler: KILN_CXX=" + std::string(value) + " is not an executable", "", "");
  }
  for (const char* name : {"c++", "g++", "clang++"})
    if (std::string exe = find_executable(name); !exe.empty()) return {exe};
  const char* path = kiln::config::env("PATH");
  throw kiln::compile_error(
      "no host C++ compiler was found: set KILN_CXX (or CXX) to one, or put c++, g++ or "
      "clang++ on PATH",
      std::string("PATH=") + (path ? path : ""), "");
}

// The model and feature flags of this CPU: what -march=native expands to depends on them.
inline std::string cpu_identity() {
  utsname u{};
  std::string id = ::uname(&u) == 0 ? u.machine : "unknown";
  std::ifstream cpuinfo("/proc/cpuinfo");
  bool have_model = false, have_flags = false;
  for (std::string line; std::getline(cpuinfo, line) && !(have_model && have_flags);) {
    bool model = line.rfind("model name", 0) == 0,
         flags = line.rfind("flags", 0) == 0 || line.rfind("Features", 0) == 0;
    if ((model && !have_model) || (flags && !have_flags)) id += "\n" + line;
    have_model |= model;
    have_flags |= flags;
  }
  return id;
}

// The compiler command, its flags and the part of every cache key they determine; found once.
struct HostToolchain {
  std::vector<std::string> cxx;
  std::vector<std::string> flags;
  std::vector<std::string> libs;  // after the source: -lmvec where the kernels call libmvec
  bool gcc = false;
  bool openmp = false;
  int libmvec = 0;  // prelude_libmvec's level (host_probes.hpp); 0: libm's functions once a lane
  HostTeam team;  // the kernels' OpenMP team (host_team.hpp); empty without OpenMP
  Digest key;
};

// Flags for this CPU beyond -march=native, from its identity (cpu_identity()). With AVX-512,
// GCC's tuning for Intel's server cores still prefers 256-bit vectors; the kernels' special
// functions ran ~2x faster on 512-bit ones (softmax, cross_entropy on a Sapphire Rapids Xeon;
// memory-bound kernels within noise: benchmarks/NOTES.md item 69), which is also what PyTorch's
// CPU kernels use there. Clang takes the same flag.
inline std::vector<std::string> cpu_tuning_flags(const std::string& identity) {
  const std::string flags = identity + "\n";
  if (flags.find(" avx512f ") != std::string::npos || flags.find(" avx512f\n") != std::string::npos)
    return {"-mprefer-vector-width=512"};
  return {};
}

inline HostToolchain find_toolchain() {
  HostToolchain t;
  t.cxx = find_host_compiler();
  // No -ffast-math (results must match the f64 reference) and no FMA contraction (CPU results stay
  // the same whatever the compiler decides to fuse).
  t.flags = split_words("-O3 -march=native -std=c++17 -shared -fPIC -fno-math-errno -ffp-contract=off");
  const std::string cpu = cpu_identity();
  for (std::string& f : cpu_tuning_flags(cpu)) t.flags.push_back(std::move(f));
  std::vector<std::string> version_argv = t.cxx;
  version_argv.push_back("--version");
  std::string version = run_process(version_argv).output;
  t.gcc = version.find("Free Software Foundation") != std::string::npos;  // GCC's copyright line
  version = version.substr(0, version.find('\n'));
  Hasher h;
  h.update("kiln-host-so-v1").update(join_command(t.cxx)).update(version).update(cpu);
  for (const std::string& f : t.flags) h.update(f);
  std::vector<std::string> probe_argv = t.cxx;
  probe_argv.insert(probe_argv.end(), t.flags.begin(), t.flags.end());
  // The two probes build side by side (each is a compiler run of ~0.1 s at a process's first CPU
  // call when the disk cache does not have it yet); the environment is settled first, since loading
  // a probe may set variables and setenv must not race the other thread's reads.
  settle_host_threads();
  auto libmvec_level = [&, argv = probe_argv, key = h.digest()] {
    try {
      return probe_libmvec(argv, key, t.gcc);
    } catch (...) {  // optional: without it, libm's functions once a lane
      return 0;
    }
  };
  std::future<int> libmvec;
  try {
    libmvec = std::async(std::launch::async, libmvec_level);
  } catch (const std::system_error&) {  // no thread to be had: on this one, after the other probe
  }
  void* probe = probe_openmp(std::move(probe_argv), h.digest());
  t.openmp = probe != nullptr;
  t.team = host_team_in(probe);
  if (t.openmp) t.flags.push_back("-fopenmp");
  t.libmvec = libmvec.valid() ? libmvec.get() : libmvec_level();
  if (t.libmvec > 0) {
    t.flags.push_back("-DKILN_LIBMVEC=" + std::to_string(t.libmvec));
    t.libs.push_back("-lmvec");
  }
  t.key = h.update(t.openmp).update(t.libmvec).digest();
  debug::log_lazy(debug::Channel::cache,
                  [&] { return "host compiler: " + join_command(t.cxx) + " (" + version + ")"; });
  return t;
}

// A function-local static: initialised once and thread-safely; if finding the compiler throws,
// the next call tries again.
inline const HostToolchain& toolchain() {
  static const HostToolchain t = find_toolchain();
  return t;
}

inline std::atomic<std::size_t>& compile_counter() {
  static std::atomic<std::size_t> count{0};
  return count;
}

inline Digest shared_object_key(std::string_view source) {
  return Hasher().update(toolchain().key).update(source).digest();
}

}  // namespace detail

// Whether generated kernels are built with OpenMP (they spread programs over cores themselves);
// when false the kiln runtime spreads programs with std::thread.
inline bool host_openmp() { return detail::toolchain().openmp; }

// The compiler command line without its input, output and libraries (-lmvec), for logs.
inline std::string host_compiler_command() {
  std::vector<std::string> argv = detail::toolchain().cxx;
  argv.insert(argv.end(), detail::toolchain().flags.begin(), detail::toolchain().flags.end());
  return detail::join_command(argv);
}

// How many times the compiler has been run on a kernel source in this process (probes excluded);
// tests use it to tell cache hits from compiles.
inline std::size_t host_compile_count() { return detail::compile_counter().load(); }

// Writes source to $KILN_DEBUG_DIR/<name>.<key>.<ext> when that variable is set; returns the path,
// or "" when it is not set or the write failed. NVRTC compiles use the same layout.
inline std::filesystem::path dump_debug_source(std::string_view name, std::string_view key_hex, std::string_view source,
                                               std::string_view ext = "cpp") {
  const char* dir = kiln::config::env("KILN_DEBUG_DIR");
  if (!dir || !*dir) return {};
  std::filesystem::path path =
      std::filesystem::path(dir) /
      (detail::file_stem(name) + "." + std::string(key_hex.substr(0, 16)) + "." + std::string(ext));
  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  return detail::write_file(path, source) ? path : std::filesystem::path();
}

namespace detail {

// Runs the compiler on source in a private directory and returns the shared object's bytes.
inline std::vector<char> run_host_compiler(const std::string& source, const std::string& name,
                                           const std::filesystem::path& dumped) {
  std::filesystem::path dir = make_temp_dir();
  std::string stem = file_stem(name);
  std::filesystem::path src = dir / (stem + ".cpp"), out = dir / (stem + ".so");
  if (dir.empty() || !write_file(src, source))
    throw kiln::compile_error("host compiler: cannot write a source file under " + temp_root().string(),
                              std::strerror(errno), dumped.string());
  std::vector<std::string> argv = toolchain().cxx;
  argv.insert(argv.end(), toolchain().flags.begin(), toolchain().flags.end());
  argv.insert(argv.end(), {"-o", out.string(), src.string()});
  argv.insert(argv.end(), toolchain().libs.begin(), toolchain().libs.end());
  ++compile_counter();
  ProcessResult result = run_process(argv);
  std::optional<std::vector<char>> bytes;
  if (result.exit_code == 0) bytes = read_file(out);
  std::error_code ec;
  if (!bytes) {
    // Keep the source where the log can point to it: the debug dump, else the temp dir.
    if (dumped.empty())
      std::filesystem::remove(out, ec);
    else
      std::filesystem::remove_all(dir, ec);
    throw kiln::compile_error("host compiler: " + join_command(argv) + " failed", result.output,
                              dumped.empty() ? src.string() : dumped.string());
  }
  std::filesystem::remove_all(dir, ec);
  return std::move(*bytes);
}

}  // namespace detail

// Loads a shared object from its bytes (dlopen needs a file, so they are copied to a temp file).
inline std::shared_ptr<SharedObject> load_shared_object(std::span<const char> bytes, const std::string& name) {
  std::string errors;
  if (void* handle = detail::open_library(bytes, name, errors)) return std::make_shared<SharedObject>(handle, name);
  throw kiln::error("cannot load the compiled shared object " + name + ":\n" + errors);
}

// The shared object's bytes for source: from the disk cache, else compiled (and then stored).
// Every call dumps the source to $KILN_DEBUG_DIR when it is set.
inline std::vector<char> build_shared_object(const std::string& source, const std::string& name,
                                             DiskCache& cache = default_disk_cache()) {
  std::string key = hex(detail::shared_object_key(source));
  std::filesystem::path dumped = dump_debug_source(name, key, source);
  if (std::optional<std::vector<char>> hit = cache.load(key, "so")) return std::move(*hit);
  debug::log_lazy(debug::Channel::cache, [&] {
    std::string libs;
    for (const std::string& l : detail::toolchain().libs) libs += " " + l;
    return "compiling " + name + " with " + host_compiler_command() + (libs.empty() ? "" : " (source)" + libs);
  });
  std::vector<char> bytes = detail::run_host_compiler(source, name, dumped);
  cache.store(key, "so", bytes);
  return bytes;
}

// Compiles (or finds) and loads source; each distinct source is built and loaded once per process
// however many threads ask, and the loaded objects stay loaded until exit.
inline std::shared_ptr<SharedObject> compile_shared_object(const std::string& source, const std::string& name) {
  // Leaked on purpose: unloading kernels during static destruction could pull code from under
  // objects that are destroyed later.
  static auto* loaded = new CompileOnceCache<SharedObject>();
  auto object = loaded->get_or_compile(detail::shared_object_key(source), [&] {
    std::vector<char> bytes = build_shared_object(source, name);
    return load_shared_object(bytes, name);
  });
  // SharedObject has only const members, so handing out a non-const pointer changes nothing.
  return std::const_pointer_cast<SharedObject>(object);
}

}  // namespace kiln::runtime
