// The OpenMP team of the generated CPU kernels, for host work outside them (GEMM tiles).
//
// Generated kernels spread their programs over the cores with the host compiler's OpenMP (libgomp
// for GCC); the process that loads them need not be built with OpenMP at all. Work the runtime does
// itself, such as a GEMM cut into tiles, should run on that same team: a second pool of threads
// (std::thread, or a BLAS's own) competes with the kernels' parked workers for the same cores
// (benchmarks/NOTES.md items 62 and 134). So the OpenMP probe the host compiler builds once
// (host_compiler.hpp) also exports two functions, and the runtime calls them through pointers: the
// team's size (omp_get_max_threads: OMP_NUM_THREADS, else every core) and a parallel region that
// runs a function once on each of its threads.
#pragma once
#include <dlfcn.h>

#include <string_view>

namespace kiln::runtime {

// The probe, built with the kernels' compiler and flags plus -fopenmp and kept loaded for good.
inline constexpr std::string_view openmp_probe_source =
    "#include <omp.h>\n"
    "extern \"C\" int kiln_openmp_probe() {\n"
    "  int n = 0;\n"
    "#pragma omp parallel for reduction(+ : n)\n"
    "  for (int i = 0; i < 4; ++i) n += omp_get_num_threads() > 0;\n"
    "  return n;\n"
    "}\n"
    "extern \"C\" int kiln_openmp_team_size() { return omp_get_max_threads(); }\n"
    "extern \"C\" void kiln_openmp_team_run(int threads, void (*fn)(void*), void* context) {\n"
    "#pragma omp parallel num_threads(threads)\n"
    "  fn(context);\n"
    "}\n";

struct HostTeam {
  int (*size)() = nullptr;                                               // threads a region gets by default
  void (*run)(int threads, void (*fn)(void*), void* context) = nullptr;  // fn on each of `threads`
  explicit operator bool() const { return size && run; }
};

// The team's entry points in the loaded probe (empty when a symbol is missing).
inline HostTeam host_team_in(void* probe) {
  HostTeam team;
  if (!probe) return team;
  team.size = reinterpret_cast<int (*)()>(::dlsym(probe, "kiln_openmp_team_size"));
  team.run = reinterpret_cast<void (*)(int, void (*)(void*), void*)>(::dlsym(probe, "kiln_openmp_team_run"));
  return team;
}

}  // namespace kiln::runtime
