// The NCCL binding: libnccl.so.2 found with dlopen on first use, as the CUDA driver and cuBLASLt
// are, so kiln loads (and single-process, single-GPU programs run) without it. KILN_NCCL_LIBRARY
// names the library to open (a path or a soname); unset, kiln tries the loader's search path, the
// CUDA Toolkit's lib/ and lib64/ folders and the pip wheel's nvidia/nccl/lib under the usual
// Python prefixes. The types below restate NCCL's stable C ABI (nccl.h, NCCL 2.x), so building kiln
// needs no NCCL headers either.
#pragma once
#include <dlfcn.h>

#include <cstddef>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "../../core/config.hpp"
#include "../../core/driver.hpp"
#include "../../core/dtype.hpp"
#include "../../core/error.hpp"

namespace kiln::runtime::nccl {

// ---- NCCL's ABI, as nccl.h declares it ------------------------------------------------------------
struct UniqueId {
  char internal[128];
};
using Comm = struct ncclComm*;
enum Result : int { success = 0, in_progress = 7 };
enum RedOp : int { sum = 0, prod = 1, max = 2, min = 3, avg = 4 };
enum DataType : int { int8 = 0, uint8 = 1, int32 = 2, int64 = 4, float16 = 6, float32 = 7, float64 = 8, bfloat16 = 9 };

// X(member, symbol, signature): the entry points kiln uses.
#define KILN_NCCL_FUNCTIONS(X)                                                                                   \
  X(get_version, ncclGetVersion, Result(int*))                                                                   \
  X(get_unique_id, ncclGetUniqueId, Result(UniqueId*))                                                           \
  X(comm_init_rank, ncclCommInitRank, Result(Comm*, int, UniqueId, int))                                         \
  X(comm_init_all, ncclCommInitAll, Result(Comm*, int, const int*))                                              \
  X(comm_destroy, ncclCommDestroy, Result(Comm))                                                                 \
  X(comm_abort, ncclCommAbort, Result(Comm))                                                                     \
  X(get_error_string, ncclGetErrorString, const char*(Result))                                                   \
  X(all_reduce, ncclAllReduce, Result(const void*, void*, std::size_t, DataType, RedOp, Comm, CUstream))         \
  X(all_gather, ncclAllGather, Result(const void*, void*, std::size_t, DataType, Comm, CUstream))                \
  X(reduce_scatter, ncclReduceScatter, Result(const void*, void*, std::size_t, DataType, RedOp, Comm, CUstream)) \
  X(reduce, ncclReduce, Result(const void*, void*, std::size_t, DataType, RedOp, int, Comm, CUstream))           \
  X(broadcast, ncclBroadcast, Result(const void*, void*, std::size_t, DataType, int, Comm, CUstream))            \
  X(group_start, ncclGroupStart, Result())                                                                       \
  X(group_end, ncclGroupEnd, Result())

struct Api {
#define KILN_NCCL_MEMBER(member, symbol, signature) std::add_pointer_t<signature> member = nullptr;
  KILN_NCCL_FUNCTIONS(KILN_NCCL_MEMBER)
#undef KILN_NCCL_MEMBER
  std::string path;  // what was opened
  int version = 0;   // e.g. 22703 for 2.27.3
};

namespace detail {

struct Loaded {
  Api api;
  std::string error;  // empty when usable
};

// Where to look when KILN_NCCL_LIBRARY is unset.
inline std::vector<std::string> candidates() {
  std::vector<std::string> c = {"libnccl.so.2"};
  std::vector<std::string> roots;
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"})
    if (const char* v = config::env(var)) roots.push_back(v);
  roots.push_back("/usr/local/cuda");
  for (const auto& r : roots)
    for (const char* sub : {"/lib/libnccl.so.2", "/lib64/libnccl.so.2", "/targets/x86_64-linux/lib/libnccl.so.2"})
      c.push_back(r + sub);
  for (const char* py : {"/opt/torch/.venv/lib/python3.12", "/usr/local/lib/python3.12", "/usr/lib/python3"})
    for (const char* site : {"/site-packages", "/dist-packages"})
      c.push_back(std::string(py) + site + "/nvidia/nccl/lib/libnccl.so.2");
  return c;
}

inline Loaded open(const std::string& requested) {
  Loaded l;
  std::vector<std::string> names = requested.empty() ? candidates() : std::vector<std::string>{requested};
  void* lib = nullptr;
  std::string why;
  for (const auto& n : names) {
    lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib) {
      l.api.path = n;
      break;
    }
    if (!requested.empty() || why.empty()) {  // the first failure says enough for the search
      const char* e = dlerror();
      why = e ? std::string(e) : n + ": could not be loaded";
    }
  }
  if (!lib) {
    l.error = requested.empty()
                  ? "NCCL is not available: libnccl.so.2 was not found on the loader's path, in the CUDA Toolkit or "
                    "in a pip wheel (" +
                        why + "); set KILN_NCCL_LIBRARY to its path"
                  : "NCCL is not available: KILN_NCCL_LIBRARY=" + requested + " could not be loaded (" + why + ")";
    return l;
  }
  std::string missing;
#define KILN_NCCL_BIND(member, symbol, signature)                                      \
  l.api.member = reinterpret_cast<std::add_pointer_t<signature>>(dlsym(lib, #symbol)); \
  if (!l.api.member) missing += (missing.empty() ? "" : ", ") + std::string(#symbol);
  KILN_NCCL_FUNCTIONS(KILN_NCCL_BIND)
#undef KILN_NCCL_BIND
  if (!missing.empty()) {
    l.error = "NCCL: " + l.api.path + " lacks " + missing + " (kiln needs NCCL 2.10 or newer)";
    return l;
  }
  l.api.get_version(&l.api.version);
  if (l.api.version < 21000)
    l.error = "NCCL: " + l.api.path + " is version " + std::to_string(l.api.version) +
              "; kiln needs 2.10 or newer (for the avg reduction)";
  return l;
}

// Each requested name is opened once (the process may change KILN_NCCL_LIBRARY; libraries stay open).
inline const Loaded& loaded() {
  static std::mutex mutex;
  static auto* opened = new std::map<std::string, Loaded>();  // never closed
  const char* choice = config::env("KILN_NCCL_LIBRARY");
  const std::string key = choice ? choice : "";
  std::lock_guard lock(mutex);
  auto it = opened->find(key);
  if (it == opened->end()) it = opened->emplace(key, open(key)).first;
  return it->second;
}

}  // namespace detail

// The entry points; a kiln::device_error naming the library when it cannot be loaded.
inline const Api& api() {
  const detail::Loaded& l = detail::loaded();
  if (!l.error.empty()) [[unlikely]]
    throw device_error(l.error);
  return l.api;
}

inline bool available() noexcept {
  try {
    return detail::loaded().error.empty();
  } catch (...) {
    return false;
  }
}

// Throws kiln::cuda_error("<what>: <fn> failed: <NCCL's text>") unless r is ncclSuccess.
inline void check(Result r, const char* fn, const std::string& what) {
  if (r == success) [[likely]]
    return;
  const char* text = api().get_error_string ? api().get_error_string(r) : nullptr;
  throw cuda_error(what + ": " + fn + " failed: " + (text ? text : "ncclResult_t " + std::to_string(r)) +
                   " (NCCL_DEBUG=WARN says more)");
}

// NCCL's type for a kiln dtype (booleans travel as bytes).
inline DataType data_type(kiln::dtype d) {
  switch (d) {
    case kiln::dtype::f64:
      return float64;
    case kiln::dtype::f32:
      return float32;
    case kiln::dtype::f16:
      return float16;
    case kiln::dtype::bf16:
      return bfloat16;
    case kiln::dtype::i64:
      return int64;
    case kiln::dtype::i32:
      return int32;
    case kiln::dtype::boolean:
      return uint8;
  }
  return float32;
}

}  // namespace kiln::runtime::nccl
