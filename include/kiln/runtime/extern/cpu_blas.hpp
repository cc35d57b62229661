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
// both pools' spins are shortened before either library loads (compile/host_threads.hpp): on 16
// cores, 6.2x the GEMM alone before, 1.2x after (NOTES item 62).
//
// Only what a BLAS computes exactly as kiln would is sent to it: f32 x f32 into f32 and f64 x f64
// into f64 (16-bit operands and mixed dtypes stay on the blocked GEMM, which converts on packing),
// with each operand and the output addressable as a row-major matrix or its transpose (one unit
// stride, a leading dimension that fits an int). A batch runs as one call per matrix.
#pragma once
#include <dlfcn.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "../../core/config.hpp"
#include "../../core/dtype.hpp"
#include "../compile/host_threads.hpp"
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
};

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
  const std::size_t size = itemsize(ad);
  for (std::int64_t i = 0; i < batch; ++i) {
    const char* pa = static_cast<const char*>(a) + static_cast<std::int64_t>(size) * i * g.a_bs;
    const char* pb = static_cast<const char*>(b) + static_cast<std::int64_t>(size) * i * g.b_bs;
    char* po = static_cast<char*>(out) + static_cast<std::int64_t>(size) * i * g.o_bs;
    if (ad == dtype::f32)
      lib.sgemm(row_major, op_a, op_b, M, N, K, 1.0f, reinterpret_cast<const float*>(pa), lda,
                reinterpret_cast<const float*>(pb), ldb, 0.0f, reinterpret_cast<float*>(po), ldc);
    else
      lib.dgemm(row_major, op_a, op_b, M, N, K, 1.0, reinterpret_cast<const double*>(pa), lda,
                reinterpret_cast<const double*>(pb), ldb, 0.0, reinterpret_cast<double*>(po), ldc);
  }
  return true;
}

}  // namespace kiln::runtime
