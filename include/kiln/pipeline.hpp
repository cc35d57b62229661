// Every header of kiln's pipeline: fusion, codegen, the lowering driver, launches, CUDA graphs,
// conditional nodes and export's writer. <kiln/kiln.hpp> parses them all in header-only mode; with
// KILN_SEPARATE_COMPILATION (core/linkage.hpp) a user TU parses only the declarations it calls and
// <kiln/src.hpp>'s TU the rest, so code that reaches into the internals (kiln's own tests, tools
// that plan programs or write kernels) includes this header too.
#pragma once
#include "kiln.hpp"  // first: in header-only mode it parses the pipeline under its -O1 pragma

#include "codegen/kernel_writer.hpp"
#include "codegen/prelude.hpp"
#include "runtime/aot/export_launcher.hpp"
#include "runtime/compile/nvrtc.hpp"
#include "runtime/launch/capture_keep.hpp"
#include "runtime/launch/cond_node.hpp"
#include "runtime/launch/cuda_graph.hpp"
#include "runtime/launch/program.hpp"
#include "runtime/lower.hpp"
#include "schedule/fuse.hpp"
#include "schedule/split.hpp"
