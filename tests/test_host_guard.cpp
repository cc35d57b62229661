// KILN_HOST_GUARD_PAGES (core/host_guard.hpp): host blocks against inaccessible pages. ctest runs
// this file plain and with each mode (tests/CMakeLists.txt's guarded entries); with a mode set, a
// child process that touches one byte outside a host tensor's block must die of SIGSEGV, and the
// block must hold the tensor's values like any other.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>

#include <kiln/kiln.hpp>
#include <kiln/testing.hpp>

namespace k = kiln;

namespace {

// Whether a child process reading the byte at `p` dies of SIGSEGV.
bool read_faults(const volatile char* p) {
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    char c = *p;  // faults, or the child exits normally
    _exit(c == 123 ? 3 : 0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV;
}

}  // namespace

TEST_CASE("host guard pages: a byte outside a host tensor's block faults, values as usual") {
  const k::memory::HostGuard mode = k::memory::host_guard();
  k::Tensor x = k::randn({37, 16}, k::f32, k::cpu, 5);  // 2368 bytes: 37 blocks of 64
  k::Tensor y = x * 2.0f + 1.0f;                         // a kernel's output, in a guarded block too
  auto r = k::testing::allclose(y, k::reference::eval(x * 2.0f + 1.0f), 1e-6, 1e-6);
  CHECK_MESSAGE(bool(r), r);
  const char* first = static_cast<const char*>(y.data_ptr());
  const char* end = first + y.nbytes();  // a multiple of 64: the block's end
  if (mode == k::memory::HostGuard::off) {
    MESSAGE("KILN_HOST_GUARD_PAGES unset: blocks come from the heap, nothing to check");
    return;
  }
  if (mode == k::memory::HostGuard::after) {
    CHECK_FALSE(read_faults(end - 1));
    CHECK(read_faults(end));
  } else {
    CHECK_FALSE(read_faults(first));
    CHECK(read_faults(first - 1));
  }
}
