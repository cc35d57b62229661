// What the host compiler can do beyond plain C++, found once per process by building and loading
// small probes with the kernels' own command line: OpenMP (the kernels' thread team, host_team.hpp)
// and glibc's vector math library (codegen/prelude_cpu_math.hpp's prelude_libmvec). A probe that
// builds, loads and computes right is cached on disk under the toolchain's key; one that fails is
// tried again by the next process, so installing the library later is noticed.
#pragma once
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "../../codegen/prelude_cpu_math.hpp"
#include "../../core/config.hpp"
#include "disk_cache.hpp"
#include "hash.hpp"
#include "host_process.hpp"
#include "host_team.hpp"

namespace kiln::runtime {
namespace detail {

// `argv source -o probe.so libs` in a private directory: the shared object's bytes, or nothing when
// the compiler refuses (then `refused` is set) or cannot be run.
inline std::optional<std::vector<char>> build_probe(std::vector<std::string> argv, std::string_view source,
                                                    const std::vector<std::string>& libs, bool& refused) {
  std::filesystem::path dir = make_temp_dir();
  if (dir.empty() || !write_file(dir / "probe.cpp", source)) return std::nullopt;
  argv.insert(argv.end(), {"-o", (dir / "probe.so").string(), (dir / "probe.cpp").string()});
  argv.insert(argv.end(), libs.begin(), libs.end());
  std::optional<std::vector<char>> bytes;
  const int exit_code = run_process(argv).exit_code;
  refused = exit_code > 0;
  if (exit_code == 0) bytes = read_file(dir / "probe.so");
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return bytes;
}

// The loaded probe under `key`, from the disk cache or built now and cached once it loads and
// `works` says so; nullptr when it does not build, load or work (a loaded failure is closed).
// `refused`: the compiler rejected it or it computed wrong (not a missing temp dir or a failed load).
template <class Works>
void* probe_library(const std::string& key, const std::string& name, std::vector<std::string> argv,
                    std::string_view source, const std::vector<std::string>& libs, Works&& works, bool& refused) {
  refused = false;
  std::string errors;
  if (std::optional<std::vector<char>> cached = default_disk_cache().load(key, "probe"))
    if (void* probe = open_library(*cached, name, errors)) {
      if (works(probe)) return probe;
      ::dlclose(probe);
    }
  std::optional<std::vector<char>> bytes = build_probe(std::move(argv), source, libs, refused);
  void* probe = bytes ? open_library(*bytes, name, errors) : nullptr;
  if (probe && !works(probe)) {
    ::dlclose(probe);
    probe = nullptr;
    refused = true;
  }
  if (probe) default_disk_cache().store(key, "probe", *bytes);
  return probe;
}

// The probe's handle when `cxx flags -fopenmp` builds a shared object that also loads (the runtime
// library may be missing where the compiler accepts the flag), else nullptr. The probe stays loaded
// for good: that pins the OpenMP runtime, which must not be unloaded under kernels whose thread
// pools are parked in it, and its team functions serve host_parallel.hpp's host_team().
inline void* probe_openmp(std::vector<std::string> argv, const Digest& toolchain_key) {
  argv.push_back("-fopenmp");
  bool refused = false;  // not remembered: installing OpenMP later is noticed
  return probe_library(
      hex(Hasher().update("openmp-probe-v2").update(toolchain_key).digest()), "openmp_probe", std::move(argv),
      openmp_probe_source, {}, [](void*) { return true; }, refused);
}

// The level of prelude_libmvec this machine's glibc offers: 2 from glibc 2.35 (exp2f, log2f,
// log1pf and expm1f too), 1 from 2.22 (sinf, cosf, powf), 0 without (not x86-64 Linux, not glibc).
// KILN_LIBMVEC in the environment caps it: 0 turns it off (A/B runs, or libm's 1-ulp results
// wanted), 1 keeps glibc 2.22's functions only.
inline int libmvec_offered() {
  int level = 0;
#if defined(__x86_64__) && defined(__linux__)
  using Version = const char* (*)();
  auto version = reinterpret_cast<Version>(::dlsym(RTLD_DEFAULT, "gnu_get_libc_version"));
  int major = 0, minor = 0;
  if (version && std::sscanf(version(), "%d.%d", &major, &minor) == 2 && major >= 2)
    level = major > 2 || minor >= 35 ? 2 : minor >= 22 ? 1 : 0;
#endif
  if (const char* v = kiln::config::env("KILN_LIBMVEC"); v && *v >= '0' && *v <= '9')
    level = std::min(level, std::atoi(v));
  return level;
}

// A probe calling each declared variant as the kernels do (so the shared object needs exactly the
// symbols they will), checked against libm's f64 functions on the caller's inputs.
inline std::string libmvec_probe_source(int level) {
  return "#define KILN_LIBMVEC " + std::to_string(level) + "\n" + std::string(codegen::prelude_libmvec) + R"(
constexpr int L = KILN_MVEC_LANES;
static int kiln_probe_bad(kiln_mvec got, const float* x, const float* p, double (*want)(double, double)) {
  float y[L];
  __builtin_memcpy(y, &got, sizeof y);
  int bad = 0;
  for (int i = 0; i < L; ++i) {
    const double w = want(x[i], p[i]), scale = __builtin_fabs(w) > 1.0 ? __builtin_fabs(w) : 1.0;
    bad += !(__builtin_fabs((double)y[i] - w) <= 1e-6 * scale);
  }
  return bad;
}
extern "C" int kiln_libmvec_probe(float s) {
  float x[L], p[L];
  for (int i = 0; i < L; ++i) x[i] = s * (float)(i - 5), p[i] = s * (float)i + 0.5f;
  kiln_mvec vx, vp;
  __builtin_memcpy(&vx, x, sizeof vx);
  __builtin_memcpy(&vp, p, sizeof vp);
  int bad = kiln_probe_bad(KILN_MVEC(sinf)(vx), x, p, [](double a, double) { return __builtin_sin(a); });
  bad += kiln_probe_bad(KILN_MVEC(cosf)(vx), x, p, [](double a, double) { return __builtin_cos(a); });
  bad += kiln_probe_bad(KILN_MVEC2(powf)(vp, vx), x, p, [](double a, double b) { return __builtin_pow(b, a); });
#if KILN_LIBMVEC >= 2
  bad += kiln_probe_bad(KILN_MVEC(exp2f)(vx), x, p, [](double a, double) { return __builtin_exp2(a); });
  bad += kiln_probe_bad(KILN_MVEC(log2f)(vp), x, p, [](double, double b) { return __builtin_log2(b); });
  bad += kiln_probe_bad(KILN_MVEC(log1pf)(vp), x, p, [](double, double b) { return __builtin_log1p(b); });
  bad += kiln_probe_bad(KILN_MVEC(expm1f)(vx), x, p, [](double a, double) { return __builtin_expm1(a); });
#endif
  return bad;
}
)";
}

// The level of prelude_libmvec the kernels may use with this command line (`cxx flags`, GCC only:
// the variants are called through GCC's vector types): the highest level up to what the running
// glibc offers whose probe builds with -lmvec (the compiler's own glibc may be older: a conda
// sysroot), loads, and computes within 1e-6 of libm's f64 results; else 0. A level the compiler
// refuses (or that computes wrong) is remembered on disk like a success, so that later processes do
// not build it again; one that failed for want of a temp dir or a load is tried again.
inline int probe_libmvec(std::vector<std::string> argv, const Digest& toolchain_key, bool gcc) {
  for (int level = gcc ? libmvec_offered() : 0; level > 0; --level) {
    const std::string key = hex(Hasher().update("libmvec-probe-v1").update(toolchain_key).update(level).digest());
    if (default_disk_cache().load(key, "failed")) continue;
    bool refused = false;
    void* probe = probe_library(
        key, "libmvec_probe", argv, libmvec_probe_source(level), {"-lmvec"},
        [](void* handle) {
          auto check = reinterpret_cast<int (*)(float)>(::dlsym(handle, "kiln_libmvec_probe"));
          return check && check(0.37f) == 0;
        },
        refused);
    if (probe) {
      ::dlclose(probe);
      return level;
    }
    if (refused) default_disk_cache().store(key, "failed", std::vector<char>{'0'});
  }
  return 0;
}

}  // namespace detail
}  // namespace kiln::runtime
