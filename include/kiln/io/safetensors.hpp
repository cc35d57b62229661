// k::save, k::load and k::load_metadata: named tensors to and from a safetensors file, the format
// of Hugging Face's `safetensors` library in which PyTorch, JAX and NumPy checkpoints are shared.
//
// The format: an 8-byte little-endian unsigned length N, then N bytes of UTF-8 JSON (the header,
// padded with spaces to a multiple of 8 bytes so that the data is aligned), then the data buffer.
// The header maps each tensor's name to {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin,
// end]}: the byte range, relative to the start of the buffer, of its elements in row-major order
// and little-endian. An optional "__metadata__" entry maps strings to strings. kiln reads and
// writes the dtypes it has: F64, F32, F16, BF16, I64, I32 and BOOL.
//
// Writing puts the tensors in name order with no gaps, each copied to a contiguous host tensor in
// turn (any device, any layout), into `path + ".tmp"`, then renamed onto `path` (or the file a
// symbolic link there names): a save that fails (an exception, a full disk) leaves no half-written
// file, and an older file at `path` as it was. Reading accepts any order and any offsets inside the
// buffer that do not overlap: Python's library orders tensors by dtype alignment, then name.
//
// Errors are kiln::error, naming the path and what is wrong: a file that cannot be opened, read,
// written or renamed (with the system's reason); a malformed file (too short, a header length past
// its end, bad JSON, an unknown dtype, offsets that disagree with the shape, overlap or leave the
// buffer, a BOOL byte other than 0 or 1); a name given twice to save. The whole header is checked
// against the file's size before any data is read: a malformed file never makes kiln read outside
// it or allocate more than it holds.
#pragma once
#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../core/linkage.hpp"
// The file functions are defined where definitions are: every TU in header-only mode, only
// <kiln/src.hpp>'s with KILN_SEPARATE_COMPILATION (core/linkage.hpp), where the other TUs see
// k::save, k::load and k::load_metadata as plain functions declared below.
#if KILN_DEFINITIONS
#include "json.hpp"
#endif

#include "../runtime/api.hpp"

namespace kiln {

namespace detail::safetensors {

// The safetensors name of each dtype.
inline constexpr std::pair<dtype, std::string_view> dtype_names[] = {
    {f64, "F64"}, {f32, "F32"}, {f16, "F16"}, {bf16, "BF16"}, {i64, "I64"}, {i32, "I32"}, {boolean, "BOOL"}};
inline std::string_view name_of(dtype d) {
  return std::find_if(std::begin(dtype_names), std::end(dtype_names), [&](auto& n) { return n.first == d; })->second;
}

// The system's reason for the last failed call; read it before making another.
inline std::string system_reason() { return std::strerror(errno); }

inline void require_little_endian(const char* op) {
  if constexpr (std::endian::native != std::endian::little)
    throw error(std::string(op) + ": safetensors files are little-endian, and this machine is not");
}

// A header checked against its file: each tensor's dtype, shape and byte range in the data buffer
// (in data order), the metadata, and where the data buffer starts in the file.
struct Entry {
  std::string name;
  dtype dt = f32;
  Dims shape;
  std::uint64_t begin = 0, end = 0;
};
struct Header {
  std::vector<Entry> entries;
  std::map<std::string, std::string> metadata;
  std::uint64_t data_start = 0;
};

// A file opened for reading, closed on every way out; errors name `op` and the path.
class Reader {
 public:
  Reader(const std::string& path, const char* op) : path_(path), op_(op), file_(std::fopen(path.c_str(), "rb")) {
    if (!file_) throw error(op_ + ": cannot open " + path_ + ": " + system_reason());
  }
  ~Reader() { std::fclose(file_); }
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  std::uint64_t size() {
    long end = std::fseek(file_, 0, SEEK_END) == 0 ? std::ftell(file_) : -1L;
    if (end < 0) throw error(op_ + ": cannot read " + path_ + ": " + system_reason());
    return static_cast<std::uint64_t>(end);
  }
  void read_at(std::uint64_t offset, void* out, std::uint64_t bytes) {
    if (bytes == 0) return;
    if (std::fseek(file_, static_cast<long>(offset), SEEK_SET) != 0 ||
        std::fread(out, 1, static_cast<std::size_t>(bytes), file_) != bytes)
      throw error(op_ + ": cannot read " + path_ + ": " +
                  (std::ferror(file_) ? system_reason() : "it ended early (was it changed while being read?)"));
  }
  error malformed(const std::string& what) const {
    return error(op_ + ": " + path_ + " is not a valid safetensors file: " + what);
  }

 private:
  std::string path_, op_;
  std::FILE* file_;
};

// A size or offset of the header: an integer in [0, 2^63).
#if KILN_DEFINITIONS
inline Entry parse_entry(const Reader& file, const std::string& name, const json::Value& j, std::uint64_t data_size) {
  const std::string what = "tensor '" + name + "'";
  if (!j.is_object()) throw file.malformed(what + " is described by " + j.dump() + ", not a JSON object");
  Entry e;
  e.name = name;
  const json::Value* dt = j.find("dtype");
  if (!dt || !dt->is_string()) throw file.malformed(what + " has no \"dtype\" string");
  auto known =
      std::find_if(std::begin(dtype_names), std::end(dtype_names), [&](const auto& n) { return n.second == dt->text; });
  if (known == std::end(dtype_names))
    throw file.malformed(what + " has dtype " + dt->dump() +
                         ", which kiln does not have (it reads F64, F32, F16, BF16, I64, I32 and BOOL)");
  e.dt = known->first;

  const json::Value* shape = j.find("shape");
  auto is_size = [](const json::Value& v) { return v.size_value() >= 0; };
  if (!shape || !shape->is_array() || !std::all_of(shape->items.begin(), shape->items.end(), is_size))
    throw file.malformed(what + " has no \"shape\" array of non-negative integers");
  if (shape->items.size() > std::size_t(max_rank))
    throw file.malformed(what + " has " + std::to_string(shape->items.size()) + " dimensions; kiln supports at most " +
                         std::to_string(max_rank));
  // A zero size empties a tensor, but the product of the others must still fit an int64 (strides).
  std::uint64_t numel = 1, nonzero = 1;
  for (const auto& s : shape->items) {
    auto n = static_cast<std::uint64_t>(s.size_value());
    if (n != 0 && nonzero > std::uint64_t(std::numeric_limits<std::int64_t>::max()) / n)
      throw file.malformed(what + " has shape " + shape->dump() + ", too many elements for kiln");
    e.shape.push_back(static_cast<std::int64_t>(n));
    nonzero *= n == 0 ? 1 : n;
    numel *= n;
  }

  const json::Value* offsets = j.find("data_offsets");
  if (!offsets || !offsets->is_array() || offsets->items.size() != 2 || !is_size(offsets->items[0]) ||
      !is_size(offsets->items[1]))
    throw file.malformed(what + " has no \"data_offsets\" pair of non-negative integers");
  e.begin = static_cast<std::uint64_t>(offsets->items[0].size_value());
  e.end = static_cast<std::uint64_t>(offsets->items[1].size_value());
  if (e.begin > e.end || e.end > data_size)
    throw file.malformed(what + " has data_offsets " + offsets->dump() + ", outside the data buffer of " +
                         std::to_string(data_size) + " bytes");
  std::uint64_t item = itemsize(e.dt), have = e.end - e.begin;
  if (numel != have / item || have % item != 0)
    throw file.malformed(what + " has shape " + shape->dump() + " of " + dt->text + " (" + std::to_string(numel) +
                         " elements of " + std::to_string(item) + " bytes), but data_offsets " + offsets->dump() +
                         " hold " + std::to_string(have) + " bytes");
  return e;
}

// Reads and checks the header of an open file (see the top of this file for what is checked).
inline Header read_header(Reader& file) {
  std::uint64_t size = file.size();
  if (size < 8)
    throw file.malformed("it is " + std::to_string(size) + " bytes long, too short to hold the 8-byte header length");
  unsigned char length[8];
  file.read_at(0, length, 8);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | length[i];
  if (n > size - 8)
    throw file.malformed("its header length is " + std::to_string(n) + " bytes, but only " + std::to_string(size - 8) +
                         " bytes follow it");
  std::string text(static_cast<std::size_t>(n), '\0');
  file.read_at(8, text.data(), n);
  json::Value header;
  try {
    header = json::parse(text);
  } catch (const json::parse_error& e) {
    throw file.malformed("its header is not valid JSON (" + std::string(e.what()) + ")");
  }
  if (!header.is_object()) throw file.malformed("its header is not a JSON object");

  Header h;
  h.data_start = 8 + n;
  for (const auto& [key, value] : header.members) {
    if (key != "__metadata__") {
      h.entries.push_back(parse_entry(file, key, value, size - h.data_start));
      continue;
    }
    if (!value.is_object()) throw file.malformed("its \"__metadata__\" is not a JSON object");
    for (const auto& [k, v] : value.members) {
      if (!v.is_string())
        throw file.malformed("its \"__metadata__\" maps '" + k + "' to " + v.dump() + ", not to a string");
      h.metadata[k] = v.text;
    }
  }
  std::sort(h.entries.begin(), h.entries.end(),
            [](const Entry& a, const Entry& b) { return std::pair(a.begin, a.end) < std::pair(b.begin, b.end); });
  const Entry* last = nullptr;  // the non-empty tensor that ends furthest
  for (const Entry& e : h.entries) {
    if (e.begin == e.end) continue;
    if (last && e.begin < last->end)
      throw file.malformed("tensors '" + last->name + "' (bytes " + std::to_string(last->begin) + " to " +
                           std::to_string(last->end) + ") and '" + e.name + "' (bytes " + std::to_string(e.begin) +
                           " to " + std::to_string(e.end) + ") overlap");
    last = &e;
  }
  return h;
}

// Where saving to `path` writes: the file a symbolic link there points to, else `path` itself.
// A device or pipe there is refused, since renaming onto it would replace it.
inline std::string save_target(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::string target = fs::is_symlink(path, ec) ? fs::weakly_canonical(path, ec).string() : path;
  if (ec) target = path;
  if (fs::is_other(fs::status(target, ec)))
    throw error("k::save: cannot write " + path + ": it exists and is not a regular file");
  return target;
}

// `path + ".tmp"` being written; removed again unless commit() renames it onto `path`.
class AtomicWriter {
 public:
  explicit AtomicWriter(const std::string& path)
      : path_(save_target(path)), temp_(path_ + ".tmp"), file_(std::fopen(temp_.c_str(), "wb")) {
    if (!file_) throw error("k::save: cannot write " + path_ + " (creating " + temp_ + "): " + system_reason());
  }
  ~AtomicWriter() {
    if (!file_) return;
    std::fclose(file_);
    std::remove(temp_.c_str());
  }
  AtomicWriter(const AtomicWriter&) = delete;
  AtomicWriter& operator=(const AtomicWriter&) = delete;

  void write(const void* data, std::size_t bytes) {
    if (bytes != 0 && std::fwrite(data, 1, bytes, file_) != bytes)
      throw error("k::save: cannot write " + path_ + " (writing " + temp_ + "): " + system_reason());
  }
  void commit() {
    bool closed = std::fclose(std::exchange(file_, nullptr)) == 0;  // flushes: a full disk shows here
    if (closed && std::rename(temp_.c_str(), path_.c_str()) == 0) return;
    std::string why = system_reason();
    std::remove(temp_.c_str());
    throw error("k::save: cannot write " + path_ + " (" + (closed ? "renaming " : "closing ") + temp_ + "): " + why);
  }

 private:
  std::string path_, temp_;
  std::FILE* file_;
};
#endif

#if KILN_DEFINITIONS
// k::save, k::load and k::load_metadata's work (below).
inline void write_file(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  namespace st = detail::safetensors;
  st::require_little_endian("k::save");
  std::vector<const std::pair<std::string, Tensor>*> order;
  for (const auto& named : tensors) order.push_back(&named);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->first < b->first; });
  auto fail = [&](const std::string& why) { return error("k::save: " + why + " (saving " + path + ")"); };
  for (std::size_t i = 0; i < order.size(); ++i) {
    const auto& [name, t] = *order[i];
    if (i > 0 && order[i - 1]->first == name) throw fail("the name '" + name + "' is given twice");
    if (name == "__metadata__") throw fail("'__metadata__' names the metadata, not a tensor");
    if (!t.defined()) throw fail("tensor '" + name + "' is undefined");
  }

  // Compact JSON, the metadata first and each tensor's keys in the order Python's library writes.
  std::string text = "{";
  try {
    if (!metadata.empty()) {
      text += "\"__metadata__\":{";
      for (const auto& [k, v] : metadata)
        text += (text.back() == '{' ? "" : ",") + detail::json::quote(k) + ":" + detail::json::quote(v);
      text += "}";
    }
    std::uint64_t offset = 0;
    for (const auto* named : order) {
      const Tensor& t = named->second;
      text += (text.size() == 1 ? "" : ",") + detail::json::quote(named->first) + ":{\"dtype\":\"" +
              std::string(st::name_of(t.dtype())) + "\",\"shape\":[";
      for (int d = 0; d < t.shape().size(); ++d) text += (d ? "," : "") + std::to_string(t.shape()[d]);
      text += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + t.nbytes()) + "]}";
      offset += t.nbytes();
    }
  } catch (const detail::json::parse_error& e) {  // a name or metadata string that is not UTF-8
    throw error("k::save: cannot write " + path + ": " + e.what());
  }
  text += "}";
  text.append((8 - text.size() % 8) % 8, ' ');

  st::AtomicWriter out(path);
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(text.size() >> (8 * i));
  out.write(length, 8);
  out.write(text.data(), text.size());
  for (const auto* named : order) {
    Tensor host = named->second.to(cpu).contiguous();
    out.write(host.data_ptr(), host.nbytes());
  }
  out.commit();
}

inline std::map<std::string, Tensor> read_file(const std::string& path, Device device) {
  namespace st = detail::safetensors;
  st::require_little_endian("k::load");
  st::Reader file(path, "k::load");
  st::Header header = st::read_header(file);
  std::map<std::string, Tensor> out;
  for (const st::Entry& e : header.entries) {
    Tensor t = Tensor::empty(e.shape, e.dt, cpu);
    file.read_at(header.data_start + e.begin, t.data_ptr(), e.end - e.begin);
    if (e.dt == dtype::boolean) {
      const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
      for (std::uint64_t i = 0; i < e.end - e.begin; ++i)
        if (bytes[i] > 1)
          throw file.malformed("BOOL tensor '" + e.name + "' holds the byte " + std::to_string(bytes[i]) +
                               " at element " + std::to_string(i) + " (a BOOL is 0 or 1)");
    }
    out.emplace(e.name, device.is_cpu() ? t : t.to(device));
  }
  return out;
}

inline std::map<std::string, std::string> read_metadata(const std::string& path) {
  detail::safetensors::Reader file(path, "k::load_metadata");
  return detail::safetensors::read_header(file).metadata;
}
#endif
}  // namespace detail::safetensors

// The three functions as entry points: inline in header-only mode, defined in <kiln/src.hpp>'s TU
// with KILN_SEPARATE_COMPILATION (core/linkage.hpp's KILN_DECL).
namespace detail::safetensors {
KILN_DECL void save_file(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::map<std::string, std::string>& metadata);
KILN_DECL std::map<std::string, Tensor> load_file(const std::string& path, Device device);
KILN_DECL std::map<std::string, std::string> load_file_metadata(const std::string& path);
#if KILN_DEFINITIONS
KILN_DECL void save_file(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  write_file(path, tensors, metadata);
}
KILN_DECL std::map<std::string, Tensor> load_file(const std::string& path, Device device) {
  return read_file(path, device);
}
KILN_DECL std::map<std::string, std::string> load_file_metadata(const std::string& path) { return read_metadata(path); }
#endif
}  // namespace detail::safetensors

// Writes the tensors and optional string metadata to `path` in the safetensors format, replacing
// any file there: `k::save("model.safetensors", {{"wte", wte}, {"wpe", wpe}})`.
inline void save(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                 const std::map<std::string, std::string>& metadata = {}) {
  detail::safetensors::save_file(path, tensors, metadata);
}
// Reads every tensor of a safetensors file, onto `device` (the host by default), by name.
inline std::map<std::string, Tensor> load(const std::string& path, Device device = cpu) {
  return detail::safetensors::load_file(path, device);
}
// The "__metadata__" strings of a safetensors file (empty if it has none); reads only the header.
inline std::map<std::string, std::string> load_metadata(const std::string& path) {
  return detail::safetensors::load_file_metadata(path);
}

}  // namespace kiln
