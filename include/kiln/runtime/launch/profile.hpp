// KILN_PROFILE=1: where a program's time goes, per kernel. Each kernel and extern step of every
// program run is timed — CUDA events around it on the program's stream, the host clock on the CPU —
// except while a CUDA graph is being captured, and the times are summed per kernel under its name
// without the program index and with its sizes (kiln_per_fused_add_layer_norm 8192 x 768: rows x
// row length; a pointwise kernel's elements; a matmul under its operand shapes). At exit, stderr gets the table: total milliseconds, share, calls, mean. A profiled run
// synchronises once per program (it reads its events back): use it to find what to fix, and time
// with the profiler off.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "../../core/config.hpp"
#include "../../core/driver.hpp"

namespace kiln::runtime::profile {

inline bool enabled() {
  static const bool on = [] {
    const char* v = config::env("KILN_PROFILE");
    return v && *v && std::string(v) != "0";
  }();
  return on;
}

struct Totals {
  double ms = 0;
  long calls = 0;
};

// The process-wide table, printed when the process exits.
class Table {
 public:
  static Table& instance() {
    static Table t;
    return t;
  }
  void add(const std::string& name, double ms) {
    std::lock_guard lock(mu_);
    auto& t = totals_[name];
    t.ms += ms;
    ++t.calls;
  }
  // Forgets what was measured so far (after warm-up steps, whose first calls load modules).
  void reset() {
    std::lock_guard lock(mu_);
    totals_.clear();
  }
  std::string str() const {
    std::lock_guard lock(mu_);
    std::vector<std::pair<std::string, Totals>> rows(totals_.begin(), totals_.end());
    std::sort(rows.begin(), rows.end(), [](auto& a, auto& b) { return a.second.ms > b.second.ms; });
    double all = 0;
    for (auto& r : rows) all += r.second.ms;
    std::string s = "kiln profile (KILN_PROFILE): " + std::to_string(rows.size()) + " kernels, " + fmt(all) +
                    " ms in all\n      ms  share    calls    mean us  kernel\n";
    for (auto& [name, t] : rows) {
      char line[96];
      std::snprintf(line, sizeof line, "%8.2f %5.1f%% %8ld %10.1f  ", t.ms, all > 0 ? 100 * t.ms / all : 0.0, t.calls,
                    1000 * t.ms / static_cast<double>(t.calls));
      s += line + name + "\n";
    }
    return s;
  }
  ~Table() {
    if (!totals_.empty()) std::fputs(str().c_str(), stderr);
  }

 private:
  static std::string fmt(double ms) {
    char b[32];
    std::snprintf(b, sizeof b, "%.2f", ms);
    return b;
  }
  mutable std::mutex mu_;
  std::map<std::string, Totals> totals_;
};

// The steps of one program run: started and stopped around each kernel, settled at the end.
class Run {
 public:
  Run(bool cuda, CUstream stream) : cuda_(cuda), stream_(stream) {
    active_ = enabled() && !(cuda && stream && driver::is_capturing(stream));
  }
  bool active() const { return active_; }

  void start(std::string name) {
    if (!active_) return;
    Step s{std::move(name)};
    if (cuda_) {
      s.begin = event();
      driver::check(driver::api().event_record(s.begin, stream_), "cuEventRecord");
    } else {
      s.t0 = std::chrono::steady_clock::now();
    }
    steps_.push_back(std::move(s));
  }
  void stop() {
    if (!active_ || steps_.empty()) return;
    Step& s = steps_.back();
    if (cuda_) {
      s.end = event();
      driver::check(driver::api().event_record(s.end, stream_), "cuEventRecord");
    } else {
      s.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s.t0).count();
    }
  }
  ~Run() {
    if (!active_) return;
    for (auto& s : steps_) {
      if (cuda_ && s.begin && s.end) {
        float ms = 0;
        driver::api().event_synchronize(s.end);
        driver::api().event_elapsed_time(&ms, s.begin, s.end);
        s.ms = ms;
      }
      if (s.begin) driver::api().event_destroy(s.begin);
      if (s.end) driver::api().event_destroy(s.end);
      Table::instance().add(s.name, s.ms);
    }
  }
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

 private:
  struct Step {
    std::string name;
    CUevent begin = nullptr, end = nullptr;
    std::chrono::steady_clock::time_point t0{};
    double ms = 0;
  };
  static CUevent event() {
    CUevent e = nullptr;
    driver::check(driver::api().event_create(&e, CU_EVENT_DEFAULT), "cuEventCreate");
    return e;
  }
  bool cuda_;
  CUstream stream_;
  bool active_ = false;
  std::vector<Step> steps_;
};

}  // namespace kiln::runtime::profile
