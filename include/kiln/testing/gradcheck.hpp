// k::testing::gradcheck(fn, args...): central finite differences in f64 on the CPU against the
// derived gradients (API.md, "Testing helpers").
//
// PLACEHOLDER — owned by the autodiff engineer, who replaces this file with the implementation.
// It is already included by <kiln/testing.hpp>, so nothing else needs to change when it lands.
// kiln::reference::eval (reference/eval.hpp) is the f64 oracle to evaluate fn with.
#pragma once

namespace kiln::testing {}  // gradcheck goes here
