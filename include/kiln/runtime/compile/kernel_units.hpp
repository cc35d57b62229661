// A program's generated kernels as compile units: each distinct kernel is one translation unit,
// under its name without the program's kernel index, so that kernels differing only by their
// position (the same residual block in 12 layers, forward and backward) are one source, compiled
// once and cached once (in memory and on disk, by the unit's text); a program's units compile in
// parallel, on the CPU (host compiler processes) as on the GPU (NVRTC).
#pragma once
#include <algorithm>
#include <atomic>
#include <cctype>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "../../codegen/kernel_writer.hpp"
#include "../../codegen/prelude.hpp"
#include "../../ir/sym.hpp"
#include "../launch/cuda_module.hpp"
#include "hash.hpp"

namespace kiln::runtime {

// A kernel's name without its index in the program: kiln_per_fused_add_layer_norm_7 ->
// kiln_per_fused_add_layer_norm (what profilers show; one name for one source).
inline std::string unit_name(const std::string& kernel) {
  std::size_t end = kernel.size();
  while (end > 0 && std::isdigit(static_cast<unsigned char>(kernel[end - 1]))) --end;
  if (end == kernel.size() || end < 2 || kernel[end - 1] != '_') return kernel;
  return kernel.substr(0, end - 1);
}

// A kernel's source under its unit name.
inline std::string unit_source(const codegen::KernelSource& k) {
  const std::string unit = unit_name(k.name);
  std::string s = k.source;
  for (std::size_t at = s.find(k.name); at != std::string::npos; at = s.find(k.name, at + unit.size()))
    s.replace(at, k.name.size(), unit);
  return s;
}

// The CUDA translation unit of some kernel bodies: the prelude (with the 16-bit float types only
// when a kernel moves f16/bf16) and the bodies.
// prelude_loads (a Tuning's, >= 0): how 16-byte loads reach memory (the prelude's KILN_LOADS).
inline std::string cuda_unit(bool half, const std::string& body, int prelude_loads = -1) {
  const int loads = prelude_loads;
  return std::string(half ? "#define KILN_HALF 1\n" : "") +
         (loads >= 0 ? "#define KILN_LOADS " + std::to_string(loads) + "\n" : "") + std::string(codegen::prelude) +
         body;
}
// Whether a kernel needs the 16-bit float types: it moves f16/bf16 or rounds to them inside (a cast
// to bf16 between f32 loads and stores). Without KILN_HALF the prelude's stand-ins give zeros, so
// this errs towards including them: any mention of the type names in the source.
inline bool moves_half(const codegen::KernelSource& k) {
  return k.source.find("f16") != std::string::npos ||
         std::any_of(k.params.begin(), k.params.end(),
                     [](const codegen::Param& p) { return p.dt == kiln::dtype::f16 || p.dt == kiln::dtype::bf16; });
}

// The CPU entry of a kernel named `name`: runs its programs, in parallel under OpenMP.
inline std::string cpu_trampoline(const codegen::KernelSource& k, const std::string& name) {
  std::string s = "extern \"C\" void " + name +
                  "_cpu(void** a, i64 nprog) {\n#pragma omp parallel for schedule(static) if (nprog > 1)\n  for (i64 "
                  "pid = 0; pid < nprog; ++pid)\n    " +
                  name + "(";
  for (std::size_t i = 0; i < k.params.size(); ++i) {
    const auto& p = k.params[i];
    std::string type = p.kind == codegen::Param::in_ptr    ? "const " + codegen::detail::storage_c_type(p.dt) + "*"
                       : p.kind == codegen::Param::out_ptr ? codegen::detail::storage_c_type(p.dt) + "*"
                       : p.kind == codegen::Param::scalar  ? "double"
                                                           : "i64";
    s += "*(" + type + "*)a[" + std::to_string(i) + "], ";
  }
  return s + "pid);\n}\n";
}

// First in a host row kernel's unit, so that every function in it (prelude, kernel, entry) is built
// with the same options and still inlines. GCC's loop if-conversion miscompiled a held row at -O3
// -march=native (g++ 12.2, AVX2): a select on a broadcast comparison, `where(b <= c, w, x - sum(x))`
// over rows of 3072 i64 values, wrote zeros in 15 of every 16 lanes (NOTES item 102; test_fusion
// checks the values). Row kernels do their arithmetic on whole tiles (straight-line code, which the
// SLP vectoriser takes) and lose nothing without the pass; pointwise kernels keep it: their loop
// over tiles is what the loop vectoriser if-converts (relu's select, NOTES item 135).
inline constexpr std::string_view host_row_options =
    "#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)\n"
    "#pragma GCC optimize(\"no-tree-loop-if-convert\")\n"
    "#endif\n";

// The translation unit of one kernel for a device kind, and the name of its entry in it.
struct KernelUnit {
  std::string name;  // unit_name of the kernel
  std::string source;
};
inline KernelUnit kernel_unit(const codegen::KernelSource& k, bool cpu) {
  KernelUnit u{unit_name(k.name), ""};
  std::string body = std::string(sym_c_helpers) + "\n\n" + unit_source(k);
  // Host row kernels do their f32/f64 arithmetic on whole vectors (prelude_cpu_tiles.hpp); pointwise
  // ones leave it to the loop vectoriser, which takes their loop across tiles (NOTES 70).
  const bool rows = k.kind != schedule::Kind::poi;
  u.source = cpu ? (rows ? std::string(host_row_options) + "#define KILN_VECTOR_ARITH 1\n" : std::string()) +
                       std::string(codegen::prelude) + body +
                       cpu_trampoline(k, u.name)
                 : cuda_unit(moves_half(k), body, k.tuning.prelude_loads);
  return u;
}

// Runs job(i) for i in [0, n) on up to the machine's hardware threads (the calling thread
// included); rethrows the first failure once all have finished.
template <class Job>
void parallel_for(std::size_t n, Job&& job) {
  std::size_t workers = std::min<std::size_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<std::size_t> next{0};
  std::vector<std::exception_ptr> failures(n);
  auto work = [&] {
    for (std::size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        job(i);
      } catch (...) {
        failures[i] = std::current_exception();
      }
    }
  };
  std::vector<std::thread> threads;
  for (std::size_t w = 1; w < workers; ++w) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  for (auto& f : failures)
    if (f) std::rethrow_exception(f);
}

// Loaded modules by CUBIN and device, while some program holds them: programs sharing a kernel
// share its module.
inline std::shared_ptr<const Module> shared_module(const std::vector<char>& cubin, int device) {
  static std::mutex mu;
  static auto* loaded = new std::unordered_map<std::string, std::weak_ptr<const Module>>();  // leaked: see SharedObject
  Hasher h;
  h.update(std::string_view(cubin.data(), cubin.size())).update(std::to_string(device));
  const std::string key = hex(h.digest());
  std::lock_guard lock(mu);
  if (auto it = loaded->find(key); it != loaded->end())
    if (auto m = it->second.lock()) return m;
  auto m = std::make_shared<const Module>(cubin, device);
  (*loaded)[key] = m;
  if (loaded->size() > 4096)  // forget the modules no program holds any more
    std::erase_if(*loaded, [](const auto& kv) { return kv.second.expired(); });
  return m;
}

}  // namespace kiln::runtime
