// The in-memory cache of compiled artifacts: each key is compiled exactly once per process even when
// many threads ask for it at the same time, and a hit costs one shared lock and one hash lookup.
#pragma once
#include <future>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "../../core/error.hpp"
#include "hash.hpp"

namespace kiln::runtime {

// V is the artifact (a loaded module, a compiled program). The first caller for a key runs the
// compile function without holding any lock; callers arriving meanwhile wait for it and receive its
// value or its exception. A failed compile leaves nothing behind, so a later call retries.
template <class V, class Key = Digest, class KeyHash = std::hash<Key>>
class CompileOnceCache {
 public:
  using Value = std::shared_ptr<const V>;

  // The artifact for key if it is already compiled, else nullptr; never blocks on a compile.
  Value find(const Key& key) const {
    std::shared_lock lock(mutex_);
    auto it = ready_.find(key);
    return it == ready_.end() ? nullptr : it->second;
  }

  // compile() returns a V, or a std::shared_ptr<V> / std::shared_ptr<const V> (not null).
  template <class Compile>
  Value get_or_compile(const Key& key, Compile&& compile) {
    if (Value hit = find(key)) return hit;
    return compile_or_wait(key, std::forward<Compile>(compile));
  }

  std::size_t size() const {
    std::shared_lock lock(mutex_);
    return ready_.size();
  }

  // Drops the finished artifacts (holders keep theirs alive); compiles in flight finish normally.
  void clear() {
    std::unique_lock lock(mutex_);
    ready_.clear();
  }

 private:
  struct InFlight {
    std::shared_future<Value> result;
    std::thread::id compiling_thread;
  };

  template <class Compile>
  Value compile_or_wait(const Key& key, Compile&& compile) {
    std::promise<Value> promise;
    std::shared_future<Value> other;
    {
      std::unique_lock lock(mutex_);
      if (auto it = ready_.find(key); it != ready_.end()) return it->second;
      if (auto it = pending_.find(key); it != pending_.end()) {
        // Waiting on our own compile would never return.
        if (it->second.compiling_thread == std::this_thread::get_id())
          throw kiln::error("CompileOnceCache: the compile of a key asked for the same key again");
        other = it->second.result;
      } else {
        pending_.emplace(key, InFlight{promise.get_future().share(), std::this_thread::get_id()});
      }
    }
    if (other.valid()) return other.get();
    return run_compile(key, promise, std::forward<Compile>(compile));
  }

  template <class Compile>
  Value run_compile(const Key& key, std::promise<Value>& promise, Compile&& compile) {
    try {
      Value value = to_value(std::forward<Compile>(compile)());
      if (!value) throw kiln::error("CompileOnceCache: the compile function returned a null pointer");
      {
        std::unique_lock lock(mutex_);
        ready_.emplace(key, value);
        pending_.erase(key);
      }
      promise.set_value(value);
      return value;
    } catch (...) {
      {
        std::unique_lock lock(mutex_);
        pending_.erase(key);
      }
      promise.set_exception(std::current_exception());
      throw;
    }
  }

  template <class R>
  static Value to_value(R&& result) {
    if constexpr (std::is_convertible_v<R&&, Value>)
      return Value(std::forward<R>(result));
    else
      return std::make_shared<const V>(std::forward<R>(result));
  }

  mutable std::shared_mutex mutex_;
  std::unordered_map<Key, Value, KeyHash> ready_;
  std::unordered_map<Key, InFlight, KeyHash> pending_;
};

}  // namespace kiln::runtime
