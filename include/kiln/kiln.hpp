// kiln: torch.compile for C++. Capture (expr/), rewrite and differentiate (rewrite/, autodiff/),
// flatten (graph/), guard (guards/), lower (ir/), fuse (schedule/), generate (codegen/) and run
// (runtime/), with explain and logs (debug/) and the f64 oracle (reference/) beside them.
#pragma once
#include "core/factories.hpp"
#include "core/stream.hpp"
#include "core/tensor.hpp"
#include "expr/assign.hpp"
#include "expr/ops.hpp"
#include "autodiff/grad.hpp"
#include "runtime/api.hpp"
#include "debug/explain.hpp"
#include "reference/eval.hpp"
