// The single main() of kiln_tests: doctest's runner, shared by every tests/**/test_*.cpp.
// Kept alone in its own file so that editing a test never rebuilds doctest's implementation.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
