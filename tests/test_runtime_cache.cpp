// Tests of the run-time caches: the hash, the disk cache, compile-once in memory, the host compiler
// (build, load, disk hits, failures) and the log channels they report to.
#include <doctest/doctest.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <latch>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "kiln/debug/log.hpp"
#include "kiln/runtime/compile/disk_cache.hpp"
#include "kiln/runtime/compile/hash.hpp"
#include "kiln/runtime/compile/host_compiler.hpp"
#include "kiln/runtime/compile/kernel_cache.hpp"
#include "scoped_env.hpp"

namespace fs = std::filesystem;
using namespace kiln::runtime;

namespace {

// A fresh directory removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "kiln-test-XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Makes a source unique to this run so the first build is a real compile whatever the cache holds.
std::string unique_comment() {
  return "// run " + std::to_string(::getpid()) + " " +
         std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()) + "\n";
}

std::span<const char> bytes_of(const std::string& s) { return {s.data(), s.size()}; }

}  // namespace

TEST_CASE("hash: stable values, usable at compile time") {
  // Pinned: the hash is part of the disk cache format, so a change here needs a format bump.
  CHECK(hex(hash128("")) == "164ac27820caf39aac95736db7823204");
  CHECK(hex(hash128("kiln")) == "10389fe48f5485ccf39d3bf0ec52e12d");
  CHECK(hex(std::uint64_t{0x1234}) == "0000000000001234");
  CHECK(hex(Digest{1, 2}) == "00000000000000020000000000000001");
  static_assert(hash64("abc") != hash64("abd"));
  static_assert(Hasher().update("abc").digest() == hash128("abc"));
}

TEST_CASE("hash: fields are length-delimited and integers sign-extend") {
  CHECK(Hasher().update("ab").update("c").digest() != Hasher().update("a").update("bc").digest());
  CHECK(Hasher().update("a").digest() != Hasher().update(std::string_view("a\0", 2)).digest());
  CHECK(Hasher().update(-1).digest() == Hasher().update(std::int64_t{-1}).digest());
  CHECK(Hasher().update(1).digest() != Hasher().update(2).digest());
  CHECK(Hasher(1).update("x").digest() != Hasher(2).update("x").digest());
  std::string s(1000, 'q');
  CHECK(hash128(s) == Hasher().update(std::string_view(s)).digest());
}

TEST_CASE("hash: spread and avalanche") {
  std::set<std::uint64_t> seen;
  std::vector<int> bit_count(64, 0);
  constexpr int n = 20000;
  for (int i = 0; i < n; ++i) {
    std::uint64_t h = hash64("kernel_" + std::to_string(i));
    seen.insert(h);
    for (int b = 0; b < 64; ++b) bit_count[std::size_t(b)] += int((h >> b) & 1);
  }
  CHECK(seen.size() == std::size_t(n));
  for (int c : bit_count) CHECK(std::abs(c - n / 2) < n / 20);
  // Flipping one input bit should flip about half of the 128 output bits.
  double total = 0;
  int trials = 0;
  for (int i = 0; i < 200; ++i) {
    std::string text = "source_" + std::to_string(i * 7919) + "_padding";
    Digest base = hash128(text);
    for (std::size_t byte = 0; byte < text.size(); byte += 3) {
      std::string flipped = text;
      flipped[byte] = char(flipped[byte] ^ (1 << (i % 8)));
      Digest d = hash128(flipped);
      total += std::popcount(base.lo ^ d.lo) + std::popcount(base.hi ^ d.hi);
      ++trials;
    }
  }
  CHECK(total / trials == doctest::Approx(64.0).epsilon(0.03));
}

TEST_CASE("disk cache: round trip, corruption is a miss and is repaired") {
  TempDir dir;
  DiskCache cache(dir.path);
  std::string key = hex(hash128("entry"));
  CHECK_FALSE(cache.load(key, "so"));
  std::string payload("binary\0payload\xff", 15);
  cache.store(key, "so", bytes_of(payload));
  auto hit = cache.load(key, "so");
  REQUIRE(hit);
  CHECK(std::string(hit->begin(), hit->end()) == payload);
  CHECK(fs::exists(cache.entry_path(key, "so")));
  CHECK_FALSE(cache.load(key, "cubin"));  // kinds are separate

  fs::path path = cache.entry_path(key, "so");
  fs::resize_file(path, fs::file_size(path) - 3);
  CHECK_FALSE(cache.load(key, "so"));
  CHECK_FALSE(fs::exists(path));
  cache.store(key, "so", bytes_of(payload));
  CHECK(cache.load(key, "so"));

  {  // a flipped payload byte with an intact size
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('x');
  }
  CHECK_FALSE(cache.load(key, "so"));

  cache.store(key, "so", {});
  auto empty = cache.load(key, "so");
  REQUIRE(empty);
  CHECK(empty->empty());
  for (const auto& entry : fs::recursive_directory_iterator(dir.path))
    CHECK(entry.path().string().find(".tmp.") == std::string::npos);
}

TEST_CASE("disk cache: unusable directories and keys never throw") {
  TempDir dir;
  fs::path file = dir.path / "not_a_dir";
  std::ofstream(file) << "x";
  auto quiet = kiln::debug::set_log_sink([](kiln::debug::Channel, std::string_view) {});
  DiskCache broken(file);
  CHECK_NOTHROW(broken.store("abc", "so", bytes_of("data")));
  CHECK_FALSE(broken.load("abc", "so"));
  DiskCache cache(dir.path);
  CHECK_NOTHROW(cache.store("../escape", "so", bytes_of("data")));
  CHECK_FALSE(cache.load("../escape", "so"));
  DiskCache disabled;
  CHECK_NOTHROW(disabled.store("abc", "so", bytes_of("data")));
  CHECK_FALSE(disabled.load("abc", "so"));
  kiln::debug::set_log_sink(quiet);
}

TEST_CASE("disk cache: default directory precedence") {
  ScopedEnv kiln("KILN_CACHE_DIR", "/k"), xdg("XDG_CACHE_HOME", "/x"), home("HOME", "/h");
  CHECK(default_cache_dir() == fs::path("/k"));
  ::unsetenv("KILN_CACHE_DIR");
  CHECK(default_cache_dir() == fs::path("/x/kiln"));
  ::unsetenv("XDG_CACHE_HOME");
  CHECK(default_cache_dir() == fs::path("/h/.cache/kiln"));
  ::unsetenv("HOME");
  CHECK(default_cache_dir().empty());
}

TEST_CASE("compile-once cache: 8 threads x 1000 calls compile one key once") {
  CompileOnceCache<int> cache;
  std::atomic<int> compiles{0};
  std::latch start(8);
  std::vector<std::thread> threads;
  std::vector<const int*> seen(8);
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      for (int i = 0; i < 1000; ++i) {
        auto v = cache.get_or_compile(Digest{42, 0}, [&] {
          ++compiles;
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          return 7;
        });
        seen[std::size_t(t)] = v.get();
      }
    });
  for (auto& th : threads) th.join();
  CHECK(compiles == 1);
  CHECK(*seen[0] == 7);
  for (const int* p : seen) CHECK(p == seen[0]);
  CHECK(cache.size() == 1);
  CHECK(cache.find(Digest{42, 0}));
  CHECK_FALSE(cache.find(Digest{43, 0}));
}

TEST_CASE("compile-once cache: a failed compile reaches the waiters and can be retried") {
  CompileOnceCache<std::string, std::uint64_t> cache;
  std::atomic<int> compiles{0};
  std::latch compiling(1);
  std::thread first([&] {
    CHECK_THROWS_WITH(cache.get_or_compile(9,
                                           [&]() -> std::string {
                                             ++compiles;
                                             compiling.count_down();
                                             std::this_thread::sleep_for(std::chrono::milliseconds(300));
                                             throw kiln::error("boom");
                                           }),
                      "boom");
  });
  compiling.wait();
  std::vector<std::thread> waiters;
  std::atomic<int> failures{0};
  for (int t = 0; t < 7; ++t)
    waiters.emplace_back([&] {
      try {
        cache.get_or_compile(9, [&] {
          ++compiles;
          return std::string("unexpected");
        });
      } catch (const kiln::error& e) {
        failures += std::string(e.what()) == "boom";
      }
    });
  first.join();
  for (auto& th : waiters) th.join();
  CHECK(compiles == 1);
  CHECK(failures == 7);
  CHECK_FALSE(cache.find(9));
  auto v = cache.get_or_compile(9, [&] { return std::make_shared<std::string>("ok"); });
  CHECK(*v == "ok");
}

TEST_CASE("compile-once cache: asking for the key being compiled from its own compile is an error") {
  CompileOnceCache<int, std::uint64_t> cache;
  CHECK_THROWS_AS(cache.get_or_compile(1, [&] { return *cache.get_or_compile(1, [] { return 1; }); }), kiln::error);
  CHECK(*cache.get_or_compile(1, [] { return 2; }) == 2);
}

TEST_CASE("host compiler: compile, load and call a kernel") {
  CHECK(host_compiler_command().find("-ffp-contract=off") != std::string::npos);
  CHECK((host_compiler_command().find("-fopenmp") != std::string::npos) == host_openmp());
  std::string source = "extern \"C\" int kiln_add(int a, int b) { return a + b; }\n";
  auto so = compile_shared_object(source, "kiln_add");
  auto add = reinterpret_cast<int (*)(int, int)>(so->symbol("kiln_add"));
  CHECK(add(2, 3) == 5);
  CHECK_THROWS_AS(so->symbol("kiln_missing"), kiln::error);
  std::size_t before = host_compile_count();
  CHECK(compile_shared_object(source, "kiln_add") == so);  // one load per process
  CHECK(host_compile_count() == before);
}

TEST_CASE("host compiler: the second build of a source hits the disk cache") {
  TempDir dir;
  DiskCache cache(dir.path);
  std::string source = unique_comment() + "extern \"C\" int kiln_mul(int a, int b) { return a * b; }\n";
  std::size_t before = host_compile_count();
  std::vector<char> first = build_shared_object(source, "kiln_mul", cache);
  CHECK(host_compile_count() == before + 1);
  std::vector<char> second = build_shared_object(source, "kiln_mul", cache);
  CHECK(host_compile_count() == before + 1);
  CHECK(first == second);
  auto so = load_shared_object(second, "kiln_mul");
  CHECK(reinterpret_cast<int (*)(int, int)>(so->symbol("kiln_mul"))(6, 7) == 42);
}

TEST_CASE("host compiler: a syntax error is a compile_error with the log and the source") {
  TempDir dir;
  DiskCache cache(dir.path);
  std::string source = unique_comment() + "extern \"C\" int kiln_bad( { return }\n";
  SUBCASE("source kept in the temp directory") {
    ScopedEnv debug("KILN_DEBUG_DIR", nullptr);
    try {
      build_shared_object(source, "kiln_bad", cache);
      FAIL("expected a compile_error");
    } catch (const kiln::compile_error& e) {
      CHECK_FALSE(e.log.empty());
      CHECK(std::string(e.what()).find("host compiler: ") == 0);
      REQUIRE(fs::exists(e.source_path));
      std::error_code ec;
      fs::remove_all(fs::path(e.source_path).parent_path(), ec);
    }
  }
  SUBCASE("source dumped to KILN_DEBUG_DIR") {
    ScopedEnv debug("KILN_DEBUG_DIR", (dir.path / "dump").c_str());
    try {
      build_shared_object(source, "kiln_bad", cache);
      FAIL("expected a compile_error");
    } catch (const kiln::compile_error& e) {
      CHECK(fs::path(e.source_path).parent_path() == dir.path / "dump");
      CHECK(fs::exists(e.source_path));
    }
  }
}

TEST_CASE("log: channels, prefixes and sinks") {
  static std::string captured;
  captured.clear();
  auto old_sink = kiln::debug::set_log_sink([](kiln::debug::Channel, std::string_view text) { captured += text; });
  kiln::debug::set_log_channels("guards, cache");
  CHECK(kiln::debug::log_enabled(kiln::debug::Channel::guards));
  CHECK(kiln::debug::log_enabled(kiln::debug::Channel::cache));
  CHECK_FALSE(kiln::debug::log_enabled(kiln::debug::Channel::fusion));
  kiln::debug::log(kiln::debug::Channel::guards, "a\nb");
  CHECK(captured == "[kiln:guards] a\n[kiln:guards] b\n");
  kiln::debug::log_lazy(kiln::debug::Channel::fusion, []() -> std::string {
    FAIL("built a disabled message");
    return "";
  });
  kiln::debug::set_log_channels("all");
  CHECK(kiln::debug::log_enabled(kiln::debug::Channel::output_code));
  const char* env = std::getenv("KILN_LOGS");
  kiln::debug::set_log_channels(env ? env : "");
  kiln::debug::set_log_sink(old_sink);
}
