// Fixed text of exported launchers: C names of dtypes, shapes and literals as the launcher prints
// them, and launcher_helpers, the helper functions every launcher's host source contains.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../../core/dtype.hpp"
#include "../../ir/sym.hpp"

namespace kiln::runtime {

namespace detail {

inline std::string header_type(kiln::dtype d) {
  switch (d) {
    case kiln::dtype::f64:
      return "double";
    case kiln::dtype::f32:
      return "float";
    case kiln::dtype::f16:
      return "__half";
    case kiln::dtype::bf16:
      return "__nv_bfloat16";
    case kiln::dtype::i64:
      return "int64_t";
    case kiln::dtype::i32:
      return "int32_t";
    case kiln::dtype::boolean:
      return "bool";
  }
  return "void";
}

inline std::string shape_text(const std::vector<Sym>& dims) {
  std::string s = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + dims[i].str();
  return s + "]";
}

inline std::string quoted(const std::string& s) { return "\"" + s + "\""; }

// The shortest decimal that reads back as v.
inline std::string number(double v) {
  char buf[64];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  if (s.find_first_of(".eni") == std::string::npos) s += ".0";
  return s;
}

}  // namespace detail

// The fixed helpers of every launcher: the error message, size checks, the workspace and the SM count.
inline constexpr const char* launcher_helpers = R"(
thread_local char error_message[1024] = "";

int fail(int status, const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::vsnprintf(error_message, sizeof error_message, format, args);
  va_end(args);
  return status;
}

[[maybe_unused]] bool check_size(long long value, long long expected, const char* what) {
  if (value == expected) return true;
  fail(kiln_export_shape_mismatch, "%s: %s is %lld, but the kernels were exported for %lld", launcher_name, what, value, expected);
  return false;
}

// A symbolic size: bound by its first dim, every later dim must agree; 0 and 1 were specialised.
[[maybe_unused]] bool bind_size(long long& size, const char*& bound_by, long long value, const char* what, const char* symbol) {
  if (value < 2) {
    fail(kiln_export_shape_mismatch, "%s: %s is %lld, but it is the symbolic size %s, exported for sizes >= 2", launcher_name, what,
         value, symbol);
    return false;
  }
  if (size >= 0 && size != value) {
    fail(kiln_export_shape_mismatch, "%s: %s is %lld, but %s is %lld: both are the size %s and must be equal", launcher_name, what,
         value, bound_by, size, symbol);
    return false;
  }
  size = value;
  bound_by = what;
  return true;
}

// The caller's workspace, or one allocated on the stream and freed on it when the launch returns.
struct Workspace {
  char* base = nullptr;
  cudaStream_t stream = 0;
  bool owned = false;
  int acquire(void* given, size_t bytes, cudaStream_t s) {
    base = static_cast<char*>(given);
    stream = s;
    if (base != nullptr && reinterpret_cast<unsigned long long>(base) % 256 != 0)
      return fail(kiln_export_invalid_argument, "%s: the workspace must be 256-byte aligned", launcher_name);
    if (base != nullptr || bytes == 0) return kiln_export_success;
    if (cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&base), bytes, s))
      return fail(kiln_export_cuda_error, "%s: allocating %zu bytes of workspace: %s", launcher_name, bytes, cudaGetErrorString(e));
    owned = true;
    return kiln_export_success;
  }
  ~Workspace() {
    if (owned) cudaFreeAsync(base, stream);
  }
};

// Multiprocessors of the current device: row kernels launch a few waves and loop over the rest.
[[maybe_unused]] int multiprocessors(long long* sms) {
  int device = 0, count = 0;
  if (cudaError_t e = cudaGetDevice(&device)) return fail(kiln_export_cuda_error, "%s: cudaGetDevice: %s", launcher_name, cudaGetErrorString(e));
  if (cudaError_t e = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device))
    return fail(kiln_export_cuda_error, "%s: cudaDeviceGetAttribute: %s", launcher_name, cudaGetErrorString(e));
  *sms = count;
  return kiln_export_success;
}
)";

}  // namespace kiln::runtime
