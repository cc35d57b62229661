// Running the host compiler and loading what it builds: a process with its output captured,
// private temp directories and files, and shared objects opened from their bytes (host_compiler.hpp
// builds kernels with these, host_probes.hpp the compiler's probes).
#pragma once
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <dlfcn.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../../core/config.hpp"
#include "../../core/error.hpp"
#include "disk_cache.hpp"
#include "host_threads.hpp"

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

}  // namespace detail

}  // namespace kiln::runtime
