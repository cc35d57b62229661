// Matrix multiplication kernels: runtime::cpu_matmul against a naive f64 triple loop (odd shapes,
// batches, broadcasting, transposed and strided views, every floating dtype, K = 0), the host
// logic of runtime::cuda_matmul (operand layouts and the cuBLASLt plan, checked by emulating
// cuBLAS's column-major semantics on the host; the copy kernels through NVRTC), and on machines
// with a GPU runtime::cuda_matmul itself.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <kiln/core/driver.hpp>
#include <kiln/core/memory.hpp>
#include <kiln/core/tensor.hpp>
#include <kiln/runtime/extern/cpu_matmul.hpp>
#include <kiln/runtime/extern/cuda_matmul.hpp>
#include <kiln/runtime/extern/dot_matmul.hpp>
#include <kiln/runtime/extern/matmul_layout.hpp>

#include "have_gpu.hpp"
#include "scoped_env.hpp"

namespace {

namespace k = kiln;
namespace rt = kiln::runtime;
using k::Dims;
using k::Tensor;

std::mt19937& gen() {
  static std::mt19937 g(4242);
  return g;
}

// A host tensor with `storage` elements of random values (rounded once to dt), viewed with the
// given shape, strides and offset (contiguous by default).
Tensor random_view(const Dims& shape, k::dtype dt, Dims strides = {}, std::int64_t offset = 0,
                   std::int64_t storage = -1) {
  if (strides.empty()) strides = k::contiguous_strides(shape);
  if (storage < 0) {
    storage = offset + 1;
    for (int i = 0; i < shape.size(); ++i) storage += (shape[i] - 1) * strides[i];
    if (shape.product() == 0) storage = offset;
  }
  Tensor t = Tensor::empty({storage}, dt, k::cpu);
  std::normal_distribution<double> d(0.0, 1.0);
  for (std::int64_t i = 0; i < storage; ++i) k::store_from_double(t.data_ptr(), dt, i, d(gen()));
  return t.as_strided(shape, strides, offset);
}

Tensor random(const Dims& shape, k::dtype dt = k::f32) { return random_view(shape, dt); }

// A transposed view: an [rows, cols] tensor stored as its contiguous [cols, rows] transpose.
Tensor random_transposed(std::int64_t rows, std::int64_t cols, k::dtype dt = k::f32) {
  return random_view({rows, cols}, dt, {1, rows});
}

double at(const Tensor& t, const Dims& idx) {
  return k::load_as_double(t.storage()->data, t.dtype(), t.offset() + k::dot_strides(idx, t.strides()));
}

// The product in f64 from the stored (already rounded) values, as a contiguous [B?, M, N] list;
// with `magnitude`, the sums of |a| |b| instead (what bounds the rounding error of each element).
std::vector<double> reference(const Tensor& a, const Tensor& b, bool magnitude = false) {
  const bool batched = a.dim() == 3 || b.dim() == 3;
  const std::int64_t ab = a.dim() == 3 ? a.shape()[0] : 1, bb = b.dim() == 3 ? b.shape()[0] : 1;
  const std::int64_t B = batched ? std::max(ab, bb) : 1;
  const std::int64_t M = a.shape()[a.dim() - 2], K = a.shape()[a.dim() - 1], N = b.shape()[b.dim() - 1];
  std::vector<double> out(static_cast<std::size_t>(B * M * N), 0.0);
  for (std::int64_t p = 0; p < B; ++p)
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) {
        double acc = 0;
        for (std::int64_t l = 0; l < K; ++l) {
          double x = a.dim() == 3 ? at(a, {ab == 1 ? 0 : p, i, l}) : at(a, {i, l});
          double y = b.dim() == 3 ? at(b, {bb == 1 ? 0 : p, l, j}) : at(b, {l, j});
          acc += magnitude ? std::abs(x * y) : x * y;
        }
        out[static_cast<std::size_t>((p * M + i) * N + j)] = acc;
      }
  return out;
}

Dims out_shape(const Tensor& a, const Tensor& b) {
  const std::int64_t M = a.shape()[a.dim() - 2], N = b.shape()[b.dim() - 1];
  if (a.dim() == 2 && b.dim() == 2) return {M, N};
  const std::int64_t ab = a.dim() == 3 ? a.shape()[0] : 1, bb = b.dim() == 3 ? b.shape()[0] : 1;
  return {std::max(ab, bb), M, N};
}

struct Tol {
  double rtol, atol;
};
Tol tolerance(k::dtype out) {
  switch (out) {
    case k::dtype::f64:
      return {1e-12, 1e-12};
    case k::dtype::f32:
      return {2e-5, 2e-5};
    case k::dtype::f16:
      return {2e-3, 2e-3};
    default:
      return {1e-2, 1e-2};  // bf16
  }
}

// Compares a (host, any strides) result against the reference; reports the worst element. `rounding`
// (per element, optional) widens each element's tolerance by the error that accumulating the
// product in floating point may make in any order: 2 sqrt(K) u sum |a| |b| (the probabilistic
// bound; a BLAS sums in another order than the blocked GEMM).
void check_close(const Tensor& out, const std::vector<double>& want, Tol tol,
                 const std::vector<double>& rounding = {}) {
  REQUIRE(static_cast<std::int64_t>(want.size()) == out.numel());
  double worst = 0;
  std::int64_t worst_at = -1;
  double got_at = 0;
  k::for_each_index(out.shape(), [&](std::int64_t lin, const Dims& idx) {
    double got = at(out, idx), w = want[static_cast<std::size_t>(lin)];
    const double slack = rounding.empty() ? 0.0 : rounding[static_cast<std::size_t>(lin)];
    double excess = std::abs(got - w) - (tol.atol + tol.rtol * std::abs(w) + slack);
    if (!(excess <= worst) || std::isnan(got)) {
      worst = std::isnan(got) ? INFINITY : excess;
      worst_at = lin;
      got_at = got;
    }
  });
  INFO("worst element " << worst_at << ": got " << got_at << ", want "
                        << (worst_at >= 0 ? want[static_cast<std::size_t>(worst_at)] : 0.0));
  CHECK(worst_at == -1);
}

// Runs cpu_matmul into a fresh output (pre-filled with garbage) and checks it.
void check_cpu(const Tensor& a, const Tensor& b, k::dtype out_dt) {
  Tensor out = Tensor::empty(out_shape(a, b), out_dt, k::cpu);
  for (std::int64_t i = 0; i < out.numel(); ++i) k::store_from_double(out.data_ptr(), out_dt, i, 12345.0);
  rt::cpu_matmul(a, b, out);
  const bool f64 = a.dtype() == k::f64 || b.dtype() == k::f64;
  const double unit = f64 ? 0x1p-53 : 0x1p-24, K = static_cast<double>(a.shape()[a.dim() - 1]);
  std::vector<double> rounding = reference(a, b, true);
  for (double& r : rounding) r *= 2 * std::sqrt(K) * unit;
  check_close(out, reference(a, b), tolerance(out_dt), rounding);
}

k::dtype result_dtype(const Tensor& a, const Tensor& b) { return k::promote(a.dtype(), b.dtype()); }

void check_cpu(const Tensor& a, const Tensor& b) { check_cpu(a, b, result_dtype(a, b)); }

}  // namespace

TEST_CASE("cpu_matmul: 2-D shapes, odd and blocked") {
  for (Dims mnk : {Dims{1, 1, 1}, Dims{37, 129, 65}, Dims{64, 64, 64}, Dims{1, 300, 7}, Dims{300, 1, 7},
                   Dims{150, 300, 520}, Dims{5, 3, 2}}) {
    CAPTURE(mnk);
    check_cpu(random({mnk[0], mnk[2]}), random({mnk[2], mnk[1]}));
  }
}

TEST_CASE("cpu_matmul: batched, 3-D x 2-D and broadcast batches") {
  check_cpu(random({3, 17, 33}), random({3, 33, 9}));
  check_cpu(random({4, 5, 7}), random({7, 6}));     // 3-D x 2-D
  check_cpu(random({5, 7}), random({4, 7, 6}));     // 2-D x 3-D
  check_cpu(random({1, 5, 7}), random({3, 7, 6}));  // a batch of 1 broadcasts
  check_cpu(random({3, 5, 7}), random({1, 7, 6}));
  check_cpu(random({2, 80, 300}), random({300, 270}));  // several blocks per batch
}

TEST_CASE("cpu_matmul: few rows against a wide b (computed as b^T a^T)") {
  check_cpu(random({8, 300}), random_transposed(300, 700));  // linear on a small batch
  check_cpu(random({3, 4, 20}), random({20, 50}));           // 3-D x 2-D
  check_cpu(random({2, 3, 20}, k::f16), random_view({2, 20, 70}, k::f16, {1, 2, 40}));
  check_cpu(random({5, 7}), random({4, 7, 60}));  // 2-D x 3-D
  check_cpu(random_view({6, 9}, k::f32, {1, 6}), random({9, 400}, k::bf16));
  Tensor a = random({3, 5}), b = random({5, 40});
  Tensor out = Tensor::empty({40, 3}, k::f32, k::cpu).as_strided({3, 40}, {1, 3}, 0);
  rt::cpu_matmul(a, b, out);
  check_close(out, reference(a, b), tolerance(k::f32));
  Tensor z = Tensor::empty({2, 30}, k::f32, k::cpu);
  rt::cpu_matmul(random({2, 0}), random({0, 30}), z);
  check_close(z, std::vector<double>(60, 0.0), tolerance(k::f32));
}

TEST_CASE("cpu_matmul: transposed and strided operands") {
  // linear: x @ permute(w, {1, 0}) with w [N, K] contiguous.
  check_cpu(random({37, 65}), random_transposed(65, 129));
  check_cpu(random_transposed(37, 65), random({65, 129}));
  check_cpu(random_transposed(37, 65), random_transposed(65, 129));
  // Every other column and row, at an offset.
  check_cpu(random_view({9, 11}, k::f32, {40, 2}, 3), random_view({11, 13}, k::f32, {3, 50}, 1));
  // A broadcast (stride 0) dimension, and batched transposes.
  check_cpu(random_view({6, 4}, k::f32, {0, 1}), random({4, 5}));
  check_cpu(random_view({3, 17, 33}, k::f32, {17 * 33, 1, 17}), random_view({3, 33, 9}, k::f32, {1, 3, 99}));
  check_cpu(random_view({3, 8, 5}, k::f32, {0, 5, 1}), random({3, 5, 4}));  // expanded batch
}

TEST_CASE("cpu_matmul: dtypes") {
  for (k::dtype dt : {k::f64, k::f16, k::bf16}) {
    CAPTURE(k::name(dt));
    check_cpu(random({37, 65}, dt), random({65, 129}, dt));
    check_cpu(random({3, 17, 33}, dt), random_transposed(33, 9, dt));
  }
  check_cpu(random({13, 21}, k::f16), random({21, 8}, k::f32));            // f16 x f32 -> f32
  check_cpu(random({13, 21}, k::f16), random({21, 8}, k::bf16));           // f16 x bf16 -> f32
  check_cpu(random({13, 21}, k::f64), random({21, 8}, k::f16));            // -> f64
  check_cpu(random({13, 300}, k::f32), random({300, 8}, k::f32), k::f16);  // rounded once into f16
}

TEST_CASE("cpu_matmul: strided output and zero-size dimensions") {
  Tensor a = random({7, 5}), b = random({5, 6});
  Tensor storage = Tensor::empty({6 * 7}, k::f32, k::cpu);
  Tensor out = storage.as_strided({7, 6}, {1, 7}, 0);  // the transpose of a contiguous [6, 7]
  rt::cpu_matmul(a, b, out);
  check_close(out, reference(a, b), tolerance(k::f32));

  // K = 0 gives zeros.
  for (k::dtype dt : {k::f32, k::f16, k::f64}) {
    Tensor z = Tensor::empty({4, 5}, dt, k::cpu);
    for (std::int64_t i = 0; i < z.numel(); ++i) k::store_from_double(z.data_ptr(), dt, i, 7.0);
    rt::cpu_matmul(random({4, 0}, dt), random({0, 5}, dt), z);
    check_close(z, std::vector<double>(20, 0.0), tolerance(dt));
  }
  Tensor zb = Tensor::empty({2, 3, 4}, k::f32, k::cpu);
  for (std::int64_t i = 0; i < zb.numel(); ++i) static_cast<float*>(zb.data_ptr())[i] = 7.0f;
  rt::cpu_matmul(random({2, 3, 0}), random({0, 4}), zb);
  check_close(zb, std::vector<double>(24, 0.0), tolerance(k::f32));

  // M = 0, N = 0 and an empty batch do nothing.
  rt::cpu_matmul(random({0, 5}), random({5, 3}), Tensor::empty({0, 3}, k::f32, k::cpu));
  rt::cpu_matmul(random({4, 5}), random({5, 0}), Tensor::empty({4, 0}, k::f32, k::cpu));
  rt::cpu_matmul(random({0, 4, 5}), random({5, 3}), Tensor::empty({0, 4, 3}, k::f32, k::cpu));
}

TEST_CASE("cpu_matmul: errors name the shapes and dtypes") {
  Tensor out = Tensor::empty({4, 6}, k::f32, k::cpu);
  CHECK_THROWS_AS(rt::cpu_matmul(random({4, 5}), random({6, 6}), out), k::shape_error);
  CHECK_THROWS_AS(rt::cpu_matmul(random({4, 5}), random({5, 7}), out), k::shape_error);
  CHECK_THROWS_AS(rt::cpu_matmul(random({2, 4, 5}), random({3, 5, 6}), Tensor::empty({3, 4, 6}, k::f32, k::cpu)),
                  k::shape_error);
  CHECK_THROWS_AS(rt::cpu_matmul(random({5}), random({5, 6}), out), k::shape_error);
  CHECK_THROWS_AS(rt::cpu_matmul(random({4, 5}, k::i32), random({5, 6}), out), k::dtype_error);
  try {
    rt::cpu_matmul(random({4, 5}), random({6, 6}), out);
  } catch (const k::shape_error& e) {
    CHECK(std::string(e.what()).find("[4, 5]") != std::string::npos);
    CHECK(std::string(e.what()).find("[6, 6]") != std::string::npos);
  }
}

// ---- CUDA: host-side logic ----------------------------------------------------------------------

namespace {

// Runs a GemmPlan as cuBLAS would (column-major, op N/T, strided batches) on host tensors: the
// check that the row-major to column-major mapping, leading dimensions, batch strides and batch
// folding are right, without a GPU.
std::vector<double> emulate_plan(const Tensor& a_in, const Tensor& b_in) {
  Dims shape = out_shape(a_in, b_in);
  Tensor out = Tensor::empty(shape, k::f64, k::cpu);
  rt::MatmulGeometry g = rt::matmul_geometry(a_in, b_in, out, "matmul");
  rt::GemmPlan p = rt::plan_gemm(g, true, true, true);
  auto contiguous = [](const Tensor& t) {
    Tensor c = Tensor::empty(t.shape(), k::f64, k::cpu);
    k::copy_to_contiguous_host(t, c.data_ptr(), k::f64);
    return c;
  };
  Tensor a = p.copy_a ? contiguous(a_in) : a_in;
  Tensor b = p.copy_b ? contiguous(b_in) : b_in;
  // Raw element addressing from each operand's data pointer, as cuBLAS sees it.
  auto A = [&](std::int64_t batch, std::int64_t r, std::int64_t c) {
    return k::load_as_double(b.data_ptr(), b.dtype(), batch * p.stride_a + r + c * p.lda);
  };
  auto B = [&](std::int64_t batch, std::int64_t r, std::int64_t c) {
    return k::load_as_double(a.data_ptr(), a.dtype(), batch * p.stride_b + r + c * p.ldb);
  };
  REQUIRE(p.direct);
  CHECK(p.rows_a == (p.trans_a ? p.k : p.m));
  CHECK(p.cols_a == (p.trans_a ? p.m : p.k));
  CHECK(p.rows_b == (p.trans_b ? p.n : p.k));
  CHECK(p.cols_b == (p.trans_b ? p.k : p.n));
  CHECK(p.lda >= std::max<std::int64_t>(p.rows_a, 1));
  CHECK(p.ldb >= std::max<std::int64_t>(p.rows_b, 1));
  CHECK(p.ldd >= std::max<std::int64_t>(p.m, 1));
  for (std::int64_t q = 0; q < p.batch; ++q)
    for (std::int64_t i = 0; i < p.m; ++i)
      for (std::int64_t j = 0; j < p.n; ++j) {
        double acc = 0;
        for (std::int64_t l = 0; l < p.k; ++l) {
          double x = p.trans_a ? A(q, l, i) : A(q, i, l);
          double y = p.trans_b ? B(q, j, l) : B(q, l, j);
          acc += x * y;
        }
        static_cast<double*>(out.data_ptr())[q * p.stride_d + i + j * p.ldd] = acc;
      }
  return std::vector<double>(static_cast<double*>(out.data_ptr()), static_cast<double*>(out.data_ptr()) + out.numel());
}

void check_plan(const Tensor& a, const Tensor& b) {
  std::vector<double> want = reference(a, b), got = emulate_plan(a, b);
  REQUIRE(want.size() == got.size());
  double worst = 0;
  for (std::size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::abs(want[i] - got[i]));
  CHECK(worst < 1e-9);
}

}  // namespace

TEST_CASE("cuda_matmul: operand layouts for cuBLASLt") {
  using rt::cuda_mm_detail::classify;
  auto row = classify(4, 6, 6, 1);  // row-major [4, 6]: the column-major 6 x 4 transpose, op N
  CHECK((row.ok && !row.transpose && row.rows == 6 && row.cols == 4 && row.ld == 6));
  auto col = classify(4, 6, 1, 4);  // column-major (a permuted [6, 4]): itself, op T
  CHECK((col.ok && col.transpose && col.rows == 4 && col.cols == 6 && col.ld == 4));
  CHECK(classify(4, 6, 8, 1).ld == 8);    // padded rows
  CHECK_FALSE(classify(4, 6, 12, 2).ok);  // every other column: copy first
  CHECK_FALSE(classify(4, 6, 0, 1).ok);   // a broadcast row: copy first
  CHECK(classify(1, 6, 999, 1).ok);       // a single row: its stride does not matter
  CHECK(classify(4, 1, 1, 999).ok);       // a single column either
}

TEST_CASE("cuda_matmul: the cuBLASLt plan computes a @ b (host emulation)") {
  check_plan(random({1, 1}), random({1, 1}));
  check_plan(random({37, 129}), random({129, 65}));
  check_plan(random({37, 65}), random_transposed(65, 129));  // linear
  check_plan(random_transposed(37, 65), random({65, 129}));
  check_plan(random_transposed(37, 65), random_transposed(65, 129));
  check_plan(random_view({9, 11}, k::f32, {40, 2}, 3), random_view({11, 13}, k::f32, {3, 50}, 1));  // copies
  check_plan(random({3, 17, 33}), random({3, 33, 9}));                                              // strided batch
  check_plan(random({3, 17, 33}), random_transposed(33, 9));                            // folded into one GEMM
  check_plan(random({4, 1, 7}), random({7, 6}));                                        // folded, M = 1
  check_plan(random_view({3, 17, 33}, k::f32, {17 * 40, 40, 1}), random({33, 9}));      // padded rows
  check_plan(random_view({3, 17, 33}, k::f32, {17 * 40 + 8, 40, 1}), random({33, 9}));  // not foldable
  check_plan(random_view({3, 8, 5}, k::f32, {0, 5, 1}), random({3, 5, 4}));             // expanded batch
  check_plan(random_view({6, 4}, k::f32, {0, 1}), random({4, 5}));                      // broadcast rows: copy
  check_plan(random_view({3, 17, 33}, k::f32, {17 * 33, 1, 17}), random({33, 9}));      // transposed batches
  check_plan(random({5, 7}), random({4, 7, 6}));                                        // a broadcasts
  check_plan(random({1, 5, 7}), random({3, 7, 6}));
  check_plan(random({3, 5, 7}), random_view({3, 7, 6}, k::f32, {1, 3, 21}));

  // Folding needs a's batches and out's back to back.
  Tensor a = random({3, 17, 33}), b = random({33, 9});
  Tensor out = Tensor::empty({3, 17, 9}, k::f32, k::cpu);
  rt::GemmPlan p = rt::plan_gemm(rt::matmul_geometry(a, b, out, "matmul"), true, true, true);
  CHECK(p.batch == 1);
  CHECK(p.n == 51);
  Tensor padded = random_view({3, 17, 33}, k::f32, {17 * 40, 40, 1});  // padded rows, batches back to back
  p = rt::plan_gemm(rt::matmul_geometry(padded, b, out, "matmul"), true, true, true);
  CHECK(p.batch == 1);
  CHECK(p.ldb == 40);
  Tensor gaps = random_view({3, 17, 33}, k::f32, {17 * 40 + 8, 40, 1});  // gaps between batches
  p = rt::plan_gemm(rt::matmul_geometry(gaps, b, out, "matmul"), true, true, true);
  CHECK(p.batch == 3);
  CHECK(p.stride_b == 17 * 40 + 8);
  CHECK(p.stride_a == 0);
  // An output cuBLAS cannot write (transposed, or another dtype) goes through a temporary.
  Tensor out_t = Tensor::empty({9, 17}, k::f32, k::cpu).as_strided({17, 9}, {1, 17}, 0);
  p = rt::plan_gemm(rt::matmul_geometry(random({17, 33}), b, out_t, "matmul"), true, true, true);
  CHECK_FALSE(p.direct);
  CHECK(p.ldd == 9);
}

namespace {

// Every field of a plan in one line: cuBLAS's A and B as stored (op, rows x cols, leading dim), D
// (m x n, ldd), k, the batch and its strides for A / B / D, then which operands are copied first and
// whether D goes through a temporary.
std::string describe(const rt::GemmPlan& p) {
  auto s = [](std::int64_t v) { return std::to_string(v); };
  return std::string("A ") + (p.trans_a ? "T " : "N ") + s(p.rows_a) + "x" + s(p.cols_a) + " ld " + s(p.lda) + ", B " +
         (p.trans_b ? "T " : "N ") + s(p.rows_b) + "x" + s(p.cols_b) + " ld " + s(p.ldb) + ", D " + s(p.m) + "x" +
         s(p.n) + " ld " + s(p.ldd) + ", k " + s(p.k) + ", batch " + s(p.batch) + " strides " + s(p.stride_a) + "/" +
         s(p.stride_b) + "/" + s(p.stride_d) + (p.copy_a ? ", copy a" : "") + (p.copy_b ? ", copy b" : "") +
         (p.direct ? "" : ", via temporary");
}

std::string plan_of(const Tensor& a, const Tensor& b, const Tensor& out, bool b_ok = true) {
  return describe(rt::plan_gemm(rt::matmul_geometry(a, b, out, "matmul"), true, b_ok, true));
}

Tensor view(const Dims& shape, const Dims& strides, std::int64_t offset = 0) {
  return random_view(shape, k::f32, strides, offset);
}

}  // namespace

// The plan is host arithmetic (matmul_layout.hpp), checked here without a GPU against values worked
// out by hand. out [M,N] = a [M,K] @ b [K,N] is cuBLAS's column-major D (m = N) x (n = M) =
// op(A) (N x K) * op(B) (K x M), A read from b's memory and B from a's. A row-major operand is its
// own column-major transpose (op N, ld = its row stride); a column-major one is itself (op T, ld =
// its column stride). Throughout M = 4, K = 6, N = 5; out3 is [3,4,5] contiguous (batch stride 20).
TEST_CASE("cuda_matmul: the planned cuBLASLt layouts against values worked out by hand") {
  const Tensor out = Tensor::empty({4, 5}, k::f32, k::cpu);
  const Tensor out3 = Tensor::empty({3, 4, 5}, k::f32, k::cpu);
  // Contiguous: b [6,5] reads as the 5 x 6 column-major b^T (ld 5), a [4,6] as 6 x 4 (ld 6).
  CHECK(plan_of(view({4, 6}, {6, 1}), view({6, 5}, {5, 1}), out) ==
        "A N 5x6 ld 5, B N 6x4 ld 6, D 5x4 ld 5, k 6, batch 1 strides 0/0/0");
  // A transposed weight (b = w^T, w [5,6] contiguous): w's memory is the 6 x 5 column-major b, op T.
  CHECK(plan_of(view({4, 6}, {6, 1}), view({6, 5}, {1, 6}), out) ==
        "A T 6x5 ld 6, B N 6x4 ld 6, D 5x4 ld 5, k 6, batch 1 strides 0/0/0");
  // a column-major too (a permuted [6,4]): its memory is the 4 x 6 a itself, op T.
  CHECK(plan_of(view({4, 6}, {1, 4}), view({6, 5}, {1, 6}), out) ==
        "A T 6x5 ld 6, B T 4x6 ld 4, D 5x4 ld 5, k 6, batch 1 strides 0/0/0");
  // A 3-D a with gaps between its batches (stride 30, not 4 * 6) and a 2-D b: strided batches, b's
  // batch stride 0.
  CHECK(plan_of(view({3, 4, 6}, {30, 6, 1}), view({6, 5}, {5, 1}), out3) ==
        "A N 5x6 ld 5, B N 6x4 ld 6, D 5x4 ld 5, k 6, batch 3 strides 0/30/20");
  // The same with a's batches back to back (24 = 4 * 6, and out's 20 = 4 * 5): one GEMM of 3 * 4 =
  // 12 rows (the batch strides are carried along, unused at batch 1).
  CHECK(plan_of(view({3, 4, 6}, {24, 6, 1}), view({6, 5}, {5, 1}), out3) ==
        "A N 5x6 ld 5, B N 6x12 ld 6, D 5x12 ld 5, k 6, batch 1 strides 0/24/20");
  // A 2-D a broadcast over a 3-D b (batch stride 30): a's batch stride 0, not folded.
  CHECK(plan_of(view({4, 6}, {6, 1}), view({3, 6, 5}, {30, 5, 1}), out3) ==
        "A N 5x6 ld 5, B N 6x4 ld 6, D 5x4 ld 5, k 6, batch 3 strides 30/0/20");
  // Column slices read and written in place, their leading dims the parents' row lengths: a =
  // x[:, 2:8] of x [4,10], b = y[:, 3:8] of y [6,9], out = z[:, 1:6] of z [4,8].
  const Tensor z = Tensor::empty({4, 8}, k::f32, k::cpu).as_strided({4, 5}, {8, 1}, 1);
  CHECK(plan_of(view({4, 6}, {10, 1}, 2), view({6, 5}, {9, 1}, 3), z) ==
        "A N 5x6 ld 9, B N 6x4 ld 10, D 5x4 ld 8, k 6, batch 1 strides 0/0/0");
  // Copies: a every other column (unreadable), b readable as op T but of a dtype that is not used
  // as it is (b_ok = false): both become contiguous row-major (op N). A transposed out goes through
  // a contiguous [4,5] temporary (ld 5, batch stride 4 * 5).
  const Tensor out_t = Tensor::empty({5, 4}, k::f32, k::cpu).as_strided({4, 5}, {1, 4}, 0);
  CHECK(plan_of(view({4, 6}, {12, 2}), view({6, 5}, {1, 6}), out_t, false) ==
        "A N 5x6 ld 5, B N 6x4 ld 6, D 5x4 ld 5, k 6, batch 1 strides 0/0/20, copy a, copy b, via temporary");
}

// 16-bit GEMMs with sizes off 8 run on padded copies where the product has the flops to pay for the
// copies (matmul_layout.hpp's plan_padding): GPT-2's lm_head shapes do, a thin product does not.
TEST_CASE("cuda_matmul: which 16-bit GEMMs are padded") {
  // Views of one element's storage: the plan reads shapes and strides only.
  auto view = [](const Dims& shape, const Dims& strides, k::dtype dt) {
    return Tensor::empty({1}, dt, k::cpu).as_strided(shape, strides, 0);
  };
  auto padding = [&](std::int64_t m, std::int64_t kk, std::int64_t n, bool b_transposed, k::dtype out) {
    Tensor a = view({m, kk}, {kk, 1}, k::bf16);
    Tensor b = b_transposed ? view({kk, n}, {1, kk}, k::bf16) : view({kk, n}, {n, 1}, k::bf16);
    Tensor o = view({m, n}, {n, 1}, out);
    rt::GemmPlan p = rt::plan_gemm(rt::matmul_geometry(a, b, o, "matmul"), true, true, true);
    return rt::plan_padding(p, 2, static_cast<std::int64_t>(k::itemsize(out)));
  };
  // logits = h @ wte^T: n (cuBLAS's m) = 50257 padded in cuBLAS's A (wte, op T) and D; h as it is.
  rt::GemmPadding fwd = padding(8192, 768, 50257, true, k::bf16);
  CHECK(fwd.pad);
  CHECK((fwd.m == 50264 && fwd.n == 8192 && fwd.k == 768));
  CHECK((fwd.a && !fwd.b && fwd.d));
  CHECK((fwd.rows_a == 768 && fwd.cols_a == 50264));
  // dh = dlogits @ wte: K = 50257 padded in both operands, the output as it is.
  rt::GemmPadding dh = padding(8192, 50257, 768, false, k::bf16);
  CHECK((dh.pad && dh.a && dh.b && !dh.d && dh.k == 50264));
  // Aligned: nothing to pad; a thin product: not worth its copies; f32 operands: never.
  CHECK(!padding(8192, 768, 3072, false, k::bf16).pad);
  CHECK(!padding(8192, 768, 3072, false, k::bf16).d);
  CHECK(!padding(37, 65, 129, false, k::bf16).pad);
  CHECK(padding(8192, 768, 50257, true, k::f32).pad);  // 16-bit operands into f32
  rt::GemmPlan f32_plan =
      rt::plan_gemm(rt::matmul_geometry(view({8192, 768}, {768, 1}, k::f32), view({768, 50257}, {50257, 1}, k::f32),
                                        view({8192, 50257}, {50257, 1}, k::f32), "matmul"),
                    true, true, true);
  CHECK(!rt::plan_padding(f32_plan, 4, 4).pad);
  rt::GemmPadding f32_out = padding(301, 1003, 517, false, k::f32);
  CHECK((f32_out.pad && f32_out.d));
  CHECK(padding(301, 1003, 2053, false, k::f32).pad);  // the GPU test's long columns
  // Matrix-vector products wait on memory whatever kernel runs them: never padded.
  CHECK(!padding(65536, 4096, 1, false, k::bf16).pad);
  CHECK(!padding(1, 4096, 65537, false, k::bf16).pad);
  CHECK(!padding(65537, 4096, 3, true, k::bf16).pad);
}

TEST_CASE("cuda_matmul: the copy kernels compile with NVRTC") {
  std::vector<char> cubin = rt::compile_cubin(rt::cuda_mm_detail::copy_kernel_source(), "kiln_mm_copy", "sm_90a");
  CHECK(cubin.size() > 0);
  std::string image(cubin.begin(), cubin.end());
  CHECK(image.find(rt::cuda_mm_detail::copy_kernel_name(k::f16, k::f32)) != std::string::npos);
  CHECK(image.find(rt::cuda_mm_detail::copy_kernel_name(k::bf16, k::f64)) != std::string::npos);
  CHECK(image.find("kiln_mm_pad_b16") != std::string::npos);
  CHECK(image.find("kiln_mm_pad_b32") != std::string::npos);
}

TEST_CASE("cuda_matmul: cuBLASLt loads or says why") {
  if (rt::cublaslt::available()) {
    CHECK_NOTHROW(rt::cublaslt::api());
  } else {
    try {
      rt::cublaslt::api();
      FAIL("api() should throw when cuBLASLt is missing");
    } catch (const k::device_error& e) {
      CHECK(std::string(e.what()).find("libcublasLt") != std::string::npos);
    }
  }
}

// ---- CUDA: on a device --------------------------------------------------------------------------

namespace {

// A CUDA copy of a host view: the whole underlying storage, viewed with the same strides.
Tensor to_cuda(const Tensor& host) {
  const std::int64_t elems = static_cast<std::int64_t>(host.storage()->bytes / k::itemsize(host.dtype()));
  Tensor dev = Tensor::empty({elems}, host.dtype(), k::cuda);
  k::memory::copy(dev.data_ptr(), k::cuda, host.storage()->data, k::cpu, host.storage()->bytes, nullptr);
  return dev.as_strided(host.shape(), host.strides(), host.offset());
}

// A host copy of a contiguous CUDA tensor (waits for the default stream).
Tensor to_host(const Tensor& dev) {
  REQUIRE(dev.is_contiguous());
  Tensor host = Tensor::empty(dev.shape(), dev.dtype(), k::cpu);
  k::memory::copy(host.data_ptr(), k::cpu, dev.data_ptr(), dev.device(), dev.nbytes(), nullptr);
  k::memory::synchronize(nullptr, dev.device());
  return host;
}

void check_cuda(const Tensor& a, const Tensor& b, k::dtype out_dt, Tol tol) {
  Tensor out = Tensor::empty(out_shape(a, b), out_dt, k::cuda);
  rt::cuda_matmul(to_cuda(a), to_cuda(b), out, nullptr);
  check_close(to_host(out), reference(a, b), tol);
}

// cuBLASLt may split K and sum in another order: f32 gets a little more room than on the host.
Tol gpu_tolerance(k::dtype out) { return out == k::dtype::f32 ? Tol{1e-4, 1e-4} : tolerance(out); }

void check_cuda(const Tensor& a, const Tensor& b) {
  k::dtype dt = result_dtype(a, b);
  check_cuda(a, b, dt, gpu_tolerance(dt));
}

double gelu_tanh(double x) { return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }

}  // namespace

TEST_CASE("cuda_matmul: against the reference on the GPU" * needs_gpu()) {
  if (!rt::cublaslt::available()) {
    MESSAGE("skipped: no cuBLASLt");
    return;
  }
  SUBCASE("f32 shapes") {
    check_cuda(random({1, 1}), random({1, 1}));
    check_cuda(random({37, 129}), random({129, 65}));
    check_cuda(random({64, 64}), random({64, 64}));
    check_cuda(random({150, 300}), random({300, 520}));
  }
  SUBCASE("batched and broadcast") {
    check_cuda(random({3, 17, 33}), random({3, 33, 9}));
    check_cuda(random({4, 5, 7}), random({7, 6}));
    check_cuda(random({5, 7}), random({4, 7, 6}));
    check_cuda(random({1, 5, 7}), random({3, 7, 6}));
  }
  SUBCASE("transposed and strided") {
    check_cuda(random({37, 65}), random_transposed(65, 129));
    check_cuda(random_transposed(37, 65), random_transposed(65, 129));
    check_cuda(random_view({9, 11}, k::f32, {40, 2}, 3), random_view({11, 13}, k::f32, {3, 50}, 1));
    check_cuda(random_view({3, 17, 33}, k::f32, {17 * 33, 1, 17}), random_view({3, 33, 9}, k::f32, {1, 3, 99}));
  }
  SUBCASE("dtypes") {
    for (k::dtype dt : {k::f64, k::f16, k::bf16}) {
      CAPTURE(k::name(dt));
      check_cuda(random({37, 65}, dt), random({65, 129}, dt));
      check_cuda(random({3, 17, 33}, dt), random_transposed(33, 9, dt));
    }
    check_cuda(random({13, 21}, k::f16), random({21, 8}, k::f32));
    check_cuda(random({13, 21}, k::f16), random({21, 8}, k::bf16));
    check_cuda(random({13, 21}, k::f16), random({21, 8}, k::f16), k::f32, gpu_tolerance(k::f32));
    check_cuda(random({13, 21}, k::f64), random({21, 8}, k::f16));
  }
  SUBCASE("16-bit sizes off 8: padded copies (plan_padding)") {
    // Sizes whose flops pay for the copies: every padded operand and output, transposed or not,
    // f32 and 16-bit outputs, a bias of a padded length, and a strided output.
    for (k::dtype dt : {k::bf16, k::f16}) {
      CAPTURE(k::name(dt));
      check_cuda(random({301, 1003}, dt), random({1003, 517}, dt));
      check_cuda(random({301, 1003}, dt), random({1003, 517}, dt), k::f32, {2e-3, 2e-3});
      check_cuda(random({517, 1000}, dt), random_transposed(1000, 301, dt));
      check_cuda(random_transposed(299, 1001, dt), random({1001, 515}, dt), k::f32, {2e-3, 2e-3});
    }
    // Columns longer than a copy block's 2048 elements: the padding kernel's vector path, on the
    // columns whose addresses allow it (every eighth of an odd leading dimension).
    check_cuda(random({301, 1003}, k::bf16), random({1003, 2053}, k::bf16), k::f32, {2e-3, 2e-3});
    Tensor a = random({301, 1003}, k::bf16), w = random({1003, 517}, k::bf16), bias = random({517});
    std::vector<double> want = reference(a, w);
    for (std::size_t i = 0; i < want.size(); ++i) want[i] += at(bias, {static_cast<std::int64_t>(i % 517)});
    Tensor out = Tensor::empty({301, 517}, k::f32, k::cuda), bias_dev = to_cuda(bias);
    rt::cuda_matmul_epilogue(to_cuda(a), to_cuda(w), &bias_dev, rt::Epilogue::bias, out, nullptr);
    check_close(to_host(out), want, {2e-3, 2e-3});
    Tensor storage = Tensor::empty({301 * 520}, k::f32, k::cuda);
    rt::cuda_matmul(to_cuda(a), to_cuda(w), storage.as_strided({301, 517}, {520, 1}, 0), nullptr);
    Tensor host = to_host(storage).as_strided({301, 517}, {520, 1}, 0);
    check_close(host, reference(a, w), {2e-3, 2e-3});
  }
  SUBCASE("strided output and K = 0") {
    Tensor a = random({7, 5}), b = random({5, 6});
    Tensor storage = Tensor::empty({42}, k::f32, k::cuda);
    rt::cuda_matmul(to_cuda(a), to_cuda(b), storage.as_strided({7, 6}, {1, 7}, 0), nullptr);
    Tensor host = to_host(storage).as_strided({7, 6}, {1, 7}, 0);
    check_close(host, reference(a, b), gpu_tolerance(k::f32));

    Tensor z = Tensor::empty({2, 4, 5}, k::f32, k::cuda);
    rt::cuda_matmul(to_cuda(random({2, 4, 0})), to_cuda(random({0, 5})), z, nullptr);
    check_close(to_host(z), std::vector<double>(40, 0.0), gpu_tolerance(k::f32));
  }
  SUBCASE("epilogues") {
    Tensor a = random({3, 17, 33}), w = random_transposed(33, 40), bias = random({40});
    std::vector<double> mm = reference(a, w);
    for (rt::Epilogue e : {rt::Epilogue::bias, rt::Epilogue::relu_bias, rt::Epilogue::gelu_tanh_bias,
                           rt::Epilogue::relu, rt::Epilogue::gelu_tanh}) {
      CAPTURE(static_cast<int>(e));
      std::vector<double> want = mm;
      for (std::size_t i = 0; i < want.size(); ++i) {
        double x = want[i] + (rt::epilogue_has_bias(e) ? at(bias, {static_cast<std::int64_t>(i % 40)}) : 0.0);
        if (e == rt::Epilogue::relu_bias || e == rt::Epilogue::relu) x = std::max(x, 0.0);
        if (e == rt::Epilogue::gelu_tanh_bias || e == rt::Epilogue::gelu_tanh) x = gelu_tanh(x);
        want[i] = x;
      }
      Tensor out = Tensor::empty({3, 17, 40}, k::f32, k::cuda);
      Tensor bias_dev = to_cuda(bias);
      rt::cuda_matmul_epilogue(to_cuda(a), to_cuda(w), &bias_dev, e, out, nullptr);
      check_close(to_host(out), want, {1e-4, 1e-4});
    }
    Tensor out = Tensor::empty({3, 17, 40}, k::f32, k::cuda);
    CHECK_THROWS_AS(rt::cuda_matmul_epilogue(to_cuda(a), to_cuda(w), nullptr, rt::Epilogue::bias, out, nullptr),
                    k::shape_error);
  }
  SUBCASE("gelu's backward: DGELU reads the pre-activation, BGRAD writes the columns' sums (bf16)") {
    // out = (a @ w) * gelu_tanh'(pre), the pre-activation a GELU_AUX step keeps; the bias gradient
    // is out's sum over its rows (cuBLASLt sums its f32 values, before rounding to bf16).
    const std::int64_t M = 301, K = 1003, N = 520;  // N a multiple of 8 (the aux's leading dimension)
    Tensor a = random({M, K}, k::bf16), w = random({K, N}, k::bf16), pre = random({M, N}, k::bf16);
    // A column's sum may nearly cancel (|sum| ~ 1 of terms ~ 30): cuBLASLt may sum the 16-bit
    // values, each rounded by up to 2^-8 of itself, so a sum's slack is 2^-8 of its terms' |sum|
    // (an algorithm that sums the f32 values is within it too; a wrong sum is off by far more).
    std::vector<double> want = reference(a, w), sums(static_cast<std::size_t>(N), 0.0), slack(sums);
    for (std::int64_t i = 0; i < M * N; ++i) {
      const double x = at(pre, {i / N, i % N}), c = 0.7978845608028654;
      const double t = std::tanh(c * (x + 0.044715 * x * x * x));
      want[static_cast<std::size_t>(i)] *= 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x);
      sums[static_cast<std::size_t>(i % N)] += want[static_cast<std::size_t>(i)];
      slack[static_cast<std::size_t>(i % N)] += std::abs(want[static_cast<std::size_t>(i)]) / 256;
    }
    Tensor pre_dev = to_cuda(pre);
    Tensor out = Tensor::empty({M, N}, k::bf16, k::cuda), grad = Tensor::empty({N}, k::bf16, k::cuda);
    rt::cuda_matmul_epilogue(to_cuda(a), to_cuda(w), nullptr, rt::Epilogue::dgelu_tanh, out, nullptr, false, &pre_dev);
    {
      INFO("DGELU's product");
      check_close(to_host(out), want, {0.05, 1e-2});
    }
    Tensor out2 = Tensor::empty({M, N}, k::bf16, k::cuda);
    rt::cuda_matmul_epilogue(to_cuda(a), to_cuda(w), &grad, rt::Epilogue::dgelu_tanh_bgrad, out2, nullptr, false,
                             &pre_dev);
    {
      INFO("DGELU_BGRAD's product");
      check_close(to_host(out2), want, {0.05, 1e-2});
    }
    INFO("BGRAD's column sums");
    check_close(to_host(grad), sums, {1e-2, 1e-2}, slack);
    // The columns' sums need a contiguous vector of N in out's dtype.
    Tensor wrong = Tensor::empty({N}, k::f32, k::cuda);
    CHECK_THROWS_AS(rt::cuda_matmul_epilogue(to_cuda(a), to_cuda(w), &wrong, rt::Epilogue::dgelu_tanh_bgrad, out2,
                                             nullptr, false, &pre_dev),
                    k::shape_error);
  }
}

// Host threads queueing matmuls on one stream (the default stream) take turns with its workspace:
// cuBLASLt splits K for a thin product and passes partial sums through the workspace, so two
// interleaved matmuls would read each other's partials (the random-graph test found [1, 1] products
// wrong when several programs ran at once).
TEST_CASE("cuda_matmul: threads sharing the default stream" * needs_gpu()) {
  if (!rt::cublaslt::available()) {
    MESSAGE("skipped: no cuBLASLt");
    return;
  }
  struct Problem {
    Tensor a, b;
    std::vector<double> want;
  };
  std::vector<Problem> problems;
  for (auto [m, kk, n] : {std::array<std::int64_t, 3>{1, 4099, 1}, {1, 2047, 1025}, {3, 8191, 2}, {1, 1537, 7}}) {
    Problem p{random({m, kk}), random({kk, n}), {}};
    p.want = reference(p.a, p.b);
    problems.push_back(std::move(p));
  }
  constexpr int threads = 8, rounds = 25;
  std::vector<std::vector<Tensor>> results(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int r = 0; r < rounds; ++r) {
        const Problem& p = problems[static_cast<std::size_t>((t + r) % problems.size())];
        Tensor out = Tensor::empty(out_shape(p.a, p.b), k::f32, k::cuda);
        rt::cuda_matmul(to_cuda(p.a), to_cuda(p.b), out, nullptr);
        results[static_cast<std::size_t>(t)].push_back(out);
      }
    });
  for (auto& th : pool) th.join();
  for (int t = 0; t < threads; ++t)
    for (int r = 0; r < rounds; ++r) {
      CAPTURE(t);
      CAPTURE(r);
      const Problem& p = problems[static_cast<std::size_t>((t + r) % problems.size())];
      check_close(to_host(results[static_cast<std::size_t>(t)][static_cast<std::size_t>(r)]), p.want,
                  {1e-3, 1e-3});  // interleaved partials are off by O(1)
    }
}

// ---- kiln's GEMM template (codegen/gemm_template.hpp on the prelude's `dot`) ----------------------

namespace {

// out = e(a @ b (+ bias)) in f64 from the stored values, with e's aux: the pre-activation a *_aux
// epilogue stores, or the one dgelu_tanh reads (pre, given).
std::vector<double> epilogue_reference(const Tensor& a, const Tensor& b, const Tensor* bias, rt::Epilogue e,
                                       const Tensor* pre, std::vector<double>* kept) {
  std::vector<double> want = reference(a, b);
  const std::int64_t N = b.shape()[b.dim() - 1];
  for (std::size_t i = 0; i < want.size(); ++i) {
    const std::int64_t n = static_cast<std::int64_t>(i) % N;
    double x = want[i] + (rt::epilogue_has_bias(e) ? at(*bias, {n}) : 0.0);
    if (kept) kept->push_back(x);
    if (e == rt::Epilogue::relu || e == rt::Epilogue::relu_bias) x = std::max(x, 0.0);
    if (e == rt::Epilogue::gelu_tanh || e == rt::Epilogue::gelu_tanh_bias || e == rt::Epilogue::gelu_tanh_aux ||
        e == rt::Epilogue::gelu_tanh_aux_bias)
      x = 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
    if (e == rt::Epilogue::dgelu_tanh) {
      const double u = at(*pre, {static_cast<std::int64_t>(i) / N, n}), c = 0.7978845608028654;
      const double t = std::tanh(c * (u + 0.044715 * u * u * u));
      x *= 0.5 * (1 + t) + 0.5 * u * (1 - t * t) * c * (1 + 3 * 0.044715 * u * u);
    }
    want[i] = x;
  }
  return want;
}

// The template's result on `device` (garbage in the output first) against the reference. Epilogues
// that read or keep the pre-activation take a [M, N] a and b (aux is 2-D here).
// While set, check_dot on a GPU only lists the kernel it would run (compiled at once below).
std::vector<k::codegen::GemmKernel>* dot_listing = nullptr;

void check_dot(const Tensor& a, const Tensor& b, k::dtype out_dt, rt::Epilogue e, k::Device device,
               const rt::DotBlocking& blocking) {
  if (dot_listing && device.is_cuda()) {
    const Tensor a_d = to_cuda(a), b_d = to_cuda(b), out_d = Tensor::empty(out_shape(a, b), out_dt, k::cuda);
    dot_listing->push_back(
        rt::dot_matmul_kernel(rt::matmul_geometry(a_d, b_d, out_d, "matmul"), a_d, b_d, out_d, e, blocking));
    return;
  }
  const Dims shape = out_shape(a, b);
  const std::int64_t N = shape[shape.size() - 1];
  const Tensor bias = random({N}, out_dt), pre = random(shape, out_dt);
  const bool aux = rt::epilogue_has_aux(e), keeps = aux && e != rt::Epilogue::dgelu_tanh;
  std::vector<double> kept;
  const std::vector<double> want = epilogue_reference(a, b, &bias, e, &pre, keeps ? &kept : nullptr);
  Tensor out_host = Tensor::empty(shape, out_dt, k::cpu);
  for (std::int64_t i = 0; i < out_host.numel(); ++i) k::store_from_double(out_host.data_ptr(), out_dt, i, 12345.0);
  const bool gpu = device.is_cuda();
  Tensor out = gpu ? to_cuda(out_host) : out_host, aux_t = aux ? (gpu ? to_cuda(pre) : pre) : Tensor();
  const Tensor bias_d = gpu ? to_cuda(bias) : bias;
  rt::dot_matmul(gpu ? to_cuda(a) : a, gpu ? to_cuda(b) : b, &bias_d, e, out, nullptr, aux ? &aux_t : nullptr,
                 blocking);
  // f32 products: the template's f32 sums in another order than the reference (and TF32 is off).
  const double K = static_cast<double>(a.shape()[a.dim() - 1]);
  std::vector<double> rounding = reference(a, b, true);
  for (double& r : rounding) r *= 2 * std::sqrt(K) * 0x1p-24 * (e == rt::Epilogue::dgelu_tanh ? 2 : 1);
  const Tol tol = e == rt::Epilogue::none || e == rt::Epilogue::bias ? tolerance(out_dt) : Tol{2e-2, 2e-2};
  check_close(gpu ? to_host(out) : out, want, out_dt == k::f32 ? Tol{1e-4, 1e-4} : tol, rounding);
  if (keeps) {
    INFO("the kept pre-activation");
    check_close(gpu ? to_host(aux_t) : aux_t, kept, out_dt == k::f32 ? Tol{1e-4, 1e-4} : tolerance(out_dt), rounding);
  }
}

void check_dot_cases(k::Device device, const rt::DotBlocking& blocking = {}) {
  using E = rt::Epilogue;
  auto check_dot = [&](const Tensor& a, const Tensor& b, k::dtype out_dt, E e, k::Device d) {
    ::check_dot(a, b, out_dt, e, d, blocking);
  };
  SUBCASE("dtypes and odd sizes") {
    for (k::dtype dt : {k::f32, k::bf16, k::f16}) {
      CAPTURE(k::name(dt));
      check_dot(random({37, 29}, dt), random({29, 53}, dt), dt, E::none, device);
      check_dot(random({130, 75}, dt), random({75, 131}, dt), dt, E::bias, device);
      check_dot(random({1, 200}, dt), random({200, 5}, dt), dt, E::none, device);
      check_dot(random({3, 0}, dt), random({0, 4}, dt), dt, E::bias, device);  // K = 0: the bias alone
    }
    check_dot(random({37, 29}, k::bf16), random({29, 53}, k::bf16), k::f32, E::none, device);  // f32 out
  }
  SUBCASE("layouts: transposed, strided, batched and broadcast") {
    for (k::dtype dt : {k::bf16, k::f32}) {
      CAPTURE(k::name(dt));
      check_dot(random_transposed(70, 96, dt), random({96, 64}, dt), dt, E::none, device);   // a M-contiguous
      check_dot(random({70, 96}, dt), random_transposed(96, 136, dt), dt, E::none, device);  // b K-contiguous
      check_dot(random_transposed(65, 33, dt), random_transposed(33, 72, dt), dt, E::none, device);
      check_dot(random_view({9, 11}, dt, {40, 2}, 3), random_view({11, 13}, dt, {3, 50}, 1), dt, E::none, device);
      check_dot(random({3, 17, 40}, dt), random({40, 24}, dt), dt, E::bias, device);  // b broadcast
      check_dot(random({17, 40}, dt), random({2, 40, 24}, dt), dt, E::none, device);  // a broadcast
      check_dot(random_view({3, 17, 33}, dt, {17 * 33, 1, 17}), random_view({3, 33, 9}, dt, {1, 3, 99}), dt, E::none,
                device);
    }
  }
  SUBCASE("epilogues") {
    for (E e : {E::relu, E::relu_bias, E::gelu_tanh_bias, E::gelu_tanh_aux_bias, E::dgelu_tanh}) {
      CAPTURE(static_cast<int>(e));
      check_dot(random({45, 70}, k::bf16), random_transposed(70, 40, k::bf16), k::bf16, e, device);
    }
  }
}

}  // namespace

TEST_CASE("dot: kiln's GEMM template on the CPU against f64 products (odd sizes, layouts, epilogues)") {
  check_dot_cases(k::cpu);
  SUBCASE("a bias in another dtype and layout is read as out's (a converted copy)") {
    const Tensor a = random({21, 30}, k::bf16), b = random({30, 17}, k::bf16);
    const Tensor bias = random_view({17}, k::f64, {3}, 2);  // every third value of an f64 vector
    std::vector<double> want = reference(a, b);
    for (std::size_t i = 0; i < want.size(); ++i) want[i] += at(bias, {static_cast<std::int64_t>(i % 17)});
    Tensor out = Tensor::empty({21, 17}, k::f32, k::cpu);
    rt::dot_matmul(a, b, &bias, rt::Epilogue::bias, out);
    check_close(out, want, {1e-4, 1e-4});
  }
  SUBCASE("what the template does not take is an error naming it") {
    Tensor out = Tensor::empty({3, 5}, k::f32, k::cpu);
    CHECK_THROWS_AS(rt::dot_matmul(random({3, 4}, k::f64), random({4, 5}, k::f64), nullptr, rt::Epilogue::none, out),
                    k::dtype_error);
    CHECK_THROWS_AS(rt::dot_matmul(random({3, 4}), random({4, 5}), nullptr, rt::Epilogue::bias, out), k::shape_error);
  }
}

TEST_CASE("dot: the GEMM template's tile layouts and copies follow the operands' strides") {
  // (what a GPU kernel is chosen for: the host's loops read every layout alike)
  auto layout = [](const Tensor& a, const Tensor& b) {
    Tensor out = Tensor::empty(out_shape(a, b), a.dtype(), k::cpu);
    return rt::dot_layout(rt::matmul_geometry(a, b, out, "matmul"), a.dtype(), a.data_ptr(), b.data_ptr());
  };
  auto is = [](rt::DotLayout l, bool a_k, bool b_k, bool async) {
    return l.a_k == a_k && l.b_k == b_k && l.async == async;
  };
  CHECK(is(layout(random({64, 96}, k::bf16), random({96, 40}, k::bf16)), true, false, true));  // b [K, N] row-major
  CHECK(
      is(layout(random({64, 96}, k::bf16), random_transposed(96, 40, k::bf16)), true, true, true));  // linear's weight
  CHECK(is(layout(random_transposed(64, 96, k::bf16), random({96, 40}, k::bf16)), false, false, true));
  CHECK(is(layout(random({64, 36}, k::f32), random({36, 40}, k::f32)), true, false, true));  // rows of 144 bytes
  // Rows off 16 bytes (K = 37 bf16), a first element off them, a step along K: element by element.
  CHECK(is(layout(random({64, 37}, k::bf16), random({37, 40}, k::bf16)), true, false, false));
  CHECK(is(layout(random_view({64, 96}, k::bf16, {96, 1}, 3), random({96, 40}, k::bf16)), true, false, false));
  CHECK(is(layout(random_view({9, 11}, k::bf16, {40, 2}), random({11, 16}, k::bf16)), true, false, false));
  // Batches: a broadcast b (batch stride 0) keeps the copies; a batch stride off 16 bytes does not.
  CHECK(is(layout(random({3, 16, 32}, k::bf16), random({32, 16}, k::bf16)), true, false, true));
  CHECK(is(layout(random_view({2, 16, 32}, k::bf16, {516, 32, 1}), random({32, 16}, k::bf16)), true, false, false));
  // TMA's copies (Hopper's wgmma kernels): cp.async's layouts whose batches lie past a whole operand
  // or are broadcast, with K > 0; a permuted batch keeps cp.async.
  auto tma = [&](const Tensor& a, const Tensor& b) {
    Tensor out = Tensor::empty(out_shape(a, b), a.dtype(), k::cpu);
    const rt::MatmulGeometry g = rt::matmul_geometry(a, b, out, "matmul");
    return rt::dot_tma_layout(g, rt::dot_layout(g, a.dtype(), a.data_ptr(), b.data_ptr()));
  };
  CHECK(tma(random({64, 96}, k::bf16), random_transposed(96, 40, k::bf16)));
  CHECK(tma(random({3, 16, 32}, k::bf16), random({32, 16}, k::bf16)));  // b broadcast
  CHECK(tma(random({3, 16, 32}, k::bf16), random({3, 32, 16}, k::bf16)));
  CHECK_FALSE(tma(random_view({3, 16, 32}, k::bf16, {32, 96, 1}), random({32, 16}, k::bf16)));  // batch inside rows
  CHECK_FALSE(tma(random({64, 37}, k::bf16), random({37, 40}, k::bf16)));                       // no cp.async
  CHECK_FALSE(tma(random({3, 0}, k::bf16), random({0, 4}, k::bf16)));                           // K = 0
}

TEST_CASE("dot: the GEMM template's GPU kernels compile under NVRTC (sm_80, sm_90a)") {
  // Every path of the device `dot`: 16-bit by ldmatrix both ways and by wgmma, f32 by TF32 and by FMA, cp.async
  // and element-by-element staging, each epilogue's statements.
  std::vector<k::codegen::GemmKernel> kernels;
  k::codegen::GemmKernel g;
  kernels.push_back(g);  // bf16, A K-contiguous, B N-contiguous, cp.async
  g.dt = g.out_dt = k::f16, g.a_k = false, g.b_k = true, g.bias = true, g.act = k::schedule::Activation::gelu_tanh,
  g.aux = true, g.warps_n = 4;
  kernels.push_back(g);
  g = {};
  g.dt = g.out_dt = k::f32, g.tf32 = true, g.async = false, g.act = k::schedule::Activation::dgelu_tanh;
  kernels.push_back(g);
  g.tf32 = false, g.a_k = false, g.bm = 64, g.bn = 64, g.stages = 4, g.act = k::schedule::Activation::relu;
  kernels.push_back(g);
  g = {};  // Hopper's warpgroup MMA, both layouts of each operand
  g.wgmma = true, g.warps_m = 8, g.warps_n = 1, g.stages = 4;
  kernels.push_back(g);
  g.a_k = false, g.b_k = true, g.bn = 256, g.stages = 3, g.dt = g.out_dt = k::f16, g.bias = true;
  kernels.push_back(g);
  g.overlap = true, g.stages = 4;
  kernels.push_back(g);
  g.overlap = false, g.tma = true;  // TMA from a producer warpgroup: M- and K-contiguous A, K- and N-contiguous B
  kernels.push_back(g);
  g.a_k = true, g.b_k = false, g.bn = 128, g.stages = 6, g.dt = g.out_dt = k::bf16, g.bias = false;
  kernels.push_back(g);
  for (const auto& kern : kernels)
    for (const char* arch : {"sm_80", "sm_90a"}) {
      if (kern.wgmma && std::string(arch) != "sm_90a") continue;
      CAPTURE(kern.name());
      CAPTURE(arch);
      std::vector<char> cubin = rt::compile_cubin(k::codegen::gemm_kernel_source(kern), kern.name(), arch);
      CHECK(std::string(cubin.begin(), cubin.end()).find(kern.name()) != std::string::npos);
    }
}

// Layouts TMA copies (rows on 16 bytes), with tails of M, N and K, K over more steps than stages,
// batches and broadcast batches, every epilogue: each kernel is the TMA one.
void check_dot_tma_cases(const rt::DotBlocking& blocking) {
  using E = rt::Epilogue;
  auto check = [&](const Tensor& a, const Tensor& b, k::dtype out_dt, E e) {
    Tensor out = Tensor::empty(out_shape(a, b), out_dt, k::cpu);
    const Tensor a_d = to_cuda(a), b_d = to_cuda(b);
    CHECK(rt::dot_matmul_kernel(rt::matmul_geometry(a_d, b_d, out, "matmul"), a_d, b_d, to_cuda(out), e, blocking).tma);
    check_dot(a, b, out_dt, e, k::Device(k::cuda), blocking);
  };
  for (k::dtype dt : {k::bf16, k::f16}) {
    CAPTURE(k::name(dt));
    check(random({200, 136}, dt), random({136, 264}, dt), dt, E::bias);
    check(random({200, 136}, dt), random_transposed(136, 264, dt), dt, E::none);  // linear's weight
    check(random_transposed(200, 136, dt), random({136, 264}, dt), dt, E::none);  // a M-contiguous
    check(random_transposed(200, 136, dt), random_transposed(136, 72, dt), dt, E::gelu_tanh_bias);
    check(random({130, 1032}, dt), random({1032, 72}, dt), k::f32, E::none);  // 17 steps of K
    check(random({3, 72, 136}, dt), random({3, 136, 80}, dt), dt, E::none);
    check(random({3, 72, 136}, dt), random({136, 80}, dt), dt, E::bias);  // b broadcast over the batch
    check(random({72, 136}, dt), random({2, 136, 80}, dt), dt, E::none);  // a broadcast
  }
  for (E e : {E::relu_bias, E::gelu_tanh_bias, E::gelu_tanh_aux_bias, E::dgelu_tanh}) {
    CAPTURE(static_cast<int>(e));
    check(random({45, 72}, k::bf16), random_transposed(72, 40, k::bf16), k::bf16, e);
  }
}

TEST_CASE("dot: kiln's GEMM template on tensor cores against f64 products (cuda)" * needs_gpu()) {
  std::vector<rt::DotBlocking> blockings{rt::DotBlocking{}, rt::DotBlocking{64, 64, 2, 2, 4},
                                         rt::DotBlocking{128, 256, 2, 4, 3}};
  if (k::driver::arch(0) == "sm_90a")  // Hopper's warpgroup MMA (f32 keeps mma.sync or FMA)
    blockings.insert(
        blockings.end(),
        {rt::DotBlocking{128, 128, 8, 1, 4, true}, rt::DotBlocking{128, 256, 8, 1, 3, true},
         rt::DotBlocking{128, 256, 8, 1, 4, true, true}, rt::DotBlocking{128, 128, 8, 1, 3, true, true},
         rt::DotBlocking{128, 128, 8, 1, 6, true, false, true}, rt::DotBlocking{128, 256, 8, 1, 4, true, false, true}});
  auto each = [&] {
    for (const rt::DotBlocking& blocking : blockings) {
      CAPTURE(blocking.str());
      check_dot_cases(k::Device(k::cuda), blocking);
      if (blocking.tma) check_dot_tma_cases(blocking);
    }
  };
  // This pass's kernels (a subcase's, over every blocking: hundreds of variants in all, minutes of
  // NVRTC one after another) compiled at once into the disk cache, then run.
  std::vector<k::codegen::GemmKernel> kernels;
  dot_listing = &kernels;
  each();
  dot_listing = nullptr;
  std::sort(kernels.begin(), kernels.end(), [](const auto& x, const auto& y) { return x.name() < y.name(); });
  kernels.erase(
      std::unique(kernels.begin(), kernels.end(), [](const auto& x, const auto& y) { return x.name() == y.name(); }),
      kernels.end());
  rt::compile_gemm_kernels(kernels, k::driver::arch(0));
  each();
}

TEST_CASE("cuda_matmul: autotuning times the GEMM template against cuBLASLt and keeps the faster (cuda)" *
          needs_gpu()) {
  // Whichever wins, every call's values are the product's: the tuning call (which ran both), and the
  // calls after it (the kept choice), here with bias + tanh-gelu keeping its pre-activation.
  ScopedEnv on("KILN_TUNE_GEMM_TEMPLATE", "1");  // (read at each autotuned call)
  const std::int64_t M = 300, K = 520, N = 264;
  const Tensor a = random({M, K}, k::bf16), w = random_transposed(K, N, k::bf16), bias = random({N}, k::bf16);
  std::vector<double> kept;
  const std::vector<double> want = epilogue_reference(a, w, &bias, rt::Epilogue::gelu_tanh_aux_bias, nullptr, &kept);
  const Tensor a_d = to_cuda(a), w_d = to_cuda(w), bias_d = to_cuda(bias);
  for (int call = 0; call < 3; ++call) {
    CAPTURE(call);
    Tensor out = Tensor::empty({M, N}, k::bf16, k::cuda), pre = Tensor::empty({M, N}, k::bf16, k::cuda);
    rt::cuda_matmul_epilogue(a_d, w_d, &bias_d, rt::Epilogue::gelu_tanh_aux_bias, out, nullptr, true, &pre);
    check_close(to_host(out), want, {2e-2, 2e-2});
    check_close(to_host(pre), kept, tolerance(k::bf16));
  }
}
