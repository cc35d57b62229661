// A kernel of kiln's own templates (the fused attention kernels, the GEMM template) by name,
// compiled once a device through the disk cache from the source its writer gives, on that first
// call only, and kept loaded for the process.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "../../core/driver.hpp"
#include "../compile/cached_cubin.hpp"
#include "cuda_module.hpp"

namespace kiln::runtime {

// The cache itself; source(ctx) writes the kernel's translation unit. Not a template, so its map
// and mutex are instantiated once, not once per caller's lambda.
inline CUfunction named_function_of(const std::string& name, std::string (*source)(const void*), const void* ctx,
                                    int device) {
  using Key = std::tuple<int, std::string>;
  struct Loaded {
    std::unique_ptr<Module> module;
    CUfunction f = nullptr;
  };
  static std::mutex mutex;
  static auto* loaded = new std::map<Key, Loaded>();  // never unloaded
  std::lock_guard lock(mutex);
  Loaded& l = (*loaded)[Key{device, name}];
  if (!l.f) {
    l.module = std::make_unique<Module>(cached_cubin(source(ctx), name, driver::arch(device)), device);
    l.f = l.module->function(name.c_str());
  }
  return l.f;
}
template <class Source>
CUfunction named_function(const std::string& name, Source&& source, int device) {
  return named_function_of(
      name, [](const void* s) -> std::string { return (*static_cast<const std::remove_reference_t<Source>*>(s))(); },
      &source, device);
}

}  // namespace kiln::runtime
