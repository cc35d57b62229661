// k::dist: process groups over NCCL (API.md, "Several GPUs"). A group is one rank's view of a set of
// world_size ranks, each driving one device, joined by an NCCL communicator. Ways to make one:
//   - k::dist::init({.rank, .world_size, .id}) with a k::dist::unique_id() that the caller shares
//     (through a file, MPI, a socket...), one call per rank, all ranks at once;
//   - k::dist::init() from the variables KILN_RANK, KILN_WORLD_SIZE and KILN_DIST_ID_FILE (rank 0
//     writes a fresh id to the file, the others wait for it), for several processes and hosts;
//   - k::dist::spawn(n, fn): one thread per local GPU, each calling fn with its own group.
// World size 1 never loads NCCL: its collectives are copies, on any device (CPU tensors included).
// The group is a cheap handle; the communicator is destroyed with its last copy.
#pragma once
#include <array>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include <unistd.h>

#include "../../core/config.hpp"
#include "../../core/device.hpp"
#include "../../core/driver.hpp"
#include "../../expr/custom_op.hpp"
#include "../extern/nccl.hpp"

namespace kiln {

// The reduction of k::all_reduce and k::reduce_scatter (avg: the sum divided by the world size).
enum class reduce_op { sum, prod, max, min, avg };

inline const char* name(reduce_op op) {
  constexpr const char* names[] = {"sum", "prod", "max", "min", "avg"};
  return names[static_cast<int>(op)];
}

namespace dist {

// The rendezvous token of one communicator: 128 opaque bytes that every rank must receive.
struct comm_id {
  std::array<char, 128> bytes{};

  // As 256 hex digits, for files and environment variables.
  std::string hex() const {
    std::string s;
    for (char c : bytes) {
      auto b = static_cast<unsigned char>(c);
      s += "0123456789abcdef"[b >> 4];
      s += "0123456789abcdef"[b & 15];
    }
    return s;
  }
  static comm_id from_hex(std::string_view s) {
    auto digit = [&](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      throw error("k::dist::comm_id: '" + std::string(s.substr(0, 16)) + "...' is not 256 hex digits");
    };
    if (s.size() != 256) throw error("k::dist::comm_id: expected 256 hex digits, got " + std::to_string(s.size()));
    comm_id id;
    for (std::size_t i = 0; i < 128; ++i) id.bytes[i] = static_cast<char>(digit(s[2 * i]) * 16 + digit(s[2 * i + 1]));
    return id;
  }
  friend bool operator==(const comm_id&, const comm_id&) = default;
};

// A fresh id (loads NCCL: a k::device_error naming the library when it is missing).
inline comm_id unique_id() {
  runtime::nccl::UniqueId raw;
  runtime::nccl::check(runtime::nccl::api().get_unique_id(&raw), "ncclGetUniqueId", "k::dist::unique_id");
  comm_id id;
  std::copy(std::begin(raw.internal), std::end(raw.internal), id.bytes.begin());
  return id;
}

struct init_options {
  int rank = 0;
  int world_size = 1;
  comm_id id{};                    // from k::dist::unique_id(), the same on every rank (unused at world size 1)
  std::optional<Device> device{};  // default: cuda(rank % GPUs on this host), or the CPU at world size 1 without one
};

namespace detail {

// What the collectives of a group do, as the key of the custom ops registered for it.
enum class Kind { all_reduce, all_gather, reduce_scatter, broadcast };

struct GroupState {
  int rank = 0, world_size = 1;
  Device device = cpu;
  runtime::nccl::Comm comm = nullptr;
  bool aborted = false;  // spawn aborted the communicator after a rank failed
  std::mutex mu;
  std::map<std::tuple<int, int, int>, CustomOp> ops;  // (kind, reduce op, dim or root) -> op

  GroupState() = default;
  GroupState(const GroupState&) = delete;
  GroupState& operator=(const GroupState&) = delete;
  ~GroupState() {
    if (comm && !aborted) runtime::nccl::api().comm_destroy(comm);  // waits for the communicator's pending work
  }
};

}  // namespace detail

class group {
 public:
  group() = default;
  explicit group(std::shared_ptr<detail::GroupState> s) : s_(std::move(s)) {}

  int rank() const { return state().rank; }
  int world_size() const { return state().world_size; }
  Device device() const { return state().device; }
  // The NCCL communicator (null at world size 1), for calls kiln does not wrap.
  runtime::nccl::Comm native() const { return state().comm; }
  bool valid() const { return s_ != nullptr; }
  std::string str() const {
    return "group(rank " + std::to_string(rank()) + " of " + std::to_string(world_size()) + ", " + device().str() + ")";
  }

  detail::GroupState& state() const {
    if (!s_) throw error("k::dist::group: this group was never initialised (use k::dist::init or k::dist::spawn)");
    return *s_;
  }
  const std::shared_ptr<detail::GroupState>& shared() const { return s_; }

 private:
  std::shared_ptr<detail::GroupState> s_;
};

namespace detail {

inline Device default_device(int rank, int world_size) {
  if (!driver::available()) {
    if (world_size == 1) return cpu;
    throw device_error("k::dist::init: world size " + std::to_string(world_size) +
                       " needs a CUDA device per rank, and this machine has no usable CUDA driver or device");
  }
  return cuda(rank % driver::device_count());
}

inline void check_rank(const char* what, int rank, int world_size) {
  if (world_size < 1)
    throw error(std::string(what) + ": world_size is " + std::to_string(world_size) + "; it must be at least 1");
  if (rank < 0 || rank >= world_size)
    throw error(std::string(what) + ": rank " + std::to_string(rank) + " is outside 0.." +
                std::to_string(world_size - 1));
}

inline std::shared_ptr<GroupState> make_state(int rank, int world_size, Device device) {
  auto s = std::make_shared<GroupState>();
  s->rank = rank, s->world_size = world_size, s->device = device;
  if (world_size > 1 && !device.is_cuda())
    throw device_error("k::dist::init: rank " + std::to_string(rank) + " of " + std::to_string(world_size) + " is on " +
                       device.str() + "; NCCL needs a CUDA device per rank (only world size 1 runs on the CPU)");
  if (device.is_cuda()) driver::require_device(device.index);
  return s;
}

}  // namespace detail

// Joins this rank to the communicator named by o.id; every rank calls it at once (it blocks until
// all world_size ranks have joined).
inline group init(const init_options& o) {
  detail::check_rank("k::dist::init", o.rank, o.world_size);
  const Device device = o.device ? *o.device : detail::default_device(o.rank, o.world_size);
  auto s = detail::make_state(o.rank, o.world_size, device);
  if (o.world_size > 1) {
    const auto& nccl = runtime::nccl::api();
    if (o.id == comm_id{})
      throw error("k::dist::init: world size " + std::to_string(o.world_size) +
                  " needs .id = k::dist::unique_id() made once and shared with every rank");
    runtime::nccl::UniqueId raw;
    std::copy(o.id.bytes.begin(), o.id.bytes.end(), raw.internal);
    driver::make_current(device.index);
    runtime::nccl::check(nccl.comm_init_rank(&s->comm, o.world_size, raw, o.rank), "ncclCommInitRank",
                         "k::dist::init (rank " + std::to_string(o.rank) + ")");
  }
  return group(std::move(s));
}

namespace detail {

inline int env_int(const char* name) {
  const char* v = config::env(name);
  if (!v)
    throw error(std::string("k::dist::init(): ") + name +
                " is not set (set KILN_RANK, KILN_WORLD_SIZE and, "
                "for more than one rank, KILN_DIST_ID_FILE, or pass k::dist::init_options)");
  try {
    return std::stoi(v);
  } catch (...) {
    throw error(std::string("k::dist::init(): ") + name + "=" + v + " is not a number");
  }
}

// Rank 0 writes the id (to a temporary name, then renamed, so no rank reads half a file); the
// others wait for it.
inline comm_id exchange_id(int rank, const std::string& path) {
  namespace fs = std::filesystem;
  if (rank == 0) {
    comm_id id = unique_id();
    const std::string tmp = path + ".tmp" + std::to_string(::getpid());
    {
      std::ofstream f(tmp);
      f << id.hex() << "\n";
      if (!f) throw error("k::dist::init(): cannot write KILN_DIST_ID_FILE " + path);
    }
    fs::rename(tmp, path);
    return id;
  }
  const char* t = config::env("KILN_DIST_TIMEOUT");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(t ? std::atoi(t) : 300);
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream f(path);
    std::string hex;
    if (f >> hex && hex.size() == 256) return comm_id::from_hex(hex);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  throw error("k::dist::init(): rank " + std::to_string(rank) + " waited for KILN_DIST_ID_FILE " + path +
              " and rank 0 never wrote it (KILN_DIST_TIMEOUT seconds, default 300)");
}

}  // namespace detail

// The launch by environment: KILN_RANK, KILN_WORLD_SIZE, KILN_DIST_ID_FILE (a path every rank sees;
// remove it before launching again), KILN_LOCAL_RANK (the GPU; default rank % GPUs of this host).
inline group init() {
  init_options o;
  o.rank = detail::env_int("KILN_RANK");
  o.world_size = detail::env_int("KILN_WORLD_SIZE");
  detail::check_rank("k::dist::init()", o.rank, o.world_size);
  if (const char* local = config::env("KILN_LOCAL_RANK")) o.device = cuda(std::atoi(local));
  if (o.world_size > 1) {
    const char* file = config::env("KILN_DIST_ID_FILE");
    if (!file) throw error("k::dist::init(): KILN_WORLD_SIZE > 1 needs KILN_DIST_ID_FILE, a path every rank can read");
    o.id = detail::exchange_id(o.rank, file);
  }
  return init(o);
}

// Runs fn(group&) on n threads, one per GPU of this host (cuda(0)..cuda(n-1)), each with its own
// communicator; returns when all are done and rethrows the first exception. n = 1 on a machine
// without a GPU runs fn once with a CPU group of world size 1.
template <class Fn>
void spawn(int n, Fn&& fn) {
  if (n < 1) throw error("k::dist::spawn: n is " + std::to_string(n) + "; it must be at least 1");
  if (n == 1 && !driver::available()) {
    group g = init({.rank = 0, .world_size = 1, .device = cpu});
    fn(g);
    return;
  }
  const int gpus = driver::device_count();
  if (n > gpus)
    throw device_error("k::dist::spawn: " + std::to_string(n) + " ranks need " + std::to_string(n) +
                       " GPUs and this host has " + std::to_string(gpus));
  std::vector<runtime::nccl::Comm> comms(static_cast<std::size_t>(n), nullptr);
  if (n > 1) {
    std::vector<int> devices(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) devices[static_cast<std::size_t>(r)] = r, driver::primary_context(r);
    runtime::nccl::check(runtime::nccl::api().comm_init_all(comms.data(), n, devices.data()), "ncclCommInitAll",
                         "k::dist::spawn");
  }
  std::vector<group> groups;
  for (int r = 0; r < n; ++r) {
    auto s = detail::make_state(r, n, cuda(r));
    s->comm = comms[static_cast<std::size_t>(r)];
    groups.emplace_back(std::move(s));
  }
  std::vector<std::exception_ptr> failed(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  std::once_flag abort_once;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        driver::make_current(r);
        fn(groups[static_cast<std::size_t>(r)]);
      } catch (...) {
        failed[static_cast<std::size_t>(r)] = std::current_exception();
        // The other ranks would wait for this one in their next collective forever: abort every
        // communicator, so that their collectives fail too and the first error is rethrown below.
        if (n > 1)
          std::call_once(abort_once, [&] {
            try {
              std::rethrow_exception(failed[static_cast<std::size_t>(r)]);
            } catch (const std::exception& e) {
              std::fprintf(stderr, "k::dist::spawn: rank %d failed (%s); aborting the communicators\n", r, e.what());
            } catch (...) {
            }
            for (auto& g : groups) {
              g.state().aborted = true;
              runtime::nccl::api().comm_abort(g.state().comm);
            }
          });
      }
    });
  for (auto& t : threads) t.join();
  groups.clear();  // destroys the communicators
  for (auto& e : failed)
    if (e) std::rethrow_exception(e);
}

}  // namespace dist
}  // namespace kiln
