// The CUDA driver API, opened with dlopen on first use so that kiln loads (and its CPU path runs)
// on machines without a driver: devices, contexts, a stream-ordered caching allocator and copies.
#pragma once
#include "driver_allocator.hpp"
#include "driver_api.hpp"
#include "driver_device.hpp"
#include "driver_stream.hpp"
