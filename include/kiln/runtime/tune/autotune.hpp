// options.autotune (the max-autotune mode): each generated CUDA kernel is written under a short
// list of candidate tunings (runtime choices the rules otherwise make from sizes and dtypes: block
// shapes, where row-invariant loads live, how loads reach memory, the row grid); the candidates are
// compiled in parallel, one translation unit per candidate index; the first call times every
// candidate of every kernel on its real arguments, then a second round the winner's neighbours (the
// winner with each single change of the first list on top: a coordinate descent step), and keeps
// the fastest. GEMMs time cuBLASLt's best few algorithms the same way (runtime/extern/cuda_matmul.hpp).
// Hopper's fused attention forward times its producer kernels the same way, once a process
// (runtime/extern/attention.hpp's tuned_forward).
// The choice is kept in the disk cache, so a later process compiles only the winners and times
// nothing. CPU programs are not tuned: they run the rules' choices.
#pragma once
#include <limits>
#include <sstream>
#include <thread>

#include "../launch/program.hpp"

namespace kiln::runtime {

// The candidates written for a kernel of this kind, the rules' own choice first. Those giving the
// same source as an earlier one are dropped when written (add_candidate).
inline std::vector<codegen::Tuning> tuning_candidates(schedule::Kind kind, bool column) {
  using T = codegen::Tuning;
  if (kind == schedule::Kind::poi)
    return {T{},
            T{.poi_vectors = 1},
            T{.poi_vectors = 2},
            T{.poi_vectors = 4},
            T{.poi_threads = 256, .poi_vectors = 1},
            T{.poi_threads = 256, .poi_vectors = 2},
            T{.poi_threads = 512, .poi_vectors = 1},
            T{.loads = 0},
            T{.loads = 1},
            T{.poi_vectors = 4, .loads = 1}};
  if (column)  // the thread-a-column form (0) and column blocks (2), whichever the rules chose
    return {T{},
            T{.row_unroll = 2},
            T{.row_unroll = 8},
            T{.column_lanes = 0},
            T{.row_unroll = 8, .column_lanes = 0},
            T{.column_lanes = 2}};
  return {T{},
          T{.row_elems = 8},
          T{.row_elems = 16},
          T{.row_elems = 32},
          T{.row_elems = 64},
          T{.row_block = 128},
          T{.row_block = 256},
          T{.hoist = 0},
          T{.hoist = 1},
          T{.loads = 0},
          T{.loads = 1},
          T{.row_unroll = 1},
          T{.row_unroll = 4},
          T{.partial_rows = 1},  // row kernels with column partials only (the others' sources repeat)
          T{.partial_rows = 2},
          T{.partial_rows = 8}};
}

// Row grids tried for each compiled row candidate besides the rules' own (a launch choice: no
// recompile), as multiples of the blocks the device holds at once.
inline constexpr int tuning_waves[] = {16, 64};

namespace tune_detail {

// Appends kernel k's candidate under tuning t unless an equal source was tried already.
template <class Write>
void add_candidate(std::vector<CompiledKernel>& list, const std::vector<std::string>& tried, Write& write, int k,
                   const codegen::Tuning& t) {
  CompiledKernel c;
  std::optional<codegen::KernelSource> src = write(k, t);
  if (!src) return;  // this tuning cannot hold the row that the kernel's column partials need
  c.src = std::move(*src);
  for (const auto& s : tried)
    if (s == c.src.source) return;
  for (const auto& d : list)
    if (d.src.source == c.src.source) return;
  c.variant = static_cast<int>(list.size());
  list.push_back(std::move(c));
}

// The disk cache's name for a program's choice: every first-round candidate's source and the device.
inline std::string choice_key(const Program& p) {
  Hasher h;
  // 3: Tuning::fields (the stored choice's format) gained partial_rows.
  h.update("kiln autotune 3").update(driver::device_name(p.device.index)).update(driver::arch(p.device.index));
  for (const auto& list : p.candidates)
    for (const auto& c : list) h.update(c.src.source).update(c.src.tuning.str());
  return hex(h.digest());
}

}  // namespace tune_detail

// Writes every first-round candidate of every generated kernel of a planned CUDA program (cheap:
// no compile). `write(k, tuning)` writes kernel k under a tuning; p.kernels hold the rules' choices.
template <class Write>
void plan_candidates(Program& p, Write&& write) {
  p.autotune = true;
  p.candidates.assign(p.kernels.size(), {});
  for (std::size_t k = 0; k < p.kernels.size(); ++k) {
    if (p.kernels[k].extern_node >= 0) continue;
    auto& list = p.candidates[k];
    list.push_back(p.kernels[k]);
    for (const auto& t : tuning_candidates(p.sched.kernels[k].kind, p.kernels[k].src.column))
      tune_detail::add_candidate(list, {}, write, static_cast<int>(k), t);
  }
}

// A choice stored by an earlier process for these candidates on this device: each kernel is
// written under its winning tuning (before compile_program) and the candidates are dropped.
template <class Write>
bool apply_stored_choice(Program& p, Write&& write) {
  bool any = false;
  for (const auto& c : p.candidates) any = any || c.size() > 1;
  if (!any) {
    p.candidates.clear();
    return true;
  }
  p.tuning_key = tune_detail::choice_key(p);
  auto stored = default_disk_cache().load(p.tuning_key, "tune");
  if (!stored) return false;
  std::istringstream in(std::string(stored->begin(), stored->end()));
  std::vector<std::pair<std::size_t, codegen::KernelSource>> picks;
  for (std::size_t k; in >> k;) {
    codegen::Tuning t;
    for (auto f : codegen::Tuning::fields) in >> t.*f;
    if (!in || k >= p.kernels.size() || p.kernels[k].extern_node >= 0) return false;
    std::optional<codegen::KernelSource> src = write(static_cast<int>(k), t);
    if (!src) return false;  // written under other knobs: tune again
    picks.emplace_back(k, std::move(*src));
  }
  for (auto& [k, src] : picks) p.kernels[k].src = std::move(src);
  p.candidates.clear();
  debug::log_lazy(debug::Channel::autotune, [&] { return "using the stored choice " + p.tuning_key; });
  return true;
}

// Compiles the candidates; each list's first entry is compiled already (p.kernels[k]). Translation
// unit i holds every kernel's candidate i, compiled on its own thread; then each row candidate gets
// one entry more for each grid of tuning_waves that differs from its own.
inline void compile_candidates(Program& p, const std::string& name) {
  std::size_t units = 0;
  for (const auto& list : p.candidates) units = std::max(units, list.size());
  const std::string arch = driver::arch(p.device.index);
  std::vector<std::vector<char>> cubins(units);
  std::vector<std::exception_ptr> failures(units);
  std::vector<std::thread> threads;
  for (std::size_t i = 1; i < units; ++i) {
    Program unit;  // only its kernels: what the translation unit is made of
    for (const auto& list : p.candidates)
      if (i < list.size()) unit.kernels.push_back(list[i]);
    threads.emplace_back([&cubins, &failures, &arch, name, i, tu = cuda_translation_unit(unit, program_body(unit))] {
      try {
        cubins[i] = cached_cubin(tu, name + "_tune" + std::to_string(i), arch);
      } catch (...) {
        failures[i] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& f : failures)
    if (f) std::rethrow_exception(f);
  const std::size_t base = p.candidate_modules.size();
  for (std::size_t i = 1; i < units; ++i)
    p.candidate_modules.push_back(std::make_shared<Module>(cubins[i], p.device.index));
  for (std::size_t k = 0; k < p.candidates.size(); ++k) {
    auto& list = p.candidates[k];
    if (list.empty()) continue;
    list[0].cuda = p.kernels[k].cuda;
    for (std::size_t i = 1; i < list.size(); ++i)
      list[i].cuda = p.candidate_modules[base + i - 1]->function(list[i].src.name.c_str());
    if (list[0].src.kind == schedule::Kind::poi) continue;
    std::vector<CompiledKernel> gridded;
    for (auto& c : list) {
      c.grid_limit = row_grid_limit(c.cuda, c.src, p.device.index);
      gridded.push_back(c);
      for (int waves : tuning_waves) {
        CompiledKernel g = c;
        g.src.tuning.waves = waves;
        g.grid_limit = row_grid_limit(c.cuda, g.src, p.device.index);
        if (g.grid_limit != c.grid_limit) gridded.push_back(std::move(g));
      }
    }
    list = std::move(gridded);
  }
}

// The probe of a tuning run: times each candidate of each kernel where the run would launch it.
class Tuner final : public KernelProbe {
 public:
  explicit Tuner(const Program& p) : p_(p), best_(p.candidates.size(), 0), times_(p.candidates.size()) {}

  void launch(std::size_t k, BindParams bind, const void* state, Bindings sizes, CUstream stream) override {
    const auto& list = p_.candidates[k];
    if (list.size() <= 1) {  // nothing to choose: launched as the run would
      const CompiledKernel& c = list.empty() ? p_.kernels[k] : list[0];
      launch_compiled(c, detail::num_programs(c, sizes), bind(state, c.src), stream);
      return;
    }
    double best = std::numeric_limits<double>::infinity();
    for (std::size_t i = 0; i < list.size(); ++i) {
      const CompiledKernel& c = list[i];
      void** slots = bind(state, c.src);
      std::int64_t nprog = detail::num_programs(c, sizes);
      double ms = time_calls_ms([&] { launch_compiled(c, nprog, slots, stream); }, stream);
      times_[k].push_back(ms);
      if (ms < best) best = ms, best_[k] = i;
    }
    // The incumbent (the rules' choice, then the first round's winner) stands unless another
    // candidate beats it by 1% (timing noise).
    if (best > 0.99 * times_[k][0]) best_[k] = 0;
  }

  std::size_t best(std::size_t k) const { return best_[k]; }
  const std::vector<double>& times(std::size_t k) const { return times_[k]; }

 private:
  const Program& p_;
  std::vector<std::size_t> best_;
  std::vector<std::vector<double>> times_;
};

// The arguments a program updates in place (k::assign targets), copied before a tuning run and
// written back after each round (and when a round fails).
class SavedArguments {
 public:
  SavedArguments(const Program& p, const Tensor* const* args, CUstream stream) : stream_(stream) {
    for (std::size_t o = 0; o < p.graph.outputs.size(); ++o) {
      int slot = o < p.graph.output_into.size() ? p.graph.output_into[o] : -1;
      if (slot < 0) continue;
      const Tensor& a = *args[slot];
      Tensor copy = Tensor::empty(a.shape(), a.dtype(), a.device(), stream);
      driver::copy_async(copy.data_ptr(), a.data_ptr(), a.nbytes(), stream);
      saved_.emplace_back(a, std::move(copy));
    }
  }
  SavedArguments(const SavedArguments&) = delete;
  SavedArguments& operator=(const SavedArguments&) = delete;
  void restore() {
    for (auto& [a, copy] : saved_) driver::copy_async(a.data_ptr(), copy.data_ptr(), a.nbytes(), stream_);
    driver::synchronize(stream_);
  }

 private:
  CUstream stream_;
  std::vector<std::pair<Tensor, Tensor>> saved_;
};

// The first call of an autotuned program: runs it with the probe for the first candidates, then
// for the winners' neighbours (each run on the arguments as the call passed them); keeps each
// kernel's fastest and stores the choice on disk. Synchronises the stream (it times on it); the
// call's own run follows. Custom ops in the program run once per round. If tuning fails (a
// candidate that does not compile, say), the program keeps the kernels it had and the error goes
// to the autotune log.
inline void tune_program(Program& p, const Tensor* const* args, const double* scalars, ShapeFn shape_of,
                         CUstream stream) {
  if (p.candidates.empty()) return;
  SavedArguments saved(p, args, stream);
  auto arg = [&](int slot) -> const Tensor& { return *args[slot]; };
  auto write = [&](int k, const codegen::Tuning& t) {
    return write_kernel(p.graph, p.sched, p.env, k, codegen::Target::cuda, arg, p.tuning.merged(t));
  };
  std::vector<double> rules_ms(p.candidates.size(), 0), best_ms(p.candidates.size(), 0);
  std::vector<std::size_t> tried(p.candidates.size(), 0);
  std::vector<std::vector<std::string>> seen(p.candidates.size());
  try {
    for (int round = 0; round < 2; ++round) {
      Tuner tuner(p);
      std::vector<Tensor> outputs(p.graph.outputs.size());
      p.run(args, scalars, outputs.data(), shape_of, stream, nullptr, &tuner);
      saved.restore();
      for (std::size_t k = 0; k < p.candidates.size(); ++k) {
        const auto& list = p.candidates[k];
        if (list.empty() || tuner.times(k).empty()) continue;
        if (round == 0) rules_ms[k] = tuner.times(k)[0];
        best_ms[k] = tuner.times(k)[tuner.best(k)];
        tried[k] += list.size();
        for (const auto& c : list) seen[k].push_back(c.src.source);
        p.kernels[k] = list[tuner.best(k)];
      }
      if (round == 1) break;
      // The second round: each winner, then the winner with each first-round change on top.
      bool more = false;
      for (std::size_t k = 0; k < p.candidates.size(); ++k) {
        auto& list = p.candidates[k];
        if (list.size() <= 1) {
          list.clear();
          continue;
        }
        const codegen::Tuning won = p.kernels[k].src.tuning;
        list.assign(1, p.kernels[k]);
        list[0].variant = 0;
        for (const auto& t : tuning_candidates(p.sched.kernels[k].kind, p.kernels[k].src.column))
          if (!(won.merged(t) == won))
            tune_detail::add_candidate(list, seen[k], write, static_cast<int>(k), won.merged(t));
        more = more || list.size() > 1;
      }
      if (!more) break;
      compile_candidates(p, p.kernels.front().src.name);
    }
  } catch (const std::exception& e) {
    saved.restore();
    p.candidates.clear();  // p.kernels hold compiled kernels: the rules' choices or a round's winners
    p.source = program_body(p);
    debug::log(debug::Channel::autotune, std::string("tuning stopped, the kernels so far kept: ") + e.what());
    return;
  }
  std::string choice, report;
  for (std::size_t k = 0; k < p.kernels.size(); ++k) {
    if (p.kernels[k].extern_node >= 0 || tried[k] == 0) continue;
    const codegen::Tuning& t = p.kernels[k].src.tuning;
    choice += std::to_string(k);
    for (auto f : codegen::Tuning::fields) {
      choice += ' ';  // appended apart: g++ 12's -Wrestrict misreads `s += " " + std::to_string(v)`
      choice += std::to_string(t.*f);
    }
    choice += "\n";
    if (debug::log_enabled(debug::Channel::autotune)) {
      std::ostringstream line;
      line << "  " << p.kernels[k].src.name << ": " << tried[k] << " candidates in two rounds; the rules' choice "
           << rules_ms[k] << " ms, fastest " << best_ms[k] << " ms (" << t.str() << ")\n";
      report += line.str();
    }
  }
  p.candidates.clear();
  p.source = program_body(p);
  if (!p.tuning_key.empty())
    default_disk_cache().store(p.tuning_key, "tune", std::span<const char>(choice.data(), choice.size()));
  if (debug::log_enabled(debug::Channel::autotune)) debug::log(debug::Channel::autotune, "tuned:\n" + report);
}

}  // namespace kiln::runtime
