// kiln::source_location: std::source_location where the standard library provides it, else the same
// three fields from the compiler builtins (clang 14 with libstdc++ 12 has the header but not the type).
// Used to name the call site of a graph break (k::item).
#pragma once
#include <version>
#if defined(__cpp_lib_source_location)
#include <source_location>
#endif

namespace kiln {

#if defined(__cpp_lib_source_location)
using source_location = std::source_location;
#else
struct source_location {
  static constexpr source_location current(const char* file = __builtin_FILE(), unsigned line = __builtin_LINE(),
                                           const char* function = __builtin_FUNCTION()) noexcept {
    source_location at;
    at.file_ = file;
    at.line_ = line;
    at.function_ = function;
    return at;
  }
  constexpr const char* file_name() const noexcept { return file_; }
  constexpr const char* function_name() const noexcept { return function_; }
  constexpr unsigned line() const noexcept { return line_; }
  constexpr unsigned column() const noexcept { return 0; }

 private:
  const char* file_ = "";
  const char* function_ = "";
  unsigned line_ = 0;
};
#endif

}  // namespace kiln
