// k::save, k::load and k::load_metadata (API.md "Models"; io/safetensors.hpp): bit-exact round trips of
// every dtype, odd, 0-d, empty and non-contiguous tensors, metadata, the file's bytes against a header
// written here by hand, a file laid out the way Python's safetensors library writes it, the errors of
// unreadable, unwritable and malformed files, and a CUDA round trip where there is a device.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include <kiln/io/json.hpp>
#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>

#include "have_gpu.hpp"

namespace k = kiln;
namespace fs = std::filesystem;

namespace {

// A file name in a folder of this process's own, removed with everything in it at exit.
std::string temp_path(const std::string& name) {
  struct Folder {
    fs::path path = fs::temp_directory_path() / ("kiln_test_save_load_" + std::to_string(::getpid()));
    Folder() {
      fs::remove_all(path);
      fs::create_directories(path);
    }
    ~Folder() {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  };
  static const Folder folder;
  return (folder.path / name).string();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The 8-byte little-endian length of a header.
std::string length_prefix(std::uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>(n >> (8 * i));
  return s;
}
// A safetensors file from a header and a data buffer, padded as the format asks.
std::string safetensors_file(std::string header, const std::string& data) {
  header.append((8 - header.size() % 8) % 8, ' ');
  return length_prefix(header.size()) + header + data;
}
template <class T>
std::string bytes_of_values(const std::vector<T>& v) {
  std::string s(v.size() * sizeof(T), '\0');
  if (!v.empty()) std::memcpy(s.data(), v.data(), s.size());
  return s;
}

// A tensor's elements as row-major bytes, whatever its device and layout.
std::string bytes_of(const k::Tensor& t) {
  k::Tensor host = t.to(k::cpu).contiguous();
  return std::string(static_cast<const char*>(host.data_ptr()), host.nbytes());
}

// Random values of any dtype, none of them all zeros: normals for floats, every bit random for
// integers, a random mix of true and false.
k::Tensor random(const k::Dims& shape, k::dtype dt, std::uint64_t seed) {
  if (k::is_floating(dt)) return k::randn(shape, dt, k::cpu, seed);
  k::Tensor t = k::Tensor::empty(shape, dt, k::cpu);
  auto* p = static_cast<unsigned char*>(t.data_ptr());
  for (std::size_t i = 0; i < t.nbytes(); ++i) {
    std::uint64_t r = k::detail::mix(seed * 1000003 + i);
    p[i] = dt == k::boolean ? static_cast<unsigned char>(r & 1) : static_cast<unsigned char>(r >> 17);
  }
  return t;
}

// The message of the kiln::error that f throws; fails the test when it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const k::error& e) {
    return e.what();
  }
  FAIL("no kiln::error was thrown");
  return {};
}

// Loading the file made of these bytes fails with a message that names it and contains `want`; so
// does reading its metadata when the fault is in the header.
void check_malformed(const std::string& name, const std::string& bytes, const std::string& want,
                     bool in_header = true) {
  std::string path = temp_path(name);
  write_file(path, bytes);
  INFO("file " << name);
  CHECK_THROWS_AS(k::load(path), k::error);
  std::string msg = error_of([&] { k::load(path); });
  CHECK(msg.find(path) != std::string::npos);
  CHECK(msg.find(want) != std::string::npos);
  CHECK(msg.find("not a valid safetensors file") != std::string::npos);
  if (in_header) CHECK(error_of([&] { k::load_metadata(path); }).find(path) != std::string::npos);
}

const std::vector<k::dtype> all_dtypes = {k::f64, k::f32, k::f16, k::bf16, k::i64, k::i32, k::boolean};

}  // namespace

TEST_CASE("save and load: every dtype round-trips bit for bit, in odd, 0-d and empty shapes") {
  std::vector<std::pair<std::string, k::Tensor>> tensors;
  std::uint64_t seed = 1;
  for (k::dtype dt : all_dtypes) {
    std::string n(k::name(dt));
    tensors.push_back({n + ".matrix", random({37, 129}, dt, seed++)});
    tensors.push_back({n + ".scalar", random({}, dt, seed++)});
    tensors.push_back({n + ".empty", random({0, 5}, dt, seed++)});
    tensors.push_back({n + ".rank4", random({3, 1, 5, 2}, dt, seed++)});
  }
  std::string path = temp_path("all_dtypes.safetensors");
  k::save(path, tensors);
  std::map<std::string, k::Tensor> loaded = k::load(path);
  CHECK(loaded.size() == tensors.size());
  for (const auto& [key, t] : tensors) {
    const std::string& name = key;  // INFO captures it: clang < 16 cannot capture a structured binding
    INFO(name);
    if (t.numel() > 1) CHECK(bytes_of(t).find_first_not_of('\0') != std::string::npos);  // not all zeros
    REQUIRE(loaded.count(name) == 1);
    const k::Tensor& got = loaded.at(name);
    CHECK(got.dtype() == t.dtype());
    CHECK(got.shape() == t.shape());
    CHECK(got.device() == k::cpu);
    CHECK(got.is_contiguous());
    CHECK(bytes_of(got) == bytes_of(t));
    CHECK(k::reference::read(got).data == k::reference::read(t).data);
  }
  CHECK(k::load_metadata(path).empty());
  CHECK_FALSE(fs::exists(path + ".tmp"));
  // The data starts 8-byte aligned, and the file ends where the last tensor does.
  std::string file = read_file(path);
  std::uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  CHECK((8 + n) % 8 == 0);
  std::size_t data = 0;
  for (const auto& named : tensors) data += named.second.nbytes();
  CHECK(file.size() == 8 + n + data);
}

TEST_CASE("save and load: non-contiguous views, offsets and an empty list") {
  k::Tensor base = random({6, 9}, k::f32, 7);
  k::Tensor transposed = k::Tensor(k::transpose(base, 0, 1));  // may be a strided view
  k::Tensor strided = base.as_strided({3, 4}, {18, 2}, 1);     // rows 0, 2, 4; columns 1, 3, 5, 7
  k::Tensor i64 = random({5, 4}, k::i64, 8).as_strided({4, 5}, {1, 4}, 0);
  REQUIRE_FALSE(strided.is_contiguous());
  REQUIRE_FALSE(i64.is_contiguous());
  std::string path = temp_path("views.safetensors");
  k::save(path, {{"t", transposed}, {"s", strided}, {"i", i64}});
  auto loaded = k::load(path);
  CHECK(loaded.at("t").shape() == std::vector<std::int64_t>{9, 6});
  CHECK(k::to_vector<float>(loaded.at("t")) == k::to_vector<float>(transposed));
  CHECK(k::to_vector<float>(loaded.at("s")) == k::to_vector<float>(strided));
  CHECK(k::to_vector<std::int64_t>(loaded.at("i")) == k::to_vector<std::int64_t>(i64));
  CHECK(k::to_vector<float>(loaded.at("s"))[1] == k::to_vector<float>(base)[3]);

  std::string empty = temp_path("nothing.safetensors");
  k::save(empty, {});
  CHECK(read_file(empty) == length_prefix(8) + "{}      ");
  CHECK(k::load(empty).empty());
}

TEST_CASE("save and load: metadata round-trips, and saving again replaces the file") {
  std::string path = temp_path("metadata.safetensors");
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "1200"}, {"note", "unicode: \xc3\xa9 \"q\""}};
  k::save(path, {{"w", random({4, 3}, k::bf16, 3)}}, meta);
  CHECK(k::load_metadata(path) == meta);
  k::save(path, {{"v", random({2}, k::f16, 4)}});
  auto loaded = k::load(path);
  CHECK(loaded.size() == 1);
  CHECK(loaded.count("v") == 1);
  CHECK(k::load_metadata(path).empty());
}

TEST_CASE("save: the bytes of a small file, against a header written by hand") {
  std::string path = temp_path("layout.safetensors");
  k::Tensor b = k::from_vector(std::vector<float>{1.5f, -2.0f}, {2});
  k::Tensor a = k::from_vector(std::vector<std::int32_t>{7}, {});
  k::save(path, {{"b", b}, {"a", a}}, {{"k", "v"}});
  // Name order, no gaps, compact JSON in the order Python's library writes its keys, padded with
  // spaces to 136 bytes.
  const std::string header = R"({"__metadata__":{"k":"v"},"a":{"dtype":"I32","shape":[],"data_offsets":[0,4]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  REQUIRE(header.size() == 132);
  const std::string expected = std::string("\x88\0\0\0\0\0\0\0", 8) + header + "    " +  // 0x88 = 136
                               std::string("\x07\0\0\0", 4) +                            // a = 7
                               std::string("\0\0\xc0\x3f\0\0\0\xc0", 8);                 // b = 1.5, -2
  CHECK(read_file(path) == expected);
}

TEST_CASE("load: a file in the layout of Python's safetensors library") {
  // Python orders the data by dtype alignment, then name, and lists the header in that order.
  const std::vector<double> z = {0.25, -3.5};
  const std::vector<float> b = {1.5f, -2.0f, 3.0f};
  const std::vector<std::int32_t> a = {-7};
  const std::vector<std::uint16_t> h = {0x3c00, 0xc000};  // F16 1.0, -2.0
  const std::string m = std::string("\x01\x00\x01", 3);
  const std::string header =
      R"({"__metadata__":{"format":"np"},"z":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},)"
      R"("b":{"dtype":"F32","shape":[3],"data_offsets":[16,28]},"a":{"dtype":"I32","shape":[],"data_offsets":[28,32]},)"
      R"("h":{"dtype":"F16","shape":[1,2],"data_offsets":[32,36]},"m":{"dtype":"BOOL","shape":[3],"data_offsets":[36,39]}})";
  std::string path = temp_path("python_layout.safetensors");
  write_file(path, safetensors_file(
                       header, bytes_of_values(z) + bytes_of_values(b) + bytes_of_values(a) + bytes_of_values(h) + m));
  auto t = k::load(path);
  CHECK(t.size() == 5);
  CHECK(k::to_vector<double>(t.at("z")) == z);
  CHECK(k::to_vector<float>(t.at("b")) == b);
  CHECK(t.at("a").shape().empty());
  CHECK(k::to_vector<std::int32_t>(t.at("a")) == a);
  CHECK(t.at("h").dtype() == k::f16);
  CHECK(t.at("h").shape() == std::vector<std::int64_t>{1, 2});
  CHECK(k::to_vector<float>(t.at("h")) == std::vector<float>{1.0f, -2.0f});
  CHECK(k::reference::read(t.at("m")).data == std::vector<double>{1, 0, 1});
  CHECK(k::load_metadata(path) == std::map<std::string, std::string>{{"format", "np"}});

  // Any order and any valid offsets: listed backwards, a gap, an empty tensor sharing an offset.
  const std::string backwards =
      R"({"y":{"dtype":"I64","shape":[0,3],"data_offsets":[8,8]},"x":{"dtype":"I64","shape":[1],"data_offsets":[8,16]},)"
      R"("w":{"dtype":"I64","shape":[],"data_offsets":[0,8]}})";
  write_file(path, safetensors_file(backwards, bytes_of_values(std::vector<std::int64_t>{-1, 1LL << 62})));
  t = k::load(path);
  CHECK(k::to_vector<std::int64_t>(t.at("w")) == std::vector<std::int64_t>{-1});
  CHECK(k::to_vector<std::int64_t>(t.at("x")) == std::vector<std::int64_t>{1LL << 62});
  CHECK(t.at("y").shape() == std::vector<std::int64_t>{0, 3});
}

TEST_CASE("save and load: files that cannot be opened or written") {
  std::string missing = temp_path("no_such_file.safetensors");
  CHECK_THROWS_AS(k::load(missing), k::error);
  std::string msg = error_of([&] { k::load(missing); });
  CHECK(msg.find(missing) != std::string::npos);
  CHECK(msg.find(std::strerror(ENOENT)) != std::string::npos);
  CHECK(error_of([&] { k::load_metadata(missing); }).find(missing) != std::string::npos);

  k::Tensor x = random({3}, k::f32, 5);
  std::string no_dir = temp_path("no_such_dir") + "/x.safetensors";
  msg = error_of([&] { k::save(no_dir, {{"x", x}}); });
  CHECK(msg.find(no_dir) != std::string::npos);
  CHECK(msg.find(std::strerror(ENOENT)) != std::string::npos);

  // A directory in the way of the final rename: the error names the path, and the temporary file
  // is removed.
  std::string dir = temp_path("a_directory");
  fs::create_directories(dir + "/inside");
  msg = error_of([&] { k::save(dir, {{"x", x}}); });
  CHECK(msg.find(dir) != std::string::npos);
  CHECK(msg.find("renaming") != std::string::npos);
  CHECK_FALSE(fs::exists(dir + ".tmp"));
  msg = error_of([&] { k::load(dir); });
  CHECK(msg.find(dir) != std::string::npos);

  // A pipe is refused rather than replaced by the rename.
  std::string pipe = temp_path("a_pipe");
  REQUIRE(::mkfifo(pipe.c_str(), 0600) == 0);
  msg = error_of([&] { k::save(pipe, {{"x", x}}); });
  CHECK(msg.find(pipe + ": it exists and is not a regular file") != std::string::npos);
  CHECK(fs::is_fifo(pipe));
}

TEST_CASE("save: through a symbolic link, the file it names is replaced and the link kept") {
  std::string target = temp_path("target.safetensors"), link = temp_path("link.safetensors");
  k::save(target, {{"old", random({2}, k::f32, 10)}});
  fs::create_symlink(target, link);
  k::Tensor x = random({4}, k::i32, 11);
  k::save(link, {{"x", x}});
  CHECK(fs::is_symlink(link));
  auto loaded = k::load(target);
  CHECK(loaded.count("old") == 0);
  CHECK(bytes_of(loaded.at("x")) == bytes_of(x));
}

TEST_CASE("save: duplicate, reserved and undefined names fail and keep the old file") {
  std::string path = temp_path("kept.safetensors");
  k::Tensor x = random({3}, k::f32, 6);
  k::save(path, {{"x", x}});
  const std::string before = read_file(path);
  std::string msg = error_of([&] { k::save(path, {{"w", x}, {"x", x}, {"w", x}}); });
  CHECK(msg.find("'w' is given twice") != std::string::npos);
  CHECK(msg.find(path) != std::string::npos);
  msg = error_of([&] { k::save(path, {{"__metadata__", x}}); });
  CHECK(msg.find("'__metadata__' names the metadata") != std::string::npos);
  msg = error_of([&] { k::save(path, {{"x", x}, {"u", k::Tensor()}}); });
  CHECK(msg.find("'u' is undefined") != std::string::npos);
  CHECK(read_file(path) == before);
  CHECK_FALSE(fs::exists(path + ".tmp"));
}

TEST_CASE("load: malformed files are kiln errors that name the file and the fault") {
  const std::string f32x2 = bytes_of_values(std::vector<float>{1, 2});
  auto one = [&](const std::string& entry) { return safetensors_file(R"({"t":)" + entry + "}", f32x2); };

  check_malformed("empty", "", "0 bytes long");
  check_malformed("short", "abc", "too short");
  check_malformed("long_header", length_prefix(1000) + R"({"t":{}})", "header length is 1000 bytes");
  check_malformed("huge_header", length_prefix(~0ULL) + "{}      ", "header length is 18446744073709551615");
  check_malformed("bad_json", safetensors_file(R"({"t":{"dtype":"F32",)", ""), "not valid JSON");
  check_malformed("not_object", safetensors_file("[1, 2]", ""), "not a JSON object");
  check_malformed("entry_not_object", one("3"), "tensor 't' is described by 3");
  check_malformed("no_dtype", one(R"({"shape":[2],"data_offsets":[0,8]})"), "no \"dtype\"");
  check_malformed("f8", one(R"({"dtype":"F8_E4M3","shape":[8],"data_offsets":[0,8]})"), "dtype \"F8_E4M3\"");
  check_malformed("u8", one(R"({"dtype":"U8","shape":[8],"data_offsets":[0,8]})"), "dtype \"U8\"");
  check_malformed("negative_shape", one(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})"), "\"shape\"");
  check_malformed("float_shape", one(R"({"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})"), "\"shape\"");
  check_malformed("rank9", one(R"({"dtype":"F32","shape":[1,1,1,1,1,1,1,1,2],"data_offsets":[0,8]})"), "9 dimensions");
  check_malformed("overflow", one(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]})"),
                  "too many elements");
  check_malformed("no_offsets", one(R"({"dtype":"F32","shape":[2]})"), "\"data_offsets\"");
  check_malformed("three_offsets", one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,4,8]})"), "\"data_offsets\"");
  check_malformed("size_mismatch", one(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"),
                  "shape [3] of F32 (3 elements of 4 bytes), but data_offsets [0,8] hold 8 bytes");
  check_malformed("dtype_mismatch", one(R"({"dtype":"F64","shape":[2],"data_offsets":[0,8]})"),
                  "(2 elements of 8 bytes)");
  check_malformed("out_of_range", one(R"({"dtype":"F32","shape":[3],"data_offsets":[0,12]})"),
                  "outside the data buffer of 8 bytes");
  check_malformed("reversed", one(R"({"dtype":"F32","shape":[0],"data_offsets":[8,4]})"), "outside the data buffer");
  check_malformed("truncated_data",
                  safetensors_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", f32x2.substr(0, 5)),
                  "outside the data buffer of 5 bytes");
  check_malformed("overlap",
                  safetensors_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                   R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                   f32x2),
                  "tensors 'a' (bytes 0 to 8) and 'b' (bytes 4 to 8) overlap");
  check_malformed("bad_metadata", safetensors_file(R"({"__metadata__":{"n":3}})", ""), "maps 'n' to 3");
  check_malformed("metadata_list", safetensors_file(R"({"__metadata__":["x"]})", ""), "\"__metadata__\"");
  std::string bad_bool = safetensors_file(R"({"m":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", "\x01\x02");
  check_malformed("bool", bad_bool, "holds the byte 2 at element 1", false);
}

TEST_CASE("json: the header's reader and writer (io/json.hpp)") {
  namespace json = k::detail::json;
  using Kind = json::Value::Kind;
  // Every kind of value, whitespace between tokens, and the compact text written back.
  json::Value v = json::parse(" {\"a\" : [1, -2.5e3, 0, true, false, null, \"x\"],\n\t\"b\":{}, \"c\":[]}\r\n");
  REQUIRE(v.is_object());
  CHECK(v.dump() == R"({"a":[1,-2.5e3,0,true,false,null,"x"],"b":{},"c":[]})");
  const json::Value* a = v.find("a");
  REQUIRE(a);
  REQUIRE(a->items.size() == 7);
  CHECK(a->items[3].kind == Kind::boolean);
  CHECK(a->items[5].kind == Kind::null);
  CHECK(v.find("d") == nullptr);
  // Sizes: integers in [0, 2^63) exactly; fractions, exponents, negatives and 2^63 are not.
  CHECK(json::parse("9223372036854775807").size_value() == 9223372036854775807LL);
  for (const char* no : {"9223372036854775808", "18446744073709551616", "-1", "2.0", "1e3", "\"3\""})
    CHECK_MESSAGE(json::parse(no).size_value() == -1, no);
  CHECK(json::parse("-0").size_value() == 0);
  // Escapes, \u escapes with a surrogate pair, and raw UTF-8: the characters, and back.
  json::Value s = json::parse(R"("q\"b\\s\/n\nt\tu\u00e9\u20ac\ud83d\ude00 \u0001")");
  CHECK(s.text == "q\"b\\s/n\nt\tu\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80 \x01");
  CHECK(s.dump() == "\"q\\\"b\\\\s/n\\nt\\tu\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80 \\u0001\"");
  CHECK(json::parse(s.dump()).text == s.text);
  CHECK(json::parse("\"\xe6\x97\xa5\"").text == "\xe6\x97\xa5");
  // A key given twice: the last value, in the first one's place.
  CHECK(json::parse(R"({"k":1,"j":2,"k":3})").dump() == R"({"k":3,"j":2})");
  // Malformed text: a parse_error naming the byte.
  for (const char* bad : {"",
                          "{",
                          "[1,]",
                          "{\"a\"}",
                          "{\"a\":1,}",
                          "01",
                          "1.",
                          "-",
                          "1e",
                          "tru",
                          "nul",
                          "[1] 2",
                          "\"abc",
                          "\"\\x\"",
                          "\"\\u12g4\"",
                          "\"\\ud800\"",
                          "\"\\udc00\"",
                          "\"\\ud800\\u0041\"",
                          "\"a\x01b\"",
                          "\"\xff\"",
                          "\"\xc0\xaf\"",
                          "\"\xed\xa0\x80\"",
                          "\"\xf4\x90\x80\x80\"",
                          "\"\xe2\x82\"",
                          "{1:2}",
                          "[1 2]"})
    CHECK_THROWS_AS_MESSAGE(json::parse(bad), json::parse_error, bad);
  std::string what;
  try {
    json::parse("[1, 2, }");
  } catch (const json::parse_error& e) {
    what = e.what();
  }
  CHECK(what.find("at byte 7") != std::string::npos);
  // Nesting: 256 levels read, deeper refused (not a stack overflow).
  CHECK(json::parse(std::string(256, '[') + std::string(256, ']')).is_array());
  CHECK_THROWS_AS(json::parse(std::string(100000, '[') + std::string(100000, ']')), json::parse_error);
  // Writing: control characters escaped, strings that are not UTF-8 refused.
  CHECK(json::quote(std::string("a\0b\x1f\x7f", 5)) == "\"a\\u0000b\\u001f\x7f\"");
  CHECK_THROWS_AS(json::quote("\xc3"), json::parse_error);
  CHECK_THROWS_AS(json::quote("\xed\xa0\x80"), json::parse_error);
}

TEST_CASE("save: names and metadata that are not UTF-8 fail and write nothing") {
  std::string path = temp_path("not_utf8.safetensors");
  k::Tensor x = random({3}, k::f32, 12);
  std::string msg = error_of([&] { k::save(path, {{"bad\xff", x}}); });
  CHECK(msg.find(path) != std::string::npos);
  CHECK(msg.find("UTF-8") != std::string::npos);
  msg = error_of([&] { k::save(path, {{"x", x}}, {{"note", "\xc3"}}); });
  CHECK(msg.find("UTF-8") != std::string::npos);
  CHECK_FALSE(fs::exists(path));
  CHECK_FALSE(fs::exists(path + ".tmp"));
  // Names with quotes, control characters and non-ASCII letters round-trip.
  const std::string odd = "a\"b\\c\n\x01 \xe2\x82\xac";
  k::save(path, {{odd, x}}, {{odd, odd}});
  auto loaded = k::load(path);
  REQUIRE(loaded.count(odd) == 1);
  CHECK(bytes_of(loaded.at(odd)) == bytes_of(x));
  CHECK(k::load_metadata(path).at(odd) == odd);
}

TEST_CASE("cuda: save CUDA tensors, load them onto the GPU" * needs_gpu()) {
  std::vector<std::pair<std::string, k::Tensor>> tensors;
  std::uint64_t seed = 100;
  for (k::dtype dt : all_dtypes)
    tensors.push_back({std::string(k::name(dt)), random({37, 129}, dt, seed++).to(k::cuda)});
  k::Tensor on_gpu = random({33, 65}, k::f32, 99).to(k::cuda);
  tensors.push_back({"transposed", k::Tensor(k::transpose(on_gpu, 0, 1))});
  tensors.push_back({"strided", on_gpu.as_strided({33, 32}, {65, 2}, 1)});  // columns 1, 3, ..., 63
  REQUIRE_FALSE(tensors.back().second.is_contiguous());
  std::string path = temp_path("cuda.safetensors");
  k::save(path, tensors);
  auto on_host = k::load(path);
  auto loaded = k::load(path, k::cuda);
  for (const auto& [key, t] : tensors) {
    const std::string& name = key;  // INFO captures it: clang < 16 cannot capture a structured binding
    INFO(name);
    CHECK(loaded.at(name).device() == k::cuda);
    CHECK(on_host.at(name).device() == k::cpu);
    CHECK(loaded.at(name).shape() == t.shape());
    CHECK(bytes_of(loaded.at(name)) == bytes_of(t));
    CHECK(bytes_of(on_host.at(name)) == bytes_of(t));
  }
  // Checked against the same view taken on the host, which reads through strides without a kernel.
  k::Tensor host_view = random({33, 65}, k::f32, 99).as_strided({33, 32}, {65, 2}, 1);
  CHECK(k::to_vector<float>(loaded.at("strided")) == k::to_vector<float>(host_view));
  // A loaded tensor computes on the device like any other.
  k::Tensor y = loaded.at("f32") * 2.0f;
  CHECK(y.device() == k::cuda);
  CHECK(k::to_vector<float>(y)[5] == 2.0f * k::to_vector<float>(tensors[1].second)[5]);
}
