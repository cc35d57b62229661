// The visible skip of GPU test cases on machines without a CUDA device (CI has none).
#pragma once
#include <doctest/doctest.h>

#include <kiln/core/driver.hpp>

// True when a CUDA device is usable; otherwise records why the test case is skipped.
inline bool have_gpu() {
  if (kiln::driver::available()) return true;
  MESSAGE("skipped: no CUDA device on this machine");
  return false;
}
