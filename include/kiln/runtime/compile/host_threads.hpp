// How long idle host threads spin, set once before kiln loads its first kernel library or BLAS.
//
// kiln's CPU kernels run on OpenMP (libgomp); a BLAS may bring its own pthread pool (Debian's default
// OpenBLAS does). A GEMM's epilogue kernel follows the GEMM at once, so each pool's idle workers spin
// while the other pool wants the same cores: by default OpenBLAS's workers spin about 2^28 cycles
// after a GEMM and libgomp's 300,000 pauses after a parallel region (milliseconds on CPUs whose pause
// is slow). Measured on a 16-core Xeon with the pthread OpenBLAS, `gelu(a @ b + bias)` 1024^3 f32
// took 12.0 ms against 1.9 ms for the GEMM alone, and an MLP block's forward and backward 131 ms; with
// both spins short, 2.5 ms and 30 ms (benchmarks/NOTES.md item 62).
//
// Since then kiln runs a pthread OpenBLAS one thread a call, its calls on the kernels' team
// (extern/cpu_blas.hpp), so that pool no longer runs. Still, where the user has not chosen:
// OPENBLAS_THREAD_TIMEOUT=4 (OpenBLAS's workers, started when it loads, sleep 2^4 cycles after any
// work; its OpenMP build ignores it), and GOMP_SPINCOUNT=10000 (libgomp's workers sleep after
// 10,000 pauses instead of 300,000) only where the BLAS kiln loads may run a pool of its own:
// KILN_BLAS names a library other than OpenBLAS (BLIS or MKL, which kiln calls whole). The short
// libgomp spin has a price where no second pool runs: a lone pointwise kernel called back to back
// on 16 threads wakes sleeping workers (relu 2^24: 0.47 -> 0.72 ms), hence the condition. Unset,
// kiln loads OpenBLAS where one is installed; a machine with only BLIS or MKL keeps libgomp's spin.
// OMP_WAIT_POLICY, when set, chooses libgomp's spin itself. Both libraries read these once, when
// loaded: a process that loaded libgomp or OpenBLAS before kiln keeps its own settings.
// KILN_HOST_SPIN=keep leaves the environment alone.
#pragma once
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "../../core/config.hpp"

namespace kiln::runtime {

// OpenBLAS built on OpenMP where distributions keep it apart (Debian and Ubuntu's multiarch
// directory; Fedora names it libopenblaso): the BLAS kiln tries first (extern/cpu_blas.hpp).
inline constexpr const char* openmp_blas_candidates[] = {
#if defined(__x86_64__)
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0",
#elif defined(__aarch64__)
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libopenblas.so.0",
#endif
    "libopenblaso.so.0"};

// Whether host GEMMs may run on a thread pool of their own besides the kernels' libgomp team.
inline bool blas_may_bring_a_pool() {
  const char* choice = kiln::config::env("KILN_BLAS");
  return choice && std::strcmp(choice, "none") != 0 && !std::strstr(choice, "openblas");
}

inline void settle_host_threads() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* keep = kiln::config::env("KILN_HOST_SPIN");
    if (keep && std::strcmp(keep, "keep") == 0) return;
    if (!kiln::config::env("OPENBLAS_THREAD_TIMEOUT")) ::setenv("OPENBLAS_THREAD_TIMEOUT", "4", 1);
    if (!kiln::config::env("GOMP_SPINCOUNT") && !kiln::config::env("OMP_WAIT_POLICY") && blas_may_bring_a_pool())
      ::setenv("GOMP_SPINCOUNT", "10000", 1);
  });
}

}  // namespace kiln::runtime
