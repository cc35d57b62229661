// kiln: torch.compile for C++. The stages, in the order a first call runs them: core/ (tensors,
// dtypes, the driver), expr/ (capture: the expression's type), graph/ (flatten to a node table,
// inference), rewrite/ (decompose, simplify), autodiff/ (derivatives), ir/ (symbolic sizes), guards/
// (what a program assumed), schedule/ (fusion), codegen/ (kernel source) and runtime/ (compile,
// launch, extern calls, export, tuning; k::compile and k::eval on top), with explain and logs
// (debug/) and the f64 oracle (reference/) beside them.
#pragma once
// The compiler pipeline (inference, rewrites, autodiff, fusion, codegen, the oracle) runs once per
// compiled program, not per call: GCC builds it at -O1, which cuts user compile times by a third.
// The run time (guards, program cache, launches: the cache-hit path) is included after it, at the
// TU's own options. Define KILN_OPTIMIZE_PIPELINE to build everything with the TU's options.
// With KILN_SEPARATE_COMPILATION (core/linkage.hpp) only <kiln/src.hpp>'s TU emits the pipeline:
// the others skip the pragma, whose optimize attribute would also stop GCC from inlining the
// standard library functions first declared under it into their own code.
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && !defined(KILN_OPTIMIZE_PIPELINE) && \
    (!defined(KILN_SEPARATE_COMPILATION) || defined(KILN_SOURCE))
#pragma GCC push_options
#pragma GCC optimize("O1")
#define KILN_PIPELINE_O1
#endif
#include "autodiff/differentiate.hpp"
#include "graph/infer.hpp"
#include "ir/shape_env.hpp"
#include "reference/eval.hpp"
#include "rewrite/decompose.hpp"
#include "rewrite/simplify.hpp"
#if KILN_DEFINITIONS  // fusion and codegen: only where the runtime is compiled (core/linkage.hpp)
#include "codegen/kernel_writer.hpp"
#include "schedule/fuse.hpp"
#include "schedule/split.hpp"
#endif
#ifdef KILN_PIPELINE_O1
#pragma GCC pop_options
#undef KILN_PIPELINE_O1
#endif
#include "autodiff/grad.hpp"
#include "autodiff/structure.hpp"
#include "core/factories.hpp"
#include "core/stream.hpp"
#include "core/tensor.hpp"
#include "debug/explain.hpp"
#include "expr/assign.hpp"
#include "expr/custom_op.hpp"
#include "expr/ops.hpp"
#include "io/safetensors.hpp"
#include "reference/eval.hpp"
#include "runtime/aot/export.hpp"
#include "runtime/api.hpp"
#include "runtime/cond.hpp"
#include "runtime/item.hpp"
