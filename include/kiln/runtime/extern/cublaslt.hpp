// The cuBLASLt binding: its entry points found with dlopen/dlsym on first use (libcublasLt is never
// linked, so kiln loads without it), status checks, and descriptors released however a call ends.
#pragma once
#include <cublasLt.h>  // types and prototypes only: libcublasLt is never linked
#include <dlfcn.h>

#include <cstdint>
#include <string>

#include "../../core/error.hpp"

namespace kiln::runtime {

namespace cublaslt {

// X(member, symbol): the cuBLASLt entry points kiln uses.
#define KILN_CUBLASLT_FUNCTIONS(X)                                  \
  X(create, cublasLtCreate)                                         \
  X(matmul_desc_create, cublasLtMatmulDescCreate)                   \
  X(matmul_desc_destroy, cublasLtMatmulDescDestroy)                 \
  X(matmul_desc_set_attribute, cublasLtMatmulDescSetAttribute)      \
  X(layout_create, cublasLtMatrixLayoutCreate)                      \
  X(layout_destroy, cublasLtMatrixLayoutDestroy)                    \
  X(layout_set_attribute, cublasLtMatrixLayoutSetAttribute)         \
  X(preference_create, cublasLtMatmulPreferenceCreate)              \
  X(preference_destroy, cublasLtMatmulPreferenceDestroy)            \
  X(preference_set_attribute, cublasLtMatmulPreferenceSetAttribute) \
  X(algo_get_heuristic, cublasLtMatmulAlgoGetHeuristic)             \
  X(matmul, cublasLtMatmul)

struct Api {
#define KILN_CUBLASLT_MEMBER(member, symbol) decltype(&::symbol) member = nullptr;
  KILN_CUBLASLT_FUNCTIONS(KILN_CUBLASLT_MEMBER)
#undef KILN_CUBLASLT_MEMBER
  decltype(&::cublasLtGetStatusName) get_status_name = nullptr;  // optional
};

namespace detail {

struct Loaded {
  Api api;
  std::string error;
};

inline Loaded load() {
  Loaded l;
  std::string why;
  void* lib = nullptr;
  for (const char* name : {"libcublasLt.so.13", "libcublasLt.so"}) {
    lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib) break;
    const char* e = dlerror();
    why += std::string(why.empty() ? "" : "; ") + name + ": " + (e ? e : "unknown reason");
  }
  if (!lib) {
    l.error =
        "matmul: cuBLASLt is not available (libcublasLt.so.13 or libcublasLt.so could not be loaded: " + why + ")";
    return l;
  }
  std::string missing;
#define KILN_CUBLASLT_BIND(member, symbol)                                      \
  l.api.member = reinterpret_cast<decltype(l.api.member)>(dlsym(lib, #symbol)); \
  if (!l.api.member) missing += (missing.empty() ? "" : ", ") + std::string(#symbol);
  KILN_CUBLASLT_FUNCTIONS(KILN_CUBLASLT_BIND)
#undef KILN_CUBLASLT_BIND
  l.api.get_status_name = reinterpret_cast<decltype(l.api.get_status_name)>(dlsym(lib, "cublasLtGetStatusName"));
  if (!missing.empty()) l.error = "matmul: the loaded libcublasLt is too old for kiln (it lacks " + missing + ")";
  return l;
}

inline const Loaded& loaded() {
  static const Loaded l = load();
  return l;
}

}  // namespace detail

// True when libcublasLt loads and has every entry point kiln needs.
inline bool available() noexcept {
  try {
    return detail::loaded().error.empty();
  } catch (...) {
    return false;
  }
}

// The entry points; a kiln::device_error naming the library when it cannot be loaded.
inline const Api& api() {
  const detail::Loaded& l = detail::loaded();
  if (!l.error.empty()) [[unlikely]]
    throw device_error(l.error);
  return l.api;
}

inline std::string status_text(cublasStatus_t s) {
  const Api& a = detail::loaded().api;
  const char* name = a.get_status_name ? a.get_status_name(s) : nullptr;
  return name ? std::string(name) + " (" + std::to_string(static_cast<int>(s)) + ")"
              : "cublasStatus_t " + std::to_string(static_cast<int>(s));
}

// Throws kiln::cuda_error("matmul: <fn> failed: <status>") unless s is CUBLAS_STATUS_SUCCESS.
inline void check(cublasStatus_t s, const char* fn) {
  if (s != CUBLAS_STATUS_SUCCESS) [[unlikely]]
    throw cuda_error(std::string("matmul: ") + fn + " failed: " + status_text(s));
}

// Descriptors released however the call ends.
struct MatmulDesc {
  cublasLtMatmulDesc_t h = nullptr;
  MatmulDesc(cublasComputeType_t compute, cudaDataType_t scale) {
    check(api().matmul_desc_create(&h, compute, scale), "cublasLtMatmulDescCreate");
  }
  ~MatmulDesc() {
    if (h) api().matmul_desc_destroy(h);
  }
  template <class V>
  void set(cublasLtMatmulDescAttributes_t attr, const V& value) {
    check(api().matmul_desc_set_attribute(h, attr, &value, sizeof(V)), "cublasLtMatmulDescSetAttribute");
  }
  MatmulDesc(const MatmulDesc&) = delete;
  MatmulDesc& operator=(const MatmulDesc&) = delete;
};

struct Layout {
  cublasLtMatrixLayout_t h = nullptr;
  Layout(cudaDataType_t type, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
    check(api().layout_create(&h, type, static_cast<std::uint64_t>(rows), static_cast<std::uint64_t>(cols), ld),
          "cublasLtMatrixLayoutCreate");
  }
  ~Layout() {
    if (h) api().layout_destroy(h);
  }
  template <class V>
  void set(cublasLtMatrixLayoutAttribute_t attr, const V& value) {
    check(api().layout_set_attribute(h, attr, &value, sizeof(V)), "cublasLtMatrixLayoutSetAttribute");
  }
  void batch(std::int32_t count, std::int64_t stride) {
    if (count <= 1) return;
    set(CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, count);
    set(CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride);
  }
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;
};

struct Preference {
  cublasLtMatmulPreference_t h = nullptr;
  Preference() { check(api().preference_create(&h), "cublasLtMatmulPreferenceCreate"); }
  ~Preference() {
    if (h) api().preference_destroy(h);
  }
  template <class V>
  void set(cublasLtMatmulPreferenceAttributes_t attr, const V& value) {
    check(api().preference_set_attribute(h, attr, &value, sizeof(V)), "cublasLtMatmulPreferenceSetAttribute");
  }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
};

}  // namespace cublaslt

}  // namespace kiln::runtime
