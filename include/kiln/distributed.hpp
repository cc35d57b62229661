// kiln on several GPUs (API.md, "Several GPUs"): process groups over NCCL (k::dist::init, spawn,
// unique_id), the collectives as expressions (k::all_reduce, all_gather, reduce_scatter,
// broadcast) and data-parallel gradients (k::dist::data_parallel). NCCL is loaded at run time;
// world size 1 never needs it.
#pragma once
#include "kiln.hpp"
#include "runtime/dist/collectives.hpp"
#include "runtime/dist/data_parallel.hpp"
#include "runtime/dist/group.hpp"
