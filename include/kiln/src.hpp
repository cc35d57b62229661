// The runtime compiled once (core/linkage.hpp): include this in exactly one .cpp file of a program
// whose every TU defines KILN_SEPARATE_COMPILATION (the CMake target kiln::compiled builds it and
// defines the macro for its users). The other TUs then only declare the runtime's entry points, and
// a TU that calls k::compile takes seconds to compile instead of tens of seconds.
#pragma once
#ifndef KILN_SEPARATE_COMPILATION
#error "<kiln/src.hpp> is for KILN_SEPARATE_COMPILATION builds: define it in every TU of the program, or include <kiln/kiln.hpp> alone (header-only)"
#endif
#ifdef KILN_DEFINITIONS
#error "<kiln/src.hpp> must come before any other kiln header in its .cpp file (a kiln header already included there decided that this TU defines nothing)"
#endif
#define KILN_SOURCE
#include "kiln.hpp"
#include "testing.hpp"  // gradcheck's entry point
