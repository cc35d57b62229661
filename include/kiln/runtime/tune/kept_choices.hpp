// KeptChoices: what autotuning chose for each problem, kept for the process. The extern steps that
// time their candidates at a problem's first call (the GEMM template against cuBLASLt, Hopper's
// attention forwards, its backwards' copies) look their problem up here first; a map's nodes never
// move, so a found choice's address stays valid. Never freed (the steps keep one as a static).
#pragma once
#include <map>
#include <mutex>
#include <utility>

namespace kiln::runtime {

template <class Key, class Value>
class KeptChoices {
 public:
  // The choice kept for key, or nullptr.
  const Value* find(const Key& key) {
    std::lock_guard lock(mutex_);
    const auto it = chosen_.find(key);
    return it == chosen_.end() ? nullptr : &it->second;
  }
  // Keeps value for key (the first one kept stays, where two threads tuned at once) and returns it.
  const Value& keep(Key key, Value value) {
    std::lock_guard lock(mutex_);
    return chosen_.emplace(std::move(key), std::move(value)).first->second;
  }

 private:
  std::mutex mutex_;
  std::map<Key, Value> chosen_;
};

}  // namespace kiln::runtime
