// Faults degrade, never corrupt: a device out of memory, a cache directory that cannot be written
// and a compiler that fails each end in a typed error (or, for the cache, a warning and memory-only
// caching), never a crash, a half-written output or a corrupt cache entry. Each fault is injected:
// through kiln::faults (core/faults.hpp) where a real one cannot be had on demand (CI runs as root,
// so chmod denies nothing, and has no GPU), through a broken input where it can.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <kiln/core/faults.hpp>
#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/runtime/compile/disk_cache.hpp>
#include <kiln/runtime/compile/host_compiler.hpp>
#include <kiln/runtime/compile/nvrtc.hpp>
#include <kiln/testing.hpp>

#include "have_gpu.hpp"

namespace k = kiln;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "kiln-faults-XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Collects what kiln logs while it lives (instead of stderr), and restores the previous sink.
struct CapturedLog {
  static std::string& text() {
    static std::string t;
    return t;
  }
  k::debug::LogSink previous;
  CapturedLog() : previous(k::debug::set_log_sink([](k::debug::Channel, std::string_view s) { text() += s; })) {
    text().clear();
  }
  ~CapturedLog() { k::debug::set_log_sink(previous); }
  // How many times `needle` occurs in the log.
  static int count(std::string_view needle) {
    int n = 0;
    for (std::size_t at = text().find(needle); at != std::string::npos; at = text().find(needle, at + 1)) ++n;
    return n;
  }
};

std::vector<fs::path> regular_files_under(const fs::path& dir) {
  std::vector<fs::path> files;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator(); ++it)
    if (it->is_regular_file()) files.push_back(it->path());
  return files;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool contains(std::string_view hay, std::string_view needle) { return hay.find(needle) != std::string_view::npos; }

std::span<const char> bytes_of(std::string_view s) { return {s.data(), s.size()}; }

}  // namespace

// --- device out of memory ------------------------------------------------------------------------

TEST_CASE("faults: injected device allocation failures are consumed one at a time") {
  k::faults::scoped_clear clear;
  k::faults::fail_device_allocations(2);
  CHECK(k::faults::pending_device_allocation_failures() == 2);
  CHECK(k::faults::detail::take(k::faults::detail::device_out_of_memory));
  CHECK(k::faults::detail::take(k::faults::detail::device_out_of_memory));
  CHECK_FALSE(k::faults::detail::take(k::faults::detail::device_out_of_memory));
  CHECK(k::faults::pending_device_allocation_failures() == 0);
}

// The allocator's out-of-memory policy, driven without a GPU: the same function the caching
// allocator calls, with the driver replaced by counters.
TEST_CASE("faults: out of memory returns the cache and retries once, then names the bytes (no GPU needed)") {
  struct Fake {
    std::vector<CUresult> answers;  // what each successive cuMemAlloc returns
    int tries = 0, releases = 0;
    std::optional<std::pair<std::size_t, std::size_t>> info{{std::size_t(12345), std::size_t(1) << 34}};
    void* run(std::size_t bytes) {
      auto try_alloc = [&](std::size_t size, CUdeviceptr* p) {
        CHECK(size == k::driver::size_class(bytes));
        CUresult r = answers.at(tries++);
        if (r == CUDA_SUCCESS) *p = CUdeviceptr(0x1000);
        return r;
      };
      auto release = [&] {
        ++releases;
        return std::size_t(3) << 20;
      };
      auto memory_info = [&] { return info; };
      return k::driver::detail::allocate_or_retry(bytes, k::driver::size_class(bytes), 0, try_alloc, release,
                                                  memory_info);
    }
  };

  SUBCASE("the first try succeeds: the cache is kept") {
    Fake f{{CUDA_SUCCESS}};
    CHECK(f.run(1000) == reinterpret_cast<void*>(0x1000));
    CHECK(f.tries == 1);
    CHECK(f.releases == 0);
  }
  SUBCASE("out of memory, then the retry after releasing the cache succeeds") {
    Fake f{{CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS}};
    CHECK(f.run(1000) == reinterpret_cast<void*>(0x1000));
    CHECK(f.tries == 2);
    CHECK(f.releases == 1);
  }
  SUBCASE("out of memory twice: a cuda_error naming the request and the free memory, and no third try") {
    Fake f{{CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS}};
    std::string message;
    try {
      f.run(1000);
    } catch (const k::cuda_error& e) {
      message = e.what();
    }
    INFO(message);
    CHECK(f.tries == 2);
    CHECK(f.releases == 1);
    CHECK(contains(message, "allocate 1000 bytes on cuda:0"));
    CHECK(contains(message, "CUDA_ERROR_OUT_OF_MEMORY"));
    CHECK(contains(message, "requested 1000 bytes"));
    CHECK(contains(message, "12345 bytes (0 MiB) free of 17179869184 bytes (16384 MiB)"));
    CHECK(contains(message, "returned its 3145728 bytes (3 MiB) of cached blocks"));
  }
  SUBCASE("out of memory twice, and the driver cannot say how much is free") {
    Fake f{{CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_OUT_OF_MEMORY}};
    f.info.reset();
    std::string message;
    try {
      f.run(5u << 20);
    } catch (const k::cuda_error& e) {
      message = e.what();
    }
    INFO(message);
    CHECK(contains(message, "requested 5242880 bytes (5 MiB)"));
    CHECK(contains(message, "free memory unknown"));
  }
  SUBCASE("another error is not retried and releases nothing") {
    Fake f{{CUDA_ERROR_INVALID_VALUE, CUDA_SUCCESS}};
    CHECK_THROWS_AS(f.run(1000), k::cuda_error);
    CHECK(f.tries == 1);
    CHECK(f.releases == 0);
  }
}

TEST_CASE("faults: a device out of memory is retried after the cache goes back (GPU)" * needs_gpu()) {
  k::faults::scoped_clear clear;
  auto& cache = k::driver::caching_allocator();
  cache.release_cached(0);
  { k::Tensor cached = k::empty({1 << 18}, k::f32, k::cuda); }  // 1 MiB back in the cache
  k::synchronize();
  CHECK(cache.cached_bytes(0) > 0);
  k::faults::fail_device_allocations(1);  // a size not in the cache: the driver is asked
  k::Tensor t = k::empty({(1 << 22) + 77}, k::f32, k::cuda);
  CHECK(k::faults::pending_device_allocation_failures() == 0);
  CHECK(cache.cached_bytes(0) == 0);  // returned to the driver before the retry
  CHECK(t.data_ptr() != nullptr);
}

TEST_CASE("faults: a device out of memory twice is a cuda_error and leaves the output untouched (GPU)" * needs_gpu()) {
  k::faults::scoped_clear clear;
  auto x = k::randn({1 << 24}, k::f32, k::cuda, 1);
  auto expr = k::sum(x * 2.0f);
  // More than one kernel: the partial sums need a buffer, allocated before any kernel runs.
  REQUIRE(k::explain(expr).kernels.size() >= 2);
  k::Tensor warm = k::zeros({}, k::f32, k::cuda);
  k::eval(warm, expr);  // compiled and warmed
  k::Tensor out = k::full({}, -1.0, k::f32, k::cuda);
  k::synchronize();
  k::driver::caching_allocator().release_cached(0);  // so the next run must ask the driver
  k::faults::fail_device_allocations(2);
  std::string message;
  try {
    k::eval(out, expr);
  } catch (const k::cuda_error& e) {
    message = e.what();
  }
  INFO(message);
  CHECK(contains(message, "CUDA_ERROR_OUT_OF_MEMORY"));
  CHECK(contains(message, " free of "));
  CHECK(k::faults::pending_device_allocation_failures() == 0);
  CHECK(k::to_vector<float>(out) == std::vector<float>{-1.0f});
  k::faults::clear();
  k::eval(out, expr);  // and the next call works
  auto r = k::testing::allclose(out, k::reference::eval(k::sum(x * 2.0f)), 1e-4, 1e-1);
  CHECK_MESSAGE(bool(r), r);
}

// --- a disk cache that cannot be written ---------------------------------------------------------

TEST_CASE("faults: a full cache disk turns the cache memory-only with one warning and no entry") {
  k::faults::scoped_clear clear;
  TempDir dir;
  CapturedLog log;
  k::runtime::detail::disk_cache_warned.store(false);  // this test's warning is the process's first
  k::runtime::DiskCache cache(dir.path);
  cache.store("aaaa", "so", bytes_of("a good entry"));
  REQUIRE(cache.load("aaaa", "so"));
  k::faults::fail_disk_cache_writes(1);
  CHECK_NOTHROW(cache.store("bbbb", "so", bytes_of(std::string(100000, 'x'))));
  CHECK(k::faults::pending_disk_cache_write_failures() == 0);  // the fault was reached
  CHECK(cache.memory_only());
  // No entry and no temp file: only the earlier good entry is on disk, and it still loads.
  std::vector<fs::path> files = regular_files_under(dir.path);
  CHECK(files.size() == 1);
  CHECK(files.at(0) == cache.entry_path("aaaa", "so"));
  CHECK_FALSE(cache.load("bbbb", "so"));
  CHECK(cache.load("aaaa", "so"));
  // Later stores are dropped without trying (the write would succeed now: the fault is spent).
  cache.store("cccc", "so", bytes_of("data"));
  CHECK_FALSE(cache.load("cccc", "so"));
  CHECK(regular_files_under(dir.path).size() == 1);
  // Another unwritable cache in the same process (its root is a file): no second warning.
  fs::path file = dir.path / "a_file";
  std::ofstream(file) << "x";
  k::runtime::DiskCache broken(file);
  CHECK_NOTHROW(broken.store("dddd", "so", bytes_of("data")));
  CHECK(broken.memory_only());
  INFO(CapturedLog::text());
  if (!k::debug::log_enabled(k::debug::Channel::cache))  // KILN_LOGS=cache logs every failure
    CHECK(CapturedLog::count("not caching on disk") == 1);
  CHECK(contains(CapturedLog::text(), std::strerror(ENOSPC)));
  CHECK(contains(CapturedLog::text(), "memory only"));
}

TEST_CASE("faults: a kernel compiles and runs when its cache entry cannot be written") {
  k::faults::scoped_clear clear;
  TempDir dir;
  CapturedLog log;
  k::runtime::DiskCache cache(dir.path / "cache");
  // Find the compiler first: its one-time OpenMP probe stores into the process's own disk cache,
  // which must not be the write that fails.
  k::runtime::host_compiler_command();
  // A source of its own (the pid in a comment), so neither cache can already hold it.
  std::string source =
      "// faults test " + std::to_string(::getpid()) + "\nextern \"C\" int kiln_faults_answer() { return 42; }\n";
  k::faults::fail_disk_cache_writes(1);
  std::vector<char> bytes;
  CHECK_NOTHROW(bytes = k::runtime::build_shared_object(source, "kiln_faults_answer", cache));
  CHECK(k::faults::pending_disk_cache_write_failures() == 0);
  CHECK(cache.memory_only());
  CHECK(regular_files_under(dir.path).empty());
  auto object = k::runtime::load_shared_object(bytes, "kiln_faults_answer");
  auto answer = reinterpret_cast<int (*)()>(object->symbol("kiln_faults_answer"));
  CHECK(answer() == 42);
}

// --- compilers that fail ---------------------------------------------------------------------------

TEST_CASE("faults: a failing host compile is a compile_error with the log and the source's path") {
  std::string source = "// faults test " + std::to_string(::getpid()) +
                       "\nextern \"C\" int kiln_faults_broken() { return undeclared_name; }\n";
  std::optional<k::compile_error> caught;
  try {
    k::runtime::compile_shared_object(source, "kiln_faults_broken");
  } catch (const k::compile_error& e) {
    caught = e;
  }
  REQUIRE(caught);
  INFO(caught->what());
  CHECK(contains(caught->log, "undeclared_name"));
  CHECK(contains(caught->what(), caught->log));
  REQUIRE_FALSE(caught->source_path.empty());
  CHECK(contains(caught->what(), caught->source_path));
  CHECK(read_text(caught->source_path) == source);
  // Without KILN_DEBUG_DIR the source is kept in the compile's private temp directory: tidy it.
  const char* debug_dir = std::getenv("KILN_DEBUG_DIR");
  fs::path kept = fs::path(caught->source_path).parent_path();
  if (!(debug_dir && *debug_dir) && kept.filename().string().rfind("kiln-", 0) == 0) {
    std::error_code ec;
    fs::remove_all(kept, ec);
  }
}

TEST_CASE("faults: a failing NVRTC compile is a compile_error with the log and the dumped source (no GPU needed)") {
  std::string source = "extern \"C\" __global__ void kiln_faults_broken_cuda(float* p) { p[0] = undeclared_name; }\n";
  std::optional<k::compile_error> caught;
  try {
    k::runtime::compile_cubin(source, "kiln_faults_broken_cuda", "sm_90");
  } catch (const k::compile_error& e) {
    caught = e;
  }
  REQUIRE(caught);
  INFO(caught->what());
  CHECK(contains(caught->what(), "kiln_faults_broken_cuda"));
  CHECK(contains(caught->log, "undeclared_name"));
  CHECK(contains(caught->what(), caught->log));
  REQUIRE_FALSE(caught->source_path.empty());
  CHECK(read_text(caught->source_path) == source);
}
