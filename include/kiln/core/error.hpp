// The typed errors of kiln: every failure a user can meet is one of these, with a message that
// names the operation and the offending shapes, dtypes or devices.
#pragma once
#include <stdexcept>
#include <string>

namespace kiln {

struct error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct shape_error : error {
  using error::error;
};
struct dtype_error : error {
  using error::error;
};
struct device_error : error {
  using error::error;
};
struct cuda_error : error {
  using error::error;
};
struct recompile_limit_error : error {
  using error::error;
};

// A failed compilation of generated code: the compiler's log and where the source was dumped.
struct compile_error : error {
  compile_error(const std::string& what, std::string log, std::string source_path)
      : error(what + "\n--- compiler log ---\n" + log + "\n--- source: " + source_path),
        log(std::move(log)),
        source_path(std::move(source_path)) {}
  std::string log;
  std::string source_path;
};

}  // namespace kiln
