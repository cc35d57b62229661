// Named log channels switched on by KILN_LOGS (as TORCH_LOGS): `log_enabled` is one relaxed load,
// so call sites can guard message building with it at no cost when logging is off.
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include "../core/config.hpp"

namespace kiln::debug {

enum class Channel : std::uint8_t {
  graph,
  decomp,
  autodiff,
  fusion,
  output_code,
  guards,
  recompiles,
  cache,
  autotune,
  graph_breaks
};

inline constexpr std::array<std::string_view, 10> channel_names = {"graph",       "decomp",      "autodiff",   "fusion",
                                                                   "output_code", "guards",      "recompiles", "cache",
                                                                   "autotune",    "graph_breaks"};

constexpr std::string_view channel_name(Channel c) { return channel_names[std::size_t(c)]; }

// Where log text goes (one or more whole lines, each ending in '\n'); the default writes to stderr.
// Sinks are called under the log mutex, so they need no locking of their own.
using LogSink = void (*)(Channel, std::string_view text);

namespace detail {

// Set until KILN_LOGS has been read; a set bit never names a channel.
inline constexpr std::uint32_t k_unparsed = 1u << 31;
inline constexpr std::uint32_t k_all_channels = (1u << channel_names.size()) - 1;

// Constant-initialised, so it is valid even when logging is used during static initialisation.
inline std::atomic<std::uint32_t> log_mask{k_unparsed};

inline std::mutex& log_mutex() {
  static std::mutex m;
  return m;
}

inline void write_to_stderr(Channel, std::string_view line) { std::fwrite(line.data(), 1, line.size(), stderr); }

inline std::atomic<LogSink> log_sink{&write_to_stderr};

inline std::uint32_t channel_bit(std::string_view name) {
  if (name == "all") return k_all_channels;
  for (std::size_t i = 0; i < channel_names.size(); ++i)
    if (channel_names[i] == name) return 1u << i;
  return 0;
}

// Parses "graph,guards" (spaces ignored, "all" = every channel). Unknown names are reported once,
// because a typo silently logging nothing is the worst outcome for a debugging switch.
inline std::uint32_t parse_channels(std::string_view spec) {
  std::uint32_t mask = 0;
  while (!spec.empty()) {
    std::size_t comma = spec.find(',');
    std::string_view item = spec.substr(0, comma);
    spec = comma == std::string_view::npos ? std::string_view() : spec.substr(comma + 1);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (item.empty()) continue;
    std::uint32_t bit = channel_bit(item);
    if (bit == 0)
      std::fprintf(stderr,
                   "[kiln] KILN_LOGS: unknown channel '%.*s' (known: all, graph, decomp, "
                   "autodiff, fusion, output_code, guards, recompiles, cache, autotune, graph_breaks)\n",
                   int(item.size()), item.data());
    mask |= bit;
  }
  return mask;
}

inline std::uint32_t load_mask_from_env() {
  const char* env = kiln::config::env("KILN_LOGS");
  std::uint32_t parsed = env ? parse_channels(env) : 0;
  std::uint32_t expected = k_unparsed;
  // Another thread (or set_log_channels) may have won the race; its value stands.
  log_mask.compare_exchange_strong(expected, parsed, std::memory_order_relaxed);
  return log_mask.load(std::memory_order_relaxed);
}

}  // namespace detail

inline bool log_enabled(Channel c) {
  std::uint32_t mask = detail::log_mask.load(std::memory_order_relaxed);
  if (mask & detail::k_unparsed) [[unlikely]]
    mask = detail::load_mask_from_env();
  return (mask >> unsigned(c)) & 1u;
}

// Replaces the KILN_LOGS setting from code (same syntax), e.g. to turn channels on in a test.
inline void set_log_channels(std::string_view spec) {
  detail::log_mask.store(detail::parse_channels(spec), std::memory_order_relaxed);
}

// Installs a sink (nullptr restores stderr) and returns the previous one.
inline LogSink set_log_sink(LogSink sink) { return detail::log_sink.exchange(sink ? sink : &detail::write_to_stderr); }

// Writes `[kiln:<channel>] ` before every line of msg; whole messages never interleave.
inline void log(Channel c, std::string_view msg) {
  std::string prefix = "[kiln:" + std::string(channel_name(c)) + "] ";
  std::string text;
  text.reserve(msg.size() + prefix.size() + 1);
  do {
    std::size_t nl = msg.find('\n');
    text.append(prefix).append(msg.substr(0, nl)).push_back('\n');
    msg = nl == std::string_view::npos ? std::string_view() : msg.substr(nl + 1);
  } while (!msg.empty());
  std::lock_guard lock(detail::log_mutex());
  detail::log_sink.load()(c, text);
}

// Logs make_message() only when the channel is on, so the message is not built otherwise.
template <class MakeMessage>
void log_lazy(Channel c, MakeMessage&& make_message) {
  if (log_enabled(c)) log(c, std::forward<MakeMessage>(make_message)());
}

}  // namespace kiln::debug
