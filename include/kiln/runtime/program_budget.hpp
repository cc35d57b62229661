// The process-wide budget of eager programs. Each expression type evaluated eagerly
// (`k::Tensor y = expr;`) has a program cache of its own; together they hold at most `capacity`
// compiled programs, the least recently used evicted first, so a program that evaluates thousands
// of different expressions, shapes and dtypes runs in bounded memory and never fails for variety.
// KILN_EAGER_PROGRAMS sets the capacity (default 512); runtime::set_eager_capacity changes it.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>
#include "../core/config.hpp"

namespace kiln::runtime {

// The recency clock of cached programs: a hit stamps its entry with the next tick.
inline std::uint64_t lru_tick() {
  static std::atomic<std::uint64_t> clock{0};
  return clock.fetch_add(1, std::memory_order_relaxed) + 1;
}

// A cache that can give up its least recently used program. Both calls only try the cache's
// lock: eviction never waits on a cache another thread is using (so it cannot deadlock).
struct Evictable {
  virtual ~Evictable() = default;
  virtual bool oldest_tick(std::uint64_t& tick) const = 0;  // false when empty or busy
  virtual bool evict_oldest() = 0;                          // false when busy
};

class ProgramBudget {
 public:
  static ProgramBudget& eager() {
    static ProgramBudget b(initial_capacity());
    return b;
  }

  void add(Evictable* c) {
    std::lock_guard lock(mu_);
    caches_.push_back(c);
  }
  void remove(Evictable* c) {
    std::lock_guard lock(mu_);
    caches_.erase(std::remove(caches_.begin(), caches_.end(), c), caches_.end());
  }
  void added() { entries_.fetch_add(1, std::memory_order_relaxed); }
  void removed() { entries_.fetch_sub(1, std::memory_order_relaxed); }
  std::int64_t entries() const { return entries_.load(std::memory_order_relaxed); }
  std::int64_t capacity() const { return capacity_.load(std::memory_order_relaxed); }
  void set_capacity(std::int64_t n) {
    capacity_.store(std::max<std::int64_t>(1, n), std::memory_order_relaxed);
    trim();
  }

  // Evicts the least recently used programs across every cache until the budget holds (caches
  // busy right now are passed over; a later miss trims them).
  void trim() {
    std::lock_guard lock(mu_);
    for (int guard = 0; entries() > capacity() && guard < 1024; ++guard) {
      Evictable* victim = nullptr;
      std::uint64_t best = ~std::uint64_t{0};
      for (Evictable* c : caches_) {
        std::uint64_t t;
        if (c->oldest_tick(t) && t < best) best = t, victim = c;
      }
      if (!victim || !victim->evict_oldest()) break;
    }
  }

 private:
  explicit ProgramBudget(std::int64_t capacity) : capacity_(capacity) {}
  static std::int64_t initial_capacity() {
    const char* v = kiln::config::env("KILN_EAGER_PROGRAMS");
    char* end = nullptr;
    long long n = v ? std::strtoll(v, &end, 10) : 0;
    if (v && (end == v || *end || n < 1)) {
      std::fprintf(stderr, "[kiln] KILN_EAGER_PROGRAMS=%s is not a positive count; using 512\n", v);
      n = 0;
    }
    return n > 0 ? n : 512;
  }

  std::mutex mu_;
  std::vector<Evictable*> caches_;
  std::atomic<std::int64_t> entries_{0};
  std::atomic<std::int64_t> capacity_;
};

// Eager programs cached now, across every expression type, and the most there may be.
inline std::int64_t eager_programs() { return ProgramBudget::eager().entries(); }
inline std::int64_t eager_capacity() { return ProgramBudget::eager().capacity(); }
inline void set_eager_capacity(std::int64_t n) { ProgramBudget::eager().set_capacity(n); }

}  // namespace kiln::runtime
