// Compiling generated C++ with the host compiler into a shared object and loading it, so the same
// block programs that run on a GPU also run on any CPU; results are cached in memory and on disk.
//
// The compiler is found at run time ($KILN_CXX, else $CXX, else c++, g++ or clang++ on PATH) and
// probed once for its identity and for OpenMP. The cache key covers everything that changes the
// binary: the source, the compiler's command and `--version`, the flags, and the CPU (because of
// -march=native, an entry built on one machine must not load on another sharing the cache).
#pragma once
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <dlfcn.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../../core/config.hpp"
#include "../../core/error.hpp"
#include "../../debug/log.hpp"
#include "disk_cache.hpp"
#include "hash.hpp"
#include "host_team.hpp"
#include "host_threads.hpp"
#include "kernel_cache.hpp"

extern char** environ;

namespace kiln::runtime {

// A loaded shared object; dlclose on destruction.
class SharedObject {
 public:
  SharedObject(void* handle, std::string name) : handle_(handle), name_(std::move(name)) {}
  SharedObject(const SharedObject&) = delete;
  SharedObject& operator=(const SharedObject&) = delete;
  ~SharedObject() { ::dlclose(handle_); }

  // The address of an exported (extern "C") symbol; a missing one is a kiln::error.
  void* symbol(const char* symbol_name) const {
    if (void* p = find_symbol(symbol_name)) return p;
    throw kiln::error("shared object " + name_ + " has no symbol " + symbol_name);
  }
  void* find_symbol(const char* symbol_name) const { return ::dlsym(handle_, symbol_name); }
  const std::string& name() const { return name_; }

 private:
  void* handle_;
  std::string name_;
};

namespace detail {

inline std::vector<std::string> split_words(std::string_view s) {
  std::vector<std::string> words;
  std::istringstream in{std::string(s)};
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

// The executable `name` resolves to (through PATH when it has no '/'), or "" when there is none.
inline std::string find_executable(const std::string& name) {
  auto usable = [](const std::filesystem::path& p) {
    std::error_code ec;
    return std::filesystem::is_regular_file(p, ec) && ::access(p.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string::npos) return usable(name) ? name : "";
  const char* path_env = kiln::config::env("PATH");
  std::istringstream dirs(path_env ? path_env : "/usr/local/bin:/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    std::filesystem::path candidate = std::filesystem::path(dir.empty() ? "." : dir) / name;
    if (usable(candidate)) return candidate.string();
  }
  return "";
}

struct ProcessResult {
  int exit_code = -1;  // -1 when it could not start or did not exit normally
  std::string output;  // stdout and stderr, interleaved as written
};

inline std::string read_all(int fd) {
  std::string out;
  char buffer[4096];
  for (;;) {
    ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return out;
    out.append(buffer, std::size_t(n));
  }
}

// posix_spawn rather than popen: no shell (paths need no quoting) and no fork of a large process.
inline ProcessResult run_process(const std::vector<std::string>& argv) {
  int pipe_fds[2];
  // CLOEXEC so children spawned by other threads do not inherit the write end and delay our EOF.
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return {-1, "pipe: " + std::string(std::strerror(errno))};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], 1);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], 2);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  int rc = ::posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(pipe_fds[1]);
  if (rc != 0) {
    ::close(pipe_fds[0]);
    return {-1, "cannot start " + argv[0] + ": " + std::strerror(rc)};
  }
  ProcessResult result{-1, read_all(pipe_fds[0])};
  ::close(pipe_fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return result;
  if (WIFEXITED(status))
    result.exit_code = WEXITSTATUS(status);
  else if (WIFSIGNALED(status))
    result.output += "\n(killed by signal " + std::to_string(WTERMSIG(status)) + ")";
  return result;
}

inline std::string join_command(const std::vector<std::string>& argv) {
  std::string out;
  for (const std::string& a : argv) out += (out.empty() ? "" : " ") + a;
  return out;
}

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

inline std::filesystem::path temp_root() {
  const char* tmp = kiln::config::env("TMPDIR");
  return tmp && *tmp ? tmp : "/tmp";
}

// A fresh private directory (mode 0700) under the temp root, or "" when none can be made.
inline std::filesystem::path make_temp_dir() {
  std::string pattern = (temp_root() / "kiln-XXXXXX").string();
  return ::mkdtemp(pattern.data()) ? std::filesystem::path(pattern) : std::filesystem::path();
}

inline bool write_file(const std::filesystem::path& path, std::string_view text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(text.data(), std::streamsize(text.size()));
  return bool(out.flush());
}

inline std::optional<std::vector<char>> read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return in.bad() ? std::nullopt : std::optional(std::move(bytes));
}

// Kernel names become file names: keep [A-Za-z0-9_] and a sane length.
inline std::string file_stem(std::string_view name) {
  std::string stem(name.substr(0, 120));
  for (char& c : stem)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') c = '_';
  return stem.empty() ? "kernel" : stem;
}

// Copies bytes to a fresh file under dir and dlopens it; the file is unlinked at once (the mapping
// keeps it alive). Names are unique per process because glibc returns an already-loaded object
// when a new path equals an old one.
inline void* open_library_copy(const std::filesystem::path& dir, std::span<const char> bytes, const std::string& name,
                               std::string& errors) {
  static std::atomic<std::uint64_t> counter{0};
  std::string path = (dir / ("kiln-" + file_stem(name).substr(0, 60) + "-" + std::to_string(::getpid()) + "-" +
                             std::to_string(counter++) + "-XXXXXX.so"))
                         .string();
  int fd = ::mkstemps(path.data(), 3);
  if (fd < 0) {
    errors += dir.string() + ": " + std::strerror(errno) + "\n";
    return nullptr;
  }
  bool written = write_fully(fd, bytes.data(), bytes.size());
  ::close(fd);
  settle_host_threads();  // before the kernel's libgomp is loaded
  void* handle = written ? ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL) : nullptr;
  if (!handle) {
    const char* why = written ? ::dlerror() : "cannot write the file";
    errors += path + ": " + (why ? why : "dlopen failed") + "\n";
  }
  ::unlink(path.c_str());
  return handle;
}

// Tries the temp directory first, then the cache directory, since /tmp is mounted noexec on some
// hardened systems; returns nullptr with the reasons in errors when neither works.
inline void* open_library(std::span<const char> bytes, const std::string& name, std::string& errors) {
  if (void* handle = open_library_copy(temp_root(), bytes, name, errors)) return handle;
  if (!default_disk_cache().enabled()) return nullptr;
  return open_library_copy(default_disk_cache().root(), bytes, name, errors);
}

// The probe built with `cxx flags -fopenmp`, or nothing when the compiler refuses.
inline std::optional<std::vector<char>> build_openmp_probe(std::vector<std::string> argv) {
  std::filesystem::path dir = make_temp_dir();
  if (dir.empty() || !write_file(dir / "probe.cpp", openmp_probe_source)) return std::nullopt;
  argv.insert(argv.end(), {"-fopenmp", "-o", (dir / "probe.so").string(), (dir / "probe.cpp").string()});
  std::optional<std::vector<char>> bytes;
  if (run_process(argv).exit_code == 0) bytes = read_file(dir / "probe.so");
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return bytes;
}

// The probe's handle when `cxx flags -fopenmp` builds a shared object that also loads (the runtime
// library may be missing where the compiler accepts the flag), else nullptr. The probe stays loaded
// for good: that pins the OpenMP runtime, which must not be unloaded under kernels whose thread
// pools are parked in it, and its team functions serve host_parallel.hpp's host_team(). Only successes are cached on
// disk, so installing OpenMP later is noticed.
inline void* probe_openmp(std::vector<std::string> argv, const Digest& toolchain_key) {
  std::string key = hex(Hasher().update("openmp-probe-v2").update(toolchain_key).digest());
  std::string errors;
  if (std::optional<std::vector<char>> cached = default_disk_cache().load(key, "probe"))
    if (void* probe = open_library(*cached, "openmp_probe", errors)) return probe;
  std::optional<std::vector<char>> bytes = build_openmp_probe(std::move(argv));
  void* probe = bytes ? open_library(*bytes, "openmp_probe", errors) : nullptr;
  if (probe) default_disk_cache().store(key, "probe", *bytes);
  return probe;
}

// The compiler command, its flags and the part of every cache key they determine; found once.
struct HostToolchain {
  std::vector<std::string> cxx;
  std::vector<std::string> flags;
  bool openmp = false;
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
  version = version.substr(0, version.find('\n'));
  Hasher h;
  h.update("kiln-host-so-v1").update(join_command(t.cxx)).update(version).update(cpu);
  for (const std::string& f : t.flags) h.update(f);
  std::vector<std::string> probe_argv = t.cxx;
  probe_argv.insert(probe_argv.end(), t.flags.begin(), t.flags.end());
  void* probe = probe_openmp(std::move(probe_argv), h.digest());
  t.openmp = probe != nullptr;
  t.team = host_team_in(probe);
  if (t.openmp) t.flags.push_back("-fopenmp");
  t.key = h.update(t.openmp).digest();
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

// The compiler command line without its input and output, for logs.
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
  debug::log_lazy(debug::Channel::cache, [&] { return "compiling " + name + " with " + host_compiler_command(); });
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
