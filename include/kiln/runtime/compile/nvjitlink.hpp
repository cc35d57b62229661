// nvJitLink, opened with dlopen on first use (never linked, as NVRTC's other optional companions):
// links NVRTC's relocatable device code (-rdc) with the toolkit's libcudadevrt.a, for kernels that
// call device-runtime functions such as cudaGraphSetConditional. Like NVRTC it needs no GPU.
#pragma once
#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "../../core/config.hpp"
#include "../../core/error.hpp"
#include "nvrtc.hpp"

namespace kiln::runtime {
namespace nvjitlink {

// nvJitLink.h's types, restated so that kiln needs the library only when it links something:
// results and input kinds are C enums (int), the handle an opaque pointer.
using Handle = void*;
inline constexpr int input_cubin = 1;    // NVJITLINK_INPUT_CUBIN
inline constexpr int input_library = 6;  // NVJITLINK_INPUT_LIBRARY

struct Api {
  int (*create)(Handle*, std::uint32_t, const char**) = nullptr;
  int (*destroy)(Handle*) = nullptr;
  int (*add_data)(Handle, int, const void*, std::size_t, const char*) = nullptr;
  int (*add_file)(Handle, int, const char*) = nullptr;
  int (*complete)(Handle) = nullptr;
  int (*linked_cubin_size)(Handle, std::size_t*) = nullptr;
  int (*linked_cubin)(Handle, void*) = nullptr;
  int (*error_log_size)(Handle, std::size_t*) = nullptr;
  int (*error_log)(Handle, char*) = nullptr;
};

namespace detail {

struct Loaded {
  Api api;
  std::string error;
};

template <class T>
void bind(void* lib, T& member, const char* symbol, std::string& missing) {
  member = reinterpret_cast<T>(dlsym(lib, symbol));
  if (!member) missing += (missing.empty() ? "" : ", ") + std::string(symbol);
}

inline Loaded load() {
  Loaded l;
  std::string why;
  void* lib = nullptr;
  std::vector<std::string> names{"libnvJitLink.so.13", "libnvJitLink.so.12", "libnvJitLink.so"};
  if (auto dir = runtime::detail::loaded_nvrtc_dir(); !dir.empty())  // the toolkit NVRTC came from
    names.push_back((dir / "libnvJitLink.so").string());
  for (const std::string& name : names) {
    if ((lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL))) break;
    const char* e = dlerror();
    why += (why.empty() ? "" : "; ") + name + ": " + (e ? e : "unknown reason");
  }
  if (!lib) {
    l.error = "nvJitLink is not available (" + why + ")";
    return l;
  }
  std::string missing;
  bind(lib, l.api.create, "nvJitLinkCreate", missing);
  bind(lib, l.api.destroy, "nvJitLinkDestroy", missing);
  bind(lib, l.api.add_data, "nvJitLinkAddData", missing);
  bind(lib, l.api.add_file, "nvJitLinkAddFile", missing);
  bind(lib, l.api.complete, "nvJitLinkComplete", missing);
  bind(lib, l.api.linked_cubin_size, "nvJitLinkGetLinkedCubinSize", missing);
  bind(lib, l.api.linked_cubin, "nvJitLinkGetLinkedCubin", missing);
  bind(lib, l.api.error_log_size, "nvJitLinkGetErrorLogSize", missing);
  bind(lib, l.api.error_log, "nvJitLinkGetErrorLog", missing);
  if (!missing.empty()) l.error = "the loaded libnvJitLink lacks " + missing;
  return l;
}

inline const Loaded& loaded() {
  static const Loaded l = load();
  return l;
}

// Releases the link however it ends.
struct Link {
  const Api& api;
  Handle h = nullptr;
  ~Link() {
    if (h) api.destroy(&h);
  }
  std::string log() const {
    std::size_t n = 0;
    if (api.error_log_size(h, &n) != 0 || n <= 1) return {};
    std::string text(n, '\0');
    api.error_log(h, text.data());
    text.resize(n - 1);
    return text;
  }
};

}  // namespace detail

// Why nvJitLink cannot be used here, or empty.
inline std::string unavailable() {
  try {
    return detail::loaded().error;
  } catch (...) {
    return "nvJitLink could not be loaded";
  }
}

// The toolkit's device runtime library: beside the loaded NVRTC, under CUDA_HOME / CUDA_PATH, or
// in /usr/local/cuda. Empty when none has it.
inline std::string find_device_runtime() {
  namespace fs = std::filesystem;
  std::vector<fs::path> dirs;
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"})
    if (const char* v = kiln::config::env(var); v && *v) dirs.push_back(fs::path(v) / "lib64");
  if (fs::path lib = runtime::detail::loaded_nvrtc_dir(); !lib.empty()) dirs.push_back(lib);
  dirs.push_back("/usr/local/cuda/lib64");
  dirs.push_back("/usr/local/cuda/targets/x86_64-linux/lib");
  dirs.push_back("/usr/local/cuda/targets/sbsa-linux/lib");
  for (const fs::path& d : dirs) {
    std::error_code ec;
    if (fs::exists(d / "libcudadevrt.a", ec)) return (d / "libcudadevrt.a").string();
  }
  return {};
}

// Links relocatable device code (NVRTC's CUBIN built with -rdc=true) for arch ("sm_90a") with
// libcudadevrt.a into a loadable CUBIN. Throws kiln::compile_error naming `what` with the linker's log.
inline std::vector<char> link_with_device_runtime(const std::vector<char>& object, const std::string& what,
                                                  const std::string& arch) {
  const detail::Loaded& l = detail::loaded();
  if (!l.error.empty()) throw compile_error("nvJitLink: linking " + what + " for " + arch + ": " + l.error, "", "");
  std::string devrt = find_device_runtime();
  if (devrt.empty())
    throw compile_error("nvJitLink: linking " + what + " for " + arch +
                            ": libcudadevrt.a was not found (set CUDA_HOME to the CUDA toolkit)",
                        "", "");
  std::string arch_option = "-arch=" + arch;
  const char* options[] = {arch_option.c_str()};
  detail::Link link{l.api};
  auto fail = [&](const char* step) {
    throw compile_error("nvJitLink: " + std::string(step) + " failed while linking " + what + " for " + arch +
                            " with " + devrt,
                        link.h ? link.log() : std::string(), "");
  };
  if (l.api.create(&link.h, 1, options) != 0) fail("nvJitLinkCreate");
  if (l.api.add_data(link.h, input_cubin, object.data(), object.size(), what.c_str()) != 0) fail("nvJitLinkAddData");
  if (l.api.add_file(link.h, input_library, devrt.c_str()) != 0) fail("nvJitLinkAddFile");
  if (l.api.complete(link.h) != 0) fail("nvJitLinkComplete");
  std::size_t size = 0;
  if (l.api.linked_cubin_size(link.h, &size) != 0 || size == 0) fail("nvJitLinkGetLinkedCubinSize");
  std::vector<char> cubin(size);
  if (l.api.linked_cubin(link.h, cubin.data()) != 0) fail("nvJitLinkGetLinkedCubin");
  return cubin;
}

}  // namespace nvjitlink
}  // namespace kiln::runtime
