// A real BLAS for host GEMMs, found at run time as the CUDA driver is: nothing links against it,
// and without one the blocked GEMM (cpu_matmul.hpp) does the work. KILN_BLAS chooses: a library
// name or path (`libblis.so.4`, `/opt/OpenBLAS/lib/libopenblas.so`), or `none` for the blocked
// GEMM; unset, kiln tries OpenBLAS built on OpenMP, then any OpenBLAS, then BLIS, then MKL's single
// runtime. Read at each matmul, so a process may switch; each library is opened once.
//
// Why OpenMP first: kiln's CPU kernels run on OpenMP (libgomp), and a GEMM's epilogue kernel follows
// it at once. An OpenBLAS on its own pthread pool leaves its workers spinning after the GEMM while
// the kernel's OpenMP team wants the same cores, and the kernel's team spins while the next GEMM
// starts: `gelu(a @ b + bias)` 1024^3 f32 took 1.7x the GEMM alone on 2 cores; with OpenBLAS on the
// same OpenMP team, 1.15x (benchmarks/NOTES.md item 56). Where only a pthread OpenBLAS is installed,
// it runs one thread a call and kiln cuts each product into tiles, a call each, on the kernels' own
// team (run_tiled_on_the_team below; NOTES items 62 and 134).
//
// Only what a BLAS computes exactly as kiln would is sent to it: f32 x f32 into f32 and f64 x f64
// into f64 (16-bit operands and mixed dtypes stay on the blocked GEMM, which converts on packing),
// with each operand and the output addressable as a row-major matrix or its transpose (one unit
// stride, a leading dimension that fits an int). A batch runs as one call per matrix (or tile).
#pragma once
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>

#include "../../core/config.hpp"
#include "../../core/dtype.hpp"
#include "../compile/host_threads.hpp"
#include "host_parallel.hpp"
#include "matmul_geometry.hpp"

namespace kiln::runtime {
namespace blas_detail {

// CBLAS's enumerators (cblas.h): row-major order, no transpose, transpose.
inline constexpr int row_major = 101, no_trans = 111, trans = 112;
using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
using Dgemm = void (*)(int, int, int, int, int, int, double, const double*, int, const double*, int, double, double*,
                       int);

struct Library {
  std::string name;  // empty: none found
  Sgemm sgemm = nullptr;
  Dgemm dgemm = nullptr;
  bool tiles = false;  // kiln cuts each product into tiles, one single-threaded call a tile
};

// OpenBLAS built on pthreads (or sequential) runs one thread a call from here on, and kiln runs the
// calls on the kernels' team, a tile each (tiling below): no second pool competes with the kernels'
// one. On a 16-core Xeon (NOTES item 134, best of three), `gelu(a @ b + bias)` 1024^3 f32 took
// 0.81x its time with OpenBLAS's own pool at 16 threads and 0.80x at 8, an MLP block's forward and
// backward 0.81x at 8, level at 4; at 2 threads 1.03-1.08x, within that machine's noise. Its OpenMP build
// already runs on the team (a call inside the team's region runs on one thread): it is left whole.
// The setting is the library's: a program calling the same OpenBLAS itself gets one thread too.
inline bool run_tiled_on_the_team(void* h) {
  using GetParallel = int (*)();
  using SetThreads = void (*)(int);
  auto get_parallel = reinterpret_cast<GetParallel>(dlsym(h, "openblas_get_parallel"));
  auto set_threads = reinterpret_cast<SetThreads>(dlsym(h, "openblas_set_num_threads"));
  if (!get_parallel || !set_threads || get_parallel() == 2) return false;  // not OpenBLAS, or on OpenMP
  set_threads(1);
  return true;
}

inline Library open_library(const char* name) {
  Library lib;
  settle_host_threads();  // before the BLAS reads its thread settings
  void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (!h) return lib;
  lib.sgemm = reinterpret_cast<Sgemm>(dlsym(h, "cblas_sgemm"));
  lib.dgemm = reinterpret_cast<Dgemm>(dlsym(h, "cblas_dgemm"));
  if (!lib.sgemm || !lib.dgemm) {  // a BLAS without the C interface: not usable
    dlclose(h);
    return Library{};
  }
  lib.tiles = run_tiled_on_the_team(h);
  lib.name = name;  // kept open for the process
  return lib;
}

// The libraries tried when KILN_BLAS is unset, in order: OpenBLAS's OpenMP build where
// distributions keep it apart (Debian and Ubuntu's multiarch directory, Fedora's libopenblaso),
// then the default OpenBLAS, BLIS and MKL.
inline constexpr const char* other_candidates[] = {"libopenblas.so.0", "libblis.so.4", "libmkl_rt.so.2", "libmkl_rt.so"};

// The library KILN_BLAS names (or the first found), opened once per name.
inline const Library& library() {
  static std::mutex mutex;
  static std::map<std::string, Library>* opened = new std::map<std::string, Library>();  // never closed
  const char* choice = kiln::config::env("KILN_BLAS");
  const std::string key = choice ? choice : "";
  std::lock_guard lock(mutex);
  auto it = opened->find(key);
  if (it != opened->end()) return it->second;
  Library lib;
  if (key == "none") {
  } else if (choice) {
    lib = open_library(choice);
  } else {
    for (const char* name : openmp_blas_candidates)
      if ((lib = open_library(name)).sgemm) break;
    if (!lib.sgemm)
      for (const char* name : other_candidates)
        if ((lib = open_library(name)).sgemm) break;
  }
  return opened->emplace(key, lib).first->second;
}

// How a row-major BLAS reads an R x C matrix with element strides (sr, sc): no_trans with leading
// dimension sr when columns are contiguous, trans with leading dimension sc when rows are; false
// when neither (or the leading dimension does not fit an int).
inline bool layout_of(std::int64_t rows, std::int64_t cols, std::int64_t sr, std::int64_t sc, int& op, int& ld) {
  const std::int64_t r1 = std::max<std::int64_t>(rows, 1), c1 = std::max<std::int64_t>(cols, 1);
  if ((cols <= 1 || sc == 1) && (rows <= 1 || sr >= c1)) {  // element (i, j) at i * ld + j
    const std::int64_t l = rows <= 1 ? c1 : sr;
    if (l > INT_MAX) return false;
    op = no_trans, ld = static_cast<int>(l);
    return true;
  }
  if ((rows <= 1 || sr == 1) && (cols <= 1 || sc >= r1)) {  // element (i, j) at j * ld + i
    const std::int64_t l = cols <= 1 ? r1 : sc;
    if (l > INT_MAX) return false;
    op = trans, ld = static_cast<int>(l);
    return true;
  }
  return false;
}

// The tiles of an M x N output for single-threaded calls on `threads` threads: the largest that
// still give every thread one, halving the longer side from the whole product. Each call packs its
// own panels of a and b, so smaller tiles pack the operands more times over: on a 16-core Xeon,
// tiles capped at 256 x 256 ran an MLP block's GEMMs within noise of the largest ones at 8 and 16
// threads and 15% slower at 4 (NOTES item 134). `largest` caps a side (KILN_TUNE_BLAS_TILES).
struct Tiling {
  std::int64_t mt, nt, m_tiles, n_tiles;
  std::int64_t count() const { return m_tiles * n_tiles; }
};
inline Tiling tiling(std::int64_t M, std::int64_t N, std::int64_t threads,
                     std::int64_t largest = std::numeric_limits<std::int64_t>::max()) {
  Tiling t{std::min(largest, M), std::min(largest, N), 0, 0};
  for (;;) {
    t.m_tiles = (M + t.mt - 1) / t.mt, t.n_tiles = (N + t.nt - 1) / t.nt;
    if (t.count() >= threads) break;
    if (t.mt >= t.nt && t.mt > 16)
      t.mt = (t.mt + 1) / 2;
    else if (t.nt > 16)
      t.nt = (t.nt + 1) / 2;
    else
      break;
  }
  return t;
}

}  // namespace blas_detail

// The name of the BLAS host GEMMs use now ("" when the blocked GEMM does the work).
inline std::string cpu_blas_name() { return blas_detail::library().name; }

// out = a @ b through the BLAS when there is one and it computes this product as kiln would;
// false (and nothing written) otherwise.
inline bool blas_matmul(const MatmulGeometry& g, const void* a, dtype ad, const void* b, dtype bd, void* out,
                        dtype od) {
  using namespace blas_detail;
  if (ad != bd || ad != od || (ad != dtype::f32 && ad != dtype::f64)) return false;
  if (g.M > INT_MAX || g.N > INT_MAX || g.K > INT_MAX || g.K == 0) return false;
  int op_a, lda, op_b, ldb, op_c, ldc;
  if (!layout_of(g.M, g.K, g.a_sm, g.a_sk, op_a, lda) || !layout_of(g.K, g.N, g.b_sk, g.b_sn, op_b, ldb) ||
      !layout_of(g.M, g.N, g.o_sm, g.o_sn, op_c, ldc) || op_c != no_trans)
    return false;
  const Library& lib = library();
  if (!lib.sgemm) return false;
  std::int64_t batch = g.batch, rows = g.M;
  if (batch > 1 && g.b_bs == 0 && op_a == no_trans && g.a_bs == g.M * lda && g.o_bs == g.M * ldc &&
      g.M * g.batch <= INT_MAX)
    rows *= batch, batch = 1;  // one weight under a contiguous batch: one call over every row
  const int M = static_cast<int>(rows), N = static_cast<int>(g.N), K = static_cast<int>(g.K);
  const std::int64_t size = static_cast<std::int64_t>(itemsize(ad));
  // Rows m0.. and columns n0.. of matrix i of the batch: one call.
  auto product = [&](std::int64_t i, std::int64_t m0, int mc, std::int64_t n0, int nc) {
    const char* pa = static_cast<const char*>(a) + size * (i * g.a_bs + (op_a == no_trans ? m0 * lda : m0));
    const char* pb = static_cast<const char*>(b) + size * (i * g.b_bs + (op_b == no_trans ? n0 : n0 * ldb));
    char* po = static_cast<char*>(out) + size * (i * g.o_bs + m0 * ldc + n0);
    if (ad == dtype::f32)
      lib.sgemm(row_major, op_a, op_b, mc, nc, K, 1.0f, reinterpret_cast<const float*>(pa), lda,
                reinterpret_cast<const float*>(pb), ldb, 0.0f, reinterpret_cast<float*>(po), ldc);
    else
      lib.dgemm(row_major, op_a, op_b, mc, nc, K, 1.0, reinterpret_cast<const double*>(pa), lda,
                reinterpret_cast<const double*>(pb), ldb, 0.0, reinterpret_cast<double*>(po), ldc);
  };
  const double flops = 2.0 * static_cast<double>(batch) * M * static_cast<double>(N) * K;
  // KILN_TUNE_BLAS_TILES: 1 cuts every BLAS's products into tiles on the team, 0 none, a larger
  // number into tiles of at most that many rows and columns (experiments).
  const char* tune = kiln::config::env("KILN_TUNE_BLAS_TILES");
  const bool tiles = tune && *tune ? std::strcmp(tune, "0") != 0 : lib.tiles;
  const int cap = tune ? std::atoi(tune) : 0;
  const std::int64_t largest = cap > 1 ? cap : std::numeric_limits<std::int64_t>::max();
  // As many threads as the flops pay for: the tiles are then cut to give each one.
  const int threads = tiles ? host_parallel::thread_count(std::numeric_limits<std::int64_t>::max(), flops) : 1;
  if (threads <= 1) {
    for (std::int64_t i = 0; i < batch; ++i) product(i, 0, M, 0, N);
    return true;
  }
  const Tiling t = tiling(M, N, (threads + batch - 1) / batch, largest);
  const std::int64_t tasks = batch * t.count();
  host_parallel::run(static_cast<int>(std::min<std::int64_t>(threads, tasks)), [&](std::atomic<std::int64_t>& next) {
    for (std::int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const std::int64_t i = task / t.count(), m0 = task % t.count() / t.n_tiles * t.mt, n0 = task % t.n_tiles * t.nt;
      product(i, m0, static_cast<int>(std::min(t.mt, M - m0)), n0, static_cast<int>(std::min(t.nt, N - n0)));
    }
  });
  return true;
}

}  // namespace kiln::runtime
