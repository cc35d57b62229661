// The on-disk cache of compiled kernels (shared objects, cubins): entries are written atomically and
// checked on read, and no I/O problem ever escapes as an exception — a broken cache only costs
// recompilation.
//
// Layout: <root>/v<format_version>/<kind>/<key_hex>.<kind>. Each file is a 40-byte header (magic
// "KILNCACH", u32 format version, u32 header size, u64 payload size, 128-bit hash of the payload,
// all little-endian) followed by the payload. A file that is short, has another magic or version,
// or whose payload hash differs is a miss and is removed. No fsync: a crash can leave a truncated
// file behind the rename, and the header check turns that into a miss.
//
// A directory that cannot be written (read-only, full, not a directory) turns the cache memory-only:
// the first failed store warns once per process on stderr, later stores are dropped without trying,
// loads go on. A failed write never leaves an entry behind, only (at worst) nothing.
#pragma once
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../../core/config.hpp"
#include "../../core/faults.hpp"
#include "../../debug/log.hpp"
#include "hash.hpp"

namespace kiln::runtime {

namespace detail {

inline constexpr std::size_t k_entry_header_size = 40;
inline constexpr char k_entry_magic[8] = {'K', 'I', 'L', 'N', 'C', 'A', 'C', 'H'};

inline void put_le(char* out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = char((v >> (8 * i)) & 0xFF);
}
inline std::uint64_t get_le(const char* in, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= std::uint64_t(static_cast<unsigned char>(in[i])) << (8 * i);
  return v;
}

// Keys and kinds become file names, so only a harmless alphabet is accepted (no '/', no "..").
inline bool is_safe_name(std::string_view s) {
  if (s.empty() || s.size() > 128) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  return true;
}

// Reads exactly n bytes unless the file ends or fails first; returns how many were read.
inline std::size_t read_fully(int fd, char* out, std::size_t n) {
  std::size_t done = 0;
  while (done < n) {
    ssize_t r = ::read(fd, out + done, n - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    done += std::size_t(r);
  }
  return done;
}

inline bool write_fully(int fd, const char* data, std::size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    data += w;
    n -= std::size_t(w);
  }
  return true;
}

inline std::string errno_text() { return std::strerror(errno); }

// Set once any cache of this process has warned that it cannot write: one line per process, not one
// per kernel or per cache object. Tests reset it to see their own warning.
inline std::atomic<bool> disk_cache_warned{false};

}  // namespace detail

class DiskCache {
 public:
  static constexpr std::uint32_t format_version = 1;

  // A disabled cache: every load misses and every store is dropped.
  DiskCache() = default;
  // Tests and tools point a cache at their own directory; it is created on the first store.
  explicit DiskCache(std::filesystem::path root) : root_(std::move(root)) {}

  bool enabled() const { return !root_.empty(); }
  // True once a store failed for an I/O reason: from then on stores are dropped (memory only).
  bool memory_only() const { return memory_only_.load(std::memory_order_relaxed); }
  const std::filesystem::path& root() const { return root_; }

  std::filesystem::path entry_path(std::string_view key_hex, std::string_view kind) const {
    std::string file = std::string(key_hex) + "." + std::string(kind);
    return root_ / ("v" + std::to_string(format_version)) / std::string(kind) / file;
  }

  // The payload stored under (key, kind), or nothing when absent, unreadable or corrupt.
  std::optional<std::vector<char>> load(std::string_view key_hex, std::string_view kind) {
    if (!enabled() || !detail::is_safe_name(key_hex) || !detail::is_safe_name(kind)) return std::nullopt;
    std::filesystem::path path = entry_path(key_hex, kind);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      debug::log_lazy(debug::Channel::cache, [&] { return "disk miss " + path.string(); });
      return std::nullopt;
    }
    std::optional<std::vector<char>> payload = read_entry(fd);
    ::close(fd);
    if (!payload) {
      // Removing lets the next store replace it; a racing writer's fresh entry may go too, which
      // only costs one more compile.
      ::unlink(path.c_str());
      debug::log_lazy(debug::Channel::cache, [&] { return "corrupt entry removed: " + path.string(); });
      return std::nullopt;
    }
    debug::log_lazy(debug::Channel::cache, [&] { return "disk hit " + path.string(); });
    return payload;
  }

  // Stores bytes under (key, kind) atomically: readers see the old entry or the whole new one.
  // Never throws: a cache that cannot be written only costs recompiling in the next process.
  void store(std::string_view key_hex, std::string_view kind, std::span<const char> bytes) noexcept {
    if (!enabled() || memory_only()) return;
    try {
      store_entry(key_hex, kind, bytes);
    } catch (...) {  // e.g. bad_alloc while building a path: stop writing, and say so if memory allows
      memory_only_.store(true, std::memory_order_relaxed);
      try {
        warn("storing an entry failed with an exception; kernels stay cached in memory only");
      } catch (...) {
      }
    }
  }

 private:
  void store_entry(std::string_view key_hex, std::string_view kind, std::span<const char> bytes) {
    // A caller's bad key (kiln's own are hex): that entry only, and no use of the process's one warning.
    if (!detail::is_safe_name(key_hex) || !detail::is_safe_name(kind))
      return debug::log_lazy(debug::Channel::cache, [&] {
        return "not caching on disk: invalid cache key '" + std::string(key_hex) + "." + std::string(kind) + "'";
      });
    std::filesystem::path path = entry_path(key_hex, kind);
    std::error_code ec;
    std::filesystem::create_directories(path.parent_path(), ec);
    if (ec) return go_memory_only("cannot create " + path.parent_path().string() + ": " + ec.message());
    std::filesystem::path temp = path;
    temp += temp_suffix();
    if (std::string why = write_entry(temp, bytes); !why.empty()) {
      ::unlink(temp.c_str());
      return go_memory_only("cannot write " + temp.string() + ": " + why);
    }
    if (::rename(temp.c_str(), path.c_str()) != 0) {
      std::string why = detail::errno_text();
      ::unlink(temp.c_str());
      return go_memory_only("cannot rename to " + path.string() + ": " + why);
    }
    debug::log_lazy(debug::Channel::cache, [&] { return "stored " + path.string(); });
  }

  static std::optional<std::vector<char>> read_entry(int fd) {
    char header[detail::k_entry_header_size];
    struct stat st {};
    if (::fstat(fd, &st) != 0 || std::uint64_t(st.st_size) < sizeof header) return std::nullopt;
    if (detail::read_fully(fd, header, sizeof header) != sizeof header) return std::nullopt;
    std::uint64_t size = detail::get_le(header + 16, 8);
    bool header_ok =
        std::memcmp(header, detail::k_entry_magic, 8) == 0 && detail::get_le(header + 8, 4) == format_version &&
        detail::get_le(header + 12, 4) == sizeof header && size == std::uint64_t(st.st_size) - sizeof header;
    if (!header_ok) return std::nullopt;
    std::vector<char> payload(size);
    if (detail::read_fully(fd, payload.data(), size) != size) return std::nullopt;
    Digest d = hash128(std::string_view(payload.data(), payload.size()));
    if (d.lo != detail::get_le(header + 24, 8) || d.hi != detail::get_le(header + 32, 8)) return std::nullopt;
    return payload;
  }

  // Returns an empty string on success, else why it failed.
  static std::string write_entry(const std::filesystem::path& temp, std::span<const char> bytes) {
    char header[detail::k_entry_header_size];
    Digest d = hash128(std::string_view(bytes.data(), bytes.size()));
    std::memcpy(header, detail::k_entry_magic, 8);
    detail::put_le(header + 8, format_version, 4);
    detail::put_le(header + 12, sizeof header, 4);
    detail::put_le(header + 16, bytes.size(), 8);
    detail::put_le(header + 24, d.lo, 8);
    detail::put_le(header + 32, d.hi, 8);
    int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return detail::errno_text();
    bool ok = detail::write_fully(fd, header, sizeof header);
    if (ok && faults::detail::take(faults::detail::disk_cache_write)) [[unlikely]] {
      // An injected full disk: the header is on disk, the payload is not.
      ok = false;
      errno = ENOSPC;
    }
    ok = ok && detail::write_fully(fd, bytes.data(), bytes.size());
    std::string why = ok ? "" : detail::errno_text();
    if (::close(fd) != 0 && ok) why = detail::errno_text();
    return why;
  }

  // Unique across threads (counter), processes (pid) and hosts sharing the directory (clock);
  // O_EXCL turns the remaining chance of a clash into a failed store rather than a mixed file.
  static std::string temp_suffix() {
    static std::atomic<std::uint64_t> counter{0};
    auto now = std::chrono::steady_clock::now().time_since_epoch().count();
    return ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++) + "." +
           hex(std::uint64_t(now)).substr(8);
  }

  // An I/O failure: this cache stops writing (a full or read-only directory stays so for a while,
  // and trying again would only cost a failed write per kernel) and says so once.
  void go_memory_only(const std::string& why) {
    memory_only_.store(true, std::memory_order_relaxed);
    warn(why + "; kernels stay cached in memory only and will be recompiled by the next process");
  }

  // The first warning of the process is always written (stderr unless a log sink is set), later
  // ones only under KILN_LOGS=cache: a cache that cannot be written is worth one line, not one per
  // kernel. Never throws: it runs on failure paths.
  static void warn(const std::string& why) noexcept {
    try {
      bool first = !detail::disk_cache_warned.exchange(true);
      if (first || debug::log_enabled(debug::Channel::cache))
        debug::log(debug::Channel::cache, "not caching on disk: " + why);
    } catch (...) {
    }
  }

  std::filesystem::path root_;
  std::atomic<bool> memory_only_{false};
};

// $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else $HOME/.cache/kiln; empty when none is set.
inline std::filesystem::path default_cache_dir() {
  auto env = [](const char* name) -> std::string {
    const char* v = kiln::config::env(name);
    return v ? v : "";
  };
  if (std::string dir = env("KILN_CACHE_DIR"); !dir.empty()) return dir;
  if (std::string xdg = env("XDG_CACHE_HOME"); !xdg.empty()) return std::filesystem::path(xdg) / "kiln";
  if (std::string home = env("HOME"); !home.empty()) return std::filesystem::path(home) / ".cache" / "kiln";
  return {};
}

// The process-wide cache, its directory read from the environment on first use. Never destroyed,
// so it stays usable from other objects' destructors at exit.
inline DiskCache& default_disk_cache() {
  static DiskCache* cache = new DiskCache(default_cache_dir());
  return *cache;
}

}  // namespace kiln::runtime
