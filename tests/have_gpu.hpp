// GPU test cases on machines without a CUDA device (CI has none): doctest counts them as skipped,
// not as passed. Write
//   TEST_CASE("cuda: ..." * needs_gpu()) { ... }
// and the case is marked skipped when this machine has no usable CUDA device; with a device the
// same binary runs it. `--no-skip` runs it anyway (it then fails with a device_error).
#pragma once
#include <doctest/doctest.h>

#include <kiln/core/driver.hpp>

// Evaluated while test cases register, before main. That is safe: kiln::driver::available() dlopens
// libcuda, calls cuInit and counts devices once, behind a function-local static (thread-safe and
// independent of the order of other files' static initialisers), catches everything, and caches
// the answer for the tests themselves. Without a driver it costs one failed dlopen.
inline doctest::skip needs_gpu() { return doctest::skip(!kiln::driver::available()); }

// The converse, for the cases that check what happens on a machine without a device.
inline doctest::skip needs_no_gpu() { return doctest::skip(kiln::driver::available()); }
