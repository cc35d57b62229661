// cached_cubin: a CUDA translation unit's CUBIN from the disk cache, or compiled by NVRTC and stored
// (generated programs, autotuning candidates and the fused attention kernels share it).
#pragma once
#include <string>
#include <vector>

#include "../../core/config.hpp"
#include "../../debug/log.hpp"
#include "disk_cache.hpp"
#include "hash.hpp"
#include "nvrtc.hpp"

namespace kiln::runtime {

// A CUDA translation unit's CUBIN for arch, from the disk cache or compiled by NVRTC (and stored).
// Safe to call from several threads at once (autotuning compiles its candidates in parallel).
inline std::vector<char> cached_cubin(const std::string& tu, const std::string& name, const std::string& arch) {
  Hasher h;
  h.update(tu).update(nvrtc_options_string(arch)).update(nvrtc_version());
  h.update(held_bound_steps() ? "held bound steps" : "own held bounds");  // what compile_cubin does
  std::string key = hex(h.digest());
  if (kiln::config::env("KILN_DEBUG_DIR")) dump_source(tu, name);  // KILN_DEBUG_DIR: every generated source
  auto cached = default_disk_cache().load(key, "cubin");
  int bound = 0;  // the held-row bound ptxas was given (compile_cubin)
  std::vector<char> cubin = cached ? std::move(*cached) : compile_cubin(tu, name, arch, {}, &bound);
  if (!cached) default_disk_cache().store(key, "cubin", cubin);
  if (debug::log_enabled(debug::Channel::cache))
    debug::log(debug::Channel::cache, std::string(cached ? "hit " : "miss ") + name + " cubin " + key +
                                          (bound == 0 ? ""
                                           : bound == detail::own_bounds
                                               ? ", its held-row bounds taken"
                                               : ", a held-row bound of " + std::to_string(bound) + " blocks an SM"));
  return cubin;
}

}  // namespace kiln::runtime
