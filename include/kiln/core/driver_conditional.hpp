// The driver's entry points for conditional graph nodes (driver 12.3 and later), looked up apart
// from the required table (driver_api.hpp) so that an older driver still runs everything else:
// k::cond then reads its predicate on the host instead of recording a conditional node.
#pragma once
#include <cuda.h>  // types and prototypes only: libcuda is never linked
#include <dlfcn.h>

#include <string>

#include "driver_api.hpp"

namespace kiln::driver {

#if CUDA_VERSION >= 12030
#define KILN_HAS_CONDITIONAL_NODES 1
// X(member, symbol): as in driver_api.hpp, the versioned names that cuda.h maps the plain ones to.
#define KILN_CUDA_CONDITIONAL_FUNCTIONS(X)                                    \
  X(driver_get_version, cuDriverGetVersion)                                   \
  X(get_capture_info, cuStreamGetCaptureInfo_v3)                              \
  X(update_capture_dependencies, cuStreamUpdateCaptureDependencies_v2)        \
  X(begin_capture_to_graph, cuStreamBeginCaptureToGraph)                      \
  X(conditional_handle_create, cuGraphConditionalHandleCreate)                \
  X(graph_add_node, cuGraphAddNode_v2)

struct ConditionalApi {
#define KILN_DRIVER_MEMBER(member, symbol) decltype(&::symbol) member = nullptr;
  KILN_CUDA_CONDITIONAL_FUNCTIONS(KILN_DRIVER_MEMBER)
#undef KILN_DRIVER_MEMBER
};
#else
#define KILN_HAS_CONDITIONAL_NODES 0
struct ConditionalApi {};
#endif

// The entry points, whether IF nodes take an ELSE body (driver 12.8), or why there are none.
struct ConditionalSupport {
  ConditionalApi api;
  int driver_version = 0;  // 12080 for 12.8, as CUDA_VERSION
  bool if_else = false;
  std::string missing;  // empty when conditional nodes can be recorded
};

namespace detail {

inline ConditionalSupport load_conditional() {
  ConditionalSupport s;
#if KILN_HAS_CONDITIONAL_NODES
  api();  // throws device_error when there is no usable driver
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);  // already loaded: a new reference
  if (!lib) {
    s.missing = "libcuda.so.1 could not be opened again";
    return s;
  }
#define KILN_DRIVER_BIND(member, symbol)                                    \
  s.api.member = reinterpret_cast<decltype(s.api.member)>(dlsym(lib, #symbol)); \
  if (!s.api.member) s.missing += (s.missing.empty() ? "the driver lacks " : ", ") + std::string(#symbol);
  KILN_CUDA_CONDITIONAL_FUNCTIONS(KILN_DRIVER_BIND)
#undef KILN_DRIVER_BIND
  if (!s.missing.empty()) return s;
  check(s.api.driver_get_version(&s.driver_version), "cuDriverGetVersion");
  if (s.driver_version < 12030)
    s.missing = "the driver is CUDA " + std::to_string(s.driver_version / 1000) + "." +
                std::to_string(s.driver_version % 1000 / 10) + "; conditional graph nodes need 12.3";
  s.if_else = s.driver_version >= 12080;
#else
  s.missing = "kiln was compiled against cuda.h " + std::to_string(CUDA_VERSION) + "; conditional nodes need 12.3";
#endif
  return s;
}

}  // namespace detail

// Computed once; throws device_error (as api() does) when there is no usable driver at all.
inline const ConditionalSupport& conditional_support() {
  static const ConditionalSupport s = detail::load_conditional();
  return s;
}

}  // namespace kiln::driver
