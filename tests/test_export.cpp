// k::export_kernels: exporting needs no GPU (CPU tensors give the shapes), the exported source
// builds with plain nvcc, its launcher refuses sizes it was not exported for (with an error code
// and a message, before any CUDA call: this part runs without a GPU too), and on a GPU the
// exported kernels compute what kiln computes. Parts that need nvcc or a GPU skip visibly.
#include <dlfcn.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "have_gpu.hpp"

namespace k = kiln;
namespace fs = std::filesystem;

namespace {

// The functions exported below.
inline constexpr auto residual_rms_norm = [](auto x, auto r, auto w) { return k::rms_norm(x + r, w); };
inline constexpr auto row_softmax = [](auto x) { return k::softmax(x, -1); };
inline constexpr auto sgd_step = [](auto p, auto g) { return k::assign(p, p - g * 0.01f); };
inline constexpr auto sum_scale_same = [](auto x) { return std::make_tuple(k::sum(x), x * 2.0f, x); };

// Everything these tests write, removed when the test binary exits.
const fs::path& scratch_root() {
  static const struct Root {
    fs::path path = fs::temp_directory_path() / ("kiln-export-test-" + std::to_string(getpid()));
    ~Root() {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  } root;
  return root.path;
}

fs::path fresh_dir(const std::string& name) {
  fs::path dir = scratch_root() / name;
  fs::remove_all(dir);
  return dir;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool have_nvcc() {
  if (std::system("command -v nvcc > /dev/null 2>&1") == 0) return true;
  MESSAGE("skipped: nvcc is not on PATH");
  return false;
}

// Runs a shell command; on failure its output becomes part of the test's message.
bool run(const std::string& command, const fs::path& log) {
  int rc = std::system((command + " > '" + log.string() + "' 2>&1").c_str());
  if (rc != 0) MESSAGE(command << "\n" << read_file(log));
  return rc == 0;
}

void check_files(const k::exported_kernels& e) {
  for (const auto& f : e.files()) CHECK_MESSAGE(fs::exists(f), f);
  std::string header = read_file(e.header), source = read_file(e.source), cubin = read_file(e.cubin);
  CHECK(header.find("int " + e.name + "(") != std::string::npos);
  CHECK(header.find("int " + e.name + "_workspace_bytes(") != std::string::npos);
  CHECK(header.find("const char* " + e.name + "_last_error()") != std::string::npos);
  CHECK(header.find("kiln/") == std::string::npos);  // no kiln include
  CHECK(source.find("#include \"" + e.name + ".h\"") != std::string::npos);
  CHECK(cubin.rfind("\x7f"
                    "ELF",
                    0) == 0);
  REQUIRE(!e.kernels.empty());
  for (const auto& kernel : e.kernels) CHECK(source.find(kernel) != std::string::npos);
}

}  // namespace

TEST_CASE("export: fused kernels from CPU tensors, without a GPU, build with plain nvcc") {
  auto x = k::randn({8, 1024}), r = k::randn({8, 1024}), w = k::randn({1024});
  const k::export_options sm90{.arch = "sm_90"};
  std::vector<k::exported_kernels> all;
  all.push_back(k::export_kernels(residual_rms_norm, x, r, w, fresh_dir("resnorm"), sm90));
  CHECK(all.back().name == "resnorm");  // the folder's name
  CHECK(all.back().arch == "sm_90");
  CHECK(all.back().kernels.size() == 1);
  all.push_back(k::export_kernels(row_softmax, k::randn({37, 1000}), fresh_dir("softmax"), sm90));
  float alpha = 0.5f;  // a captured scalar: a parameter of the launcher, its value the default
  auto chain = k::compile([&alpha](auto a, auto b) { return k::gelu(a * alpha + b) - 1.0f; });
  all.push_back(
      k::export_kernels(chain, x, w, fresh_dir("chain"), k::export_options{.name = "gelu_chain", .arch = "sm_90"}));
  CHECK(all.back().name == "gelu_chain");
  CHECK(read_file(all.back().header).find("double scalar0 = 0.5") != std::string::npos);
  auto dyn = k::compile([](auto a, auto b) { return k::layer_norm(a, b, b) * 2.0f; }, {.shapes = k::shapes::dynamic});
  all.push_back(k::export_kernels(dyn, x, w, fresh_dir("layer_norm_dyn"), sm90));
  CHECK(read_file(all.back().header).find("Symbolic sizes: s0 s1") != std::string::npos);
  auto p = k::randn({4096}, k::f16), g = k::randn({4096}, k::f16);
  all.push_back(k::export_kernels(sgd_step, p, g, fresh_dir("sgd"), sm90));
  std::string sgd_header = read_file(all.back().header);
  CHECK(sgd_header.find("__half* arg0,") != std::string::npos);  // updated in place: not const
  CHECK(sgd_header.find("updated in place") != std::string::npos);
  // Several outputs: a split reduction (its partial sums live in the workspace), a pointwise
  // result and an argument returned as it is (copied).
  all.push_back(k::export_kernels(sum_scale_same, k::randn({64, 4096}), fresh_dir("multi"), sm90));
  CHECK(all.back().kernels.size() >= 3);
  // A layer_norm backward whose dw and db are partial sums of its dx kernel: exactly a program a
  // row group (schedule/partials.hpp), whatever the device's size.
  auto ln_grads = k::compile(k::vjp([](auto a, auto ww, auto b) { return k::layer_norm(a, ww, b); }, k::wrt<0, 1, 2>));
  auto big = k::randn({16384, 2048}), dy = k::randn({16384, 2048}), w2 = k::randn({2048});
  all.push_back(k::export_kernels(ln_grads, big, w2, w2, dy, fresh_dir("ln_grads"), sm90));
  std::string ln_source = read_file(all.back().source);
  CHECK(ln_source.find("KILN_ROW_GROUP") != std::string::npos);
  CHECK(ln_source.find("programs = 256LL;") != std::string::npos);
  // Narrow rows, several to a block: the block's row slots fold their sums before one stores
  // them (the prelude's fold_row_slots, built by nvcc below).
  auto narrow = k::randn({8192, 768}), dy_narrow = k::randn({8192, 768}), w768 = k::randn({768});
  all.push_back(k::export_kernels(ln_grads, narrow, w768, w768, dy_narrow, fresh_dir("ln_grads_narrow"), sm90));
  std::string narrow_source = read_file(all.back().source);
  CHECK(narrow_source.find("fold_row_slots<ROWS, ROW_THREADS, RITERS>") != std::string::npos);
  CHECK(narrow_source.find("programs = 256LL;") != std::string::npos);
  // A held-row kernel with a blocks-an-SM bound (launch_config.hpp's min_blocks_for; the shapes
  // alone matter, so the tensors stay uninitialised): whether its
  // cubin took it is ptxas's to say (NVRTC 13: yes, 81 registers left alone), and the exported
  // source then defines KILN_HELD_BOUND as its cubin was compiled; nvcc builds it below.
  auto rms_bf16 = k::compile([](auto a, auto ww) { return k::rms_norm(a, ww); });
  all.push_back(k::export_kernels(rms_bf16, k::empty({8192, 16384}, k::bf16), k::empty({16384}, k::bf16),
                                  fresh_dir("rms_bf16"), k::export_options{.arch = "sm_90a"}));
  std::string rms_source = read_file(all.back().source);
  CHECK(rms_source.find("KILN_HELD_BOUNDS(512, 2) ") != std::string::npos);
  MESSAGE("rms_norm over 16384 bf16 columns: held-row bound "
          << std::string(rms_source.find("#define KILN_HELD_BOUND ") != std::string::npos ? "taken" : "not taken"));
  for (const auto& e : all) check_files(e);

  if (!have_nvcc()) return;
  for (const auto& e : all) {
    fs::path dir = e.source.parent_path();
    CHECK_MESSAGE(run("nvcc -std=c++17 -arch=" + e.arch + " -c '" + e.source.string() + "' -o '" +
                          (dir / "launcher.o").string() + "'",
                      dir / "nvcc.log"),
                  e.name);
  }
}

TEST_CASE("export: kernels whose tiles all start on a vector test their pointers' alignment once") {
  const k::export_options sm90{.arch = "sm_90"};
  auto f = k::compile([](auto x) { return k::relu(x * 2.0f); });
  std::string source = read_file(k::export_kernels(f, k::randn({4096}), fresh_dir("aligned"), sm90).source);
  CHECK(source.find("if (kiln::aligned16(in_ptr0, out_ptr0)) kiln_body(kiln::bool_c<true>{});") != std::string::npos);
  CHECK(source.find("kiln::load_contig<XVEC, KILN_ALIGNED>(in_ptr0, xoffset, xmask)") != std::string::npos);
  CHECK(source.find("kiln::store_contig<XVEC, KILN_ALIGNED>(out_ptr0, xoffset,") != std::string::npos);
  // A row kernel: the row's tiles start at 4096 * xindex + roffset, a multiple of the vector.
  source = read_file(k::export_kernels(row_softmax, k::randn({8, 4096}), fresh_dir("aligned_rows"), sm90).source);
  // softmax evaluates exp: its loads take the plain path (prelude's load16), relu's the read-only one.
  CHECK(source.find("kiln::load_contig<RVEC, KILN_ALIGNED, kiln::via::plain>(in_ptr0, 4096*xindex + roffset,") !=
        std::string::npos);
  // A slice starting at element 1 does not start on a vector: one body, every access tested.
  auto g = k::compile([](auto x) { return k::relu(k::slice(x, 0, 0, 4096) * 2.0f) + k::slice(x, 0, 1, 4097); });
  source = read_file(k::export_kernels(g, k::randn({4100}), fresh_dir("unaligned"), sm90).source);
  CHECK(source.find("kiln::load_contig<XVEC>(in_ptr0, xoffset + 1, xmask)") != std::string::npos);
  CHECK(source.find("kiln::load_contig<XVEC>(in_ptr0, xoffset, xmask)") != std::string::npos);
  CHECK(source.find(", KILN_ALIGNED>") == std::string::npos);
  CHECK(source.find("kiln_body") == std::string::npos);
  // The same with exp: every access tested, loads via::plain.
  auto h = k::compile([](auto x) { return k::exp(k::slice(x, 0, 1, 4097)); });
  source = read_file(k::export_kernels(h, k::randn({4100}), fresh_dir("unaligned_exp"), sm90).source);
  CHECK(source.find("kiln::load_contig<XVEC, kiln::align::test, kiln::via::plain>(in_ptr0, xoffset + 1, xmask)") !=
        std::string::npos);
  CHECK(source.find(", KILN_ALIGNED") == std::string::npos);
}

// GPU column reductions whose threads cover their reduced elements in a few steps hold them in
// registers: a softmax over dim 1 of [29, 12, 197] reads its input once, not once a loop, a thread
// holding a whole column; over [29, 32, 197] a column block's 8 threads hold 4 steps each
// (launch_config.hpp); a long column sum is looped. NVRTC compiles them on the way.
TEST_CASE("export: short columns held in registers, long ones looped") {
  const k::export_options sm90{.arch = "sm_90"};
  auto count = [](const std::string& s, const std::string& what) {
    std::size_t n = 0;
    for (auto at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
    return n;
  };
  for (auto dt : {k::f32, k::bf16}) {
    CAPTURE(dt);
    auto dim1 = k::compile([](auto x) { return k::softmax(x, 1); });
    std::string alone = read_file(k::export_kernels(dim1, k::randn({29, 12, 197}, dt), fresh_dir("held_alone"), sm90).source);
    CHECK(alone.find("ROW_THREADS = 1, RITERS = 12,") != std::string::npos);
    CHECK(count(alone, "(in_ptr0, ") == 1);  // a load, or a raw one (bf16: kept 16-bit)
    auto dim1b = k::compile([](auto x) { return k::softmax(x, 1); });
    std::string held = read_file(k::export_kernels(dim1b, k::randn({29, 32, 197}, dt), fresh_dir("held_cols"), sm90).source);
    CHECK(held.find("KILN_R_COLUMN_TILES(rindex)") != std::string::npos);
    CHECK(held.find("RT = 8, RITERS = 4;") != std::string::npos);
    CHECK(count(held, "(in_ptr0, ") == 1);
    auto sum0 = k::compile([](auto x) { return k::sum(x, 0); });
    std::string looped = read_file(k::export_kernels(sum0, k::randn({4000, 64}, dt), fresh_dir("long_cols"), sm90).source);
    CHECK(looped.find("KILN_R_COLUMN_STEPS(rindex)") != std::string::npos);
    CHECK(looped.find("RITERS =") == std::string::npos);
  }
}

// A GPU column block's last block loops in all its threads (across_columns' barriers), those past
// the kept elements too: a value the same for every lane of a thread's tile (s below, one a group
// of 64 columns) is one scalar load, tested against the kept elements there; unmasked, the last
// block read s[5], past s's 5 elements (NOTES item 116). KILN_TUNE_COLUMN_LANES=2 forces blocks on
// columns a thread would hold alone.
TEST_CASE("export: a column block's scalar loads stay inside the kept elements") {
  const k::export_options sm90{.arch = "sm_90"};
  auto f = k::compile([](auto x, auto s) { return k::softmax(x * s, 0); });
  std::string src = read_file(
      k::export_kernels(f, k::randn({50, 5, 64}), k::randn({1, 5, 1}), fresh_dir("column_scalar"), sm90).source);
  INFO(src);
  CHECK(src.find("KILN_COLUMN_BLOCK(xoffset)") != std::string::npos);
  CHECK(src.find("kiln::load(in_ptr1, xoffset / 64, xoffset < xnumel)") != std::string::npos);
  CHECK(src.find("kiln::load(in_ptr1, xoffset / 64, true)") == std::string::npos);
  ::setenv("KILN_TUNE_COLUMN_LANES", "2", 1);
  auto g = k::compile([](auto x) { return k::softmax(x, 1); });
  std::string blocks = read_file(k::export_kernels(g, k::randn({29, 12, 197}), fresh_dir("forced_blocks"), sm90).source);
  ::unsetenv("KILN_TUNE_COLUMN_LANES");
  CHECK(blocks.find("KILN_R_COLUMN_TILES(rindex)") != std::string::npos);
}

TEST_CASE("export: an exported launcher called with the wrong sizes returns an error code and a message") {
  if (!have_nvcc()) return;
  const k::export_options sm90{.arch = "sm_90"};
  auto x = k::randn({8, 1024}), w = k::randn({1024});
  fs::path dir = fresh_dir("wrong_sizes");
  auto fixed = k::export_kernels(residual_rms_norm, x, x, w, dir / "resnorm", sm90);
  auto dyn = k::compile([](auto a, auto b) { return k::rms_norm(a, b); }, {.shapes = k::shapes::dynamic});
  auto symbolic = k::export_kernels(dyn, x, w, dir / "rms_dyn", sm90);
  // A host program: every call below must return before touching CUDA (there may be no GPU).
  std::ofstream(dir / "driver.cpp") << R"(#include <cstdio>
#include "resnorm/resnorm.h"
#include "rms_dyn/rms_dyn.h"
int main() {
  float* p = reinterpret_cast<float*>(256);  // never dereferenced: every call fails its checks
  int64_t x[2] = {8, 1000}, w[1] = {1024}, good[2] = {8, 1024};
  std::printf("%d|%s\n", resnorm(p, x, p, good, p, w, p), resnorm_last_error());
  std::printf("%d|%s\n", resnorm(p, good, p, good, p, w, nullptr), resnorm_last_error());
  int64_t one[2] = {1, 1024}, dx[2] = {5, 64}, dw[1] = {32}, shape[2] = {0, 0};
  std::printf("%d|%s\n", rms_dyn(p, one, p, w, p), rms_dyn_last_error());
  std::printf("%d|%s\n", rms_dyn(p, dx, p, dw, p), rms_dyn_last_error());
  int status = rms_dyn_output_shape(0, dx, dx + 1, shape);
  std::printf("%d|%lld %lld\n", status, (long long)shape[0], (long long)shape[1]);
  std::printf("%d|%s\n", rms_dyn_output_shape(3, dx, dx + 1, shape), rms_dyn_last_error());
}
)";
  fs::path exe = dir / "driver";
  REQUIRE(run("cd '" + dir.string() +
                  "' && nvcc -std=c++17 -arch=sm_90 driver.cpp resnorm/resnorm.cu rms_dyn/rms_dyn.cu -o driver",
              dir / "nvcc.log"));
  REQUIRE(run("'" + exe.string() + "'", dir / "driver.out"));
  std::vector<std::string> lines;
  std::istringstream out(read_file(dir / "driver.out"));
  for (std::string line; std::getline(out, line);) lines.push_back(line);
  REQUIRE(lines.size() == 6);
  CHECK(lines[0] == "2|resnorm: arg0_shape[1] is 1000, but the kernels were exported for 1024");
  CHECK(lines[1] == "1|resnorm: out0 is null");
  CHECK(lines[2] == "2|rms_dyn: arg0_shape[0] is 1, but it is the symbolic size s0, exported for sizes >= 2");
  CHECK(lines[3] == "2|rms_dyn: arg1_shape[0] is 32, but arg0_shape[1] is 64: both are the size s1 and must be equal");
  CHECK(lines[4] == "0|5 64");
  CHECK(lines[5] == "1|rms_dyn_output_shape: output 3 does not exist (there are 1)");
  (void)fixed, (void)symbolic;
}

TEST_CASE("export: what cannot be exported says so") {
  auto a = k::randn({16, 32}), b = k::randn({32, 8});
  const k::export_options sm90{.arch = "sm_90"};
  auto mm = [](auto x, auto y) { return k::relu(k::matmul(x, y)); };
  CHECK_THROWS_WITH_AS(k::export_kernels(mm, a, b, fresh_dir("mm"), sm90), doctest::Contains("matmul step"), k::error);
  CHECK_THROWS_WITH_AS(
      k::export_kernels(row_softmax, a, fresh_dir("bad"), k::export_options{.name = "2fast", .arch = "sm_90"}),
      doctest::Contains("not a C identifier"), k::error);
  // A reshape's size is its own symbol, not an argument's: the launcher could not check it.
  auto flat = k::compile([](auto x) { return k::reshape(x, {-1}) * 2.0f; }, {.shapes = k::shapes::dynamic});
  CHECK_THROWS_WITH_AS(k::export_kernels(flat, a, fresh_dir("flat"), sm90), doctest::Contains("k::shapes::static_"),
                       k::error);
  // A slice from the end of a symbolic size starts at a position each call binds (a kernel argument
  // from the call's attributes): the launcher has none to bind it from.
  auto tail = k::compile([](auto x) { return k::slice(x, 1, -3, 1000) * 2.0f; }, {.shapes = k::shapes::dynamic});
  CHECK_THROWS_WITH_AS(k::export_kernels(tail, a, fresh_dir("tail"), sm90),
                       doctest::Contains("starts at a position that changes with the call"), k::error);
  auto add = [](auto x, auto y) { return x + y; };  // mixed devices (or, without a GPU, no CUDA device): a k::error
  CHECK_THROWS_AS(k::export_kernels(add, a, k::randn({16, 32}, k::f32, k::cuda), fresh_dir("mixed"), sm90), k::error);
}

namespace {

using ResNorm = int (*)(const float*, const std::int64_t*, const float*, const std::int64_t*, const float*,
                        const std::int64_t*, float*, double, void*, CUstream);
using Softmax = int (*)(const float*, const std::int64_t*, float*, void*, CUstream);
using Multi = int (*)(const float*, const std::int64_t*, float*, float*, float*, double, void*, CUstream);
using ErrorOf = const char* (*)();
using WorkspaceBytes = int (*)(const std::int64_t*, std::size_t*);

// Builds an exported program into a shared library and opens it (kept open: its kernels stay registered).
void* build_library(const k::exported_kernels& e) {
  fs::path dir = e.source.parent_path(), lib = dir / ("lib" + e.name + ".so");
  if (!run("nvcc -std=c++17 -arch=" + e.arch + " -shared -Xcompiler -fPIC '" + e.source.string() + "' -o '" +
               lib.string() + "'",
           dir / "nvcc.log"))
    return nullptr;
  void* handle = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) MESSAGE(dlerror());
  return handle;
}

template <class Fn>
Fn symbol(void* lib, const std::string& name) {
  return reinterpret_cast<Fn>(dlsym(lib, name.c_str()));
}

}  // namespace

TEST_CASE("export: exported kernels equal kiln's (GPU)" * needs_gpu()) {
  if (!have_nvcc()) return;
  auto x = k::randn({64, 4096}, k::f32, k::cuda, 1), r = k::randn({64, 4096}, k::f32, k::cuda, 2),
       w = k::randn({4096}, k::f32, k::cuda, 3);
  auto f = k::compile(residual_rms_norm);
  auto e = k::export_kernels(f, x, r, w, fresh_dir("gpu_resnorm"));
  void* lib = build_library(e);
  REQUIRE(lib != nullptr);
  auto launch = symbol<ResNorm>(lib, e.name);
  // Against the f64 oracle; and, since they are kiln's own kernels, equal to kiln's result too.
  k::Tensor expected = k::reference::eval(residual_rms_norm(x, r, w));
  k::Tensor kilns = f(x, r, w);
  k::Tensor out = k::zeros({64, 4096}, k::f32, k::cuda);
  std::int64_t xs[2] = {64, 4096}, ws[1] = {4096};
  REQUIRE(launch((const float*)x.data_ptr(), xs, (const float*)r.data_ptr(), xs, (const float*)w.data_ptr(), ws,
                 (float*)out.data_ptr(), 1e-6, nullptr, nullptr) == 0);
  k::synchronize();
  auto close = k::testing::allclose(out, expected, 1e-5, 1e-5);
  CHECK_MESSAGE(bool(close), close);
  auto same = k::testing::allclose(out, kilns, 1e-6, 1e-6);
  CHECK_MESSAGE(bool(same), same);

  // Wrong sizes: an error code and a message, and nothing launched (the output keeps its zeros).
  k::Tensor untouched = k::zeros({64, 4096}, k::f32, k::cuda);
  std::int64_t bad[2] = {64, 4095};
  CHECK(launch((const float*)x.data_ptr(), xs, (const float*)r.data_ptr(), bad, (const float*)w.data_ptr(), ws,
               (float*)untouched.data_ptr(), 1e-6, nullptr, nullptr) == 2);
  CHECK(std::string(symbol<ErrorOf>(lib, e.name + "_last_error")()).find("arg1_shape[1] is 4095") != std::string::npos);
  k::synchronize();
  CHECK(k::testing::allclose(untouched, k::zeros({64, 4096}), 0, 0));

  // Several outputs, intermediates in a workspace: the launcher's own (stream-ordered) or the caller's.
  auto multi = k::compile(sum_scale_same);
  auto em = k::export_kernels(multi, x, fresh_dir("gpu_multi"));
  void* lib_multi = build_library(em);
  REQUIRE(lib_multi != nullptr);
  auto launch_multi = symbol<Multi>(lib_multi, em.name);
  auto [total, doubled, copied] = k::reference::eval(sum_scale_same(x));
  std::size_t bytes = 0;
  REQUIRE(symbol<WorkspaceBytes>(lib_multi, em.name + "_workspace_bytes")(xs, &bytes) == 0);
  CHECK(bytes > 0);
  k::Tensor workspace = k::empty({static_cast<std::int64_t>(bytes)}, k::boolean, k::cuda);
  for (void* ws : {static_cast<void*>(nullptr), workspace.data_ptr()}) {
    k::Tensor o0 = k::zeros({}, k::f32, k::cuda), o1 = k::zeros({64, 4096}, k::f32, k::cuda),
              o2 = k::zeros({64, 4096}, k::f32, k::cuda);
    REQUIRE(launch_multi((const float*)x.data_ptr(), xs, (float*)o0.data_ptr(), (float*)o1.data_ptr(),
                         (float*)o2.data_ptr(), 2.0, ws, nullptr) == 0);
    k::synchronize();
    // A sum of 262144 f32 values near N(0, 1) against the f64 one: rounding of the partial sums.
    auto sum_close = k::testing::allclose(o0, total, 1e-5, 1e-2);
    CHECK_MESSAGE(bool(sum_close), sum_close);
    CHECK(k::testing::allclose(o1, doubled, 0, 0));
    CHECK(k::testing::allclose(o2, copied, 0, 0));
  }

  // Dynamic shapes: exported at one size, run at others.
  auto soft = k::compile(row_softmax, {.shapes = k::shapes::dynamic});
  auto es = k::export_kernels(soft, k::randn({8, 1000}, k::f32, k::cuda), fresh_dir("gpu_softmax"));
  void* lib_soft = build_library(es);
  REQUIRE(lib_soft != nullptr);
  auto launch_soft = symbol<Softmax>(lib_soft, es.name);
  for (auto shape : {k::Dims{8, 1000}, k::Dims{37, 129}, k::Dims{3, 40000}}) {
    auto in = k::randn(shape, k::f32, k::cuda, 4);
    k::Tensor got = k::zeros(shape, k::f32, k::cuda);
    std::int64_t s[2] = {shape[0], shape[1]};
    REQUIRE(launch_soft((const float*)in.data_ptr(), s, (float*)got.data_ptr(), nullptr, nullptr) == 0);
    k::synchronize();
    auto close = k::testing::allclose(got, k::reference::eval(row_softmax(in)), 1e-5, 1e-7);
    CHECK_MESSAGE(bool(close), shape.str() << ": " << close);
  }
}
