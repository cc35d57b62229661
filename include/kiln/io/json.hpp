// JSON values, read and written: what a safetensors header needs (RFC 8259 text: objects, arrays,
// strings, numbers, true, false, null). Written here rather than taken from nlohmann's library,
// whose 25,000 lines every translation unit that includes <kiln/kiln.hpp> parsed in header-only
// mode (about 1 s and 85 MB of g++'s memory a TU: issue 18, benchmarks/RESULTS.md).
//
// Strings are UTF-8, checked on both sides: reading rejects malformed sequences, overlong forms,
// surrogates and lone \u surrogates; writing rejects any string that is not UTF-8. A number keeps
// the text it was written as (sizes are read from it exactly, never through a double). An object's
// keys are unique, the last one given winning, as nlohmann's reader did.
#pragma once
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kiln::detail::json {

// Malformed JSON text, or a string that is not UTF-8 where one is written.
struct parse_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The length of the well-formed UTF-8 sequence that starts s[i], or 0.
inline std::size_t utf8_length(std::string_view s, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b = byte(i);
  if (b < 0x80) return 1;
  std::size_t n = b >= 0xC2 && b <= 0xDF ? 2 : b >= 0xE0 && b <= 0xEF ? 3 : b >= 0xF0 && b <= 0xF4 ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k)
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
  const unsigned char c = byte(i + 1);
  if ((b == 0xE0 && c < 0xA0) || (b == 0xED && c > 0x9F) || (b == 0xF0 && c < 0x90) || (b == 0xF4 && c > 0x8F))
    return 0;  // overlong, a surrogate, or past U+10FFFF
  return n;
}

// s as a JSON string literal, quoted and escaped.
inline std::string quote(std::string_view s) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string out = "\"";
  for (std::size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    if (b >= 0x80) {
      const std::size_t n = utf8_length(s, i);
      if (n == 0)
        throw parse_error("invalid UTF-8 byte 0x" + std::string{hex[b >> 4], hex[b & 15]} + " at index " +
                          std::to_string(i) + " of a string");
      out.append(s.substr(i, n));
      i += n;
      continue;
    }
    switch (b) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (b < 0x20)
          out += std::string("\\u00") + hex[b >> 4] + hex[b & 15];
        else
          out += static_cast<char>(b);
    }
    ++i;
  }
  return out + "\"";
}

struct Member;

struct Value {
  enum class Kind { null, boolean, number, string, array, object };
  Kind kind = Kind::null;
  bool flag = false;            // a boolean's
  std::string text;             // a string's characters, or a number as written
  std::vector<Value> items;     // an array's
  std::vector<Member> members;  // an object's, in the order first given

  bool is_object() const { return kind == Kind::object; }
  bool is_array() const { return kind == Kind::array; }
  bool is_string() const { return kind == Kind::string; }
  // The member named `key` of an object, or null.
  const Value* find(std::string_view key) const;
  // A number that is an integer in [0, 2^63) (a size or an offset), or -1.
  std::int64_t size_value() const {
    if (kind != Kind::number || text.empty() || text.find_first_of(".eE") != std::string::npos) return -1;
    if (text == "-0") return 0;
    if (text[0] == '-') return -1;
    std::uint64_t n = 0;
    constexpr auto most = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    for (char c : text) {
      const auto d = static_cast<std::uint64_t>(c - '0');
      if (n > (most - d) / 10) return -1;
      n = n * 10 + d;
    }
    return static_cast<std::int64_t>(n);
  }
  // Compact JSON text (what error messages quote).
  std::string dump() const;
};

struct Member {
  std::string key;
  Value value;
};

inline const Value* Value::find(std::string_view key) const {
  for (const auto& m : members)
    if (m.key == key) return &m.value;
  return nullptr;
}

inline std::string Value::dump() const {
  switch (kind) {
    case Kind::null: return "null";
    case Kind::boolean: return flag ? "true" : "false";
    case Kind::number: return text;
    case Kind::string: return quote(text);
    case Kind::array: {
      std::string out = "[";
      for (std::size_t i = 0; i < items.size(); ++i) {
        if (i) out += ',';
        out += items[i].dump();
      }
      return out + "]";
    }
    case Kind::object: {
      std::string out = "{";
      for (std::size_t i = 0; i < members.size(); ++i) {
        if (i) out += ',';
        out += quote(members[i].key);
        out += ':';
        out += members[i].value.dump();
      }
      return out + "}";
    }
  }
  return "null";
}

// A recursive-descent reader over one text; its errors name the byte where the text went wrong.
class Reader {
 public:
  explicit Reader(std::string_view text) : s_(text) {}

  Value document() {
    Value v = value(0);
    skip_space();
    if (at_ < s_.size()) fail("text after the JSON value");
    return v;
  }

 private:
  static constexpr int max_depth = 256;  // deeper nesting is refused, not a stack overflow

  [[noreturn]] void fail(const std::string& what) const {
    throw parse_error(what + " at byte " + std::to_string(at_));
  }
  void skip_space() {
    while (at_ < s_.size() && (s_[at_] == ' ' || s_[at_] == '\t' || s_[at_] == '\n' || s_[at_] == '\r')) ++at_;
  }
  bool eat(char c) {
    skip_space();
    if (at_ < s_.size() && s_[at_] == c) {
      ++at_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  bool digit() const { return at_ < s_.size() && s_[at_] >= '0' && s_[at_] <= '9'; }

  Value value(int depth) {
    if (depth > max_depth) fail("JSON nested more than " + std::to_string(max_depth) + " deep");
    skip_space();
    if (at_ >= s_.size()) fail("unexpected end of the text");
    Value v;
    const char c = s_[at_];
    if (c == '{') {
      ++at_;
      v.kind = Value::Kind::object;
      if (eat('}')) return v;
      do {
        skip_space();
        if (at_ >= s_.size() || s_[at_] != '"') fail("expected a string key");
        std::string key = string();
        expect(':');
        Value member = value(depth + 1);
        bool replaced = false;
        for (auto& m : v.members)
          if (m.key == key) m.value = std::move(member), replaced = true;
        if (!replaced) v.members.push_back(Member{std::move(key), std::move(member)});
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      ++at_;
      v.kind = Value::Kind::array;
      if (eat(']')) return v;
      do v.items.push_back(value(depth + 1));
      while (eat(','));
      expect(']');
    } else if (c == '"') {
      v.kind = Value::Kind::string;
      v.text = string();
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = Value::Kind::number;
      v.text = number();
    } else if (s_.substr(at_, 4) == "true" || s_.substr(at_, 5) == "false") {
      v.kind = Value::Kind::boolean;
      v.flag = c == 't';
      at_ += v.flag ? 4 : 5;
    } else if (s_.substr(at_, 4) == "null") {
      at_ += 4;
    } else {
      fail("unexpected character");
    }
    return v;
  }

  std::string number() {
    const std::size_t start = at_;
    if (s_[at_] == '-') ++at_;
    if (!digit()) fail("a number without digits");
    if (s_[at_] == '0')
      ++at_;
    else
      while (digit()) ++at_;
    if (at_ < s_.size() && s_[at_] == '.') {
      ++at_;
      if (!digit()) fail("a number without digits after its point");
      while (digit()) ++at_;
    }
    if (at_ < s_.size() && (s_[at_] == 'e' || s_[at_] == 'E')) {
      ++at_;
      if (at_ < s_.size() && (s_[at_] == '+' || s_[at_] == '-')) ++at_;
      if (!digit()) fail("a number without digits in its exponent");
      while (digit()) ++at_;
    }
    return std::string(s_.substr(start, at_ - start));
  }

  // Four hex digits of a \u escape.
  unsigned hex4() {
    if (at_ + 4 > s_.size()) fail("a \\u escape cut short");
    unsigned v = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = s_[at_++];
      v = v * 16 + (h >= '0' && h <= '9'   ? static_cast<unsigned>(h - '0')
                    : h >= 'a' && h <= 'f' ? static_cast<unsigned>(h - 'a' + 10)
                    : h >= 'A' && h <= 'F' ? static_cast<unsigned>(h - 'A' + 10)
                                           : (fail("a \\u escape with a character that is not hex"), 0u));
    }
    return v;
  }
  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | cp >> 6);
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | cp >> 12);
      out += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | cp >> 18);
      out += static_cast<char>(0x80 | (cp >> 12 & 0x3F));
      out += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string string() {
    ++at_;  // the opening quote
    std::string out;
    while (true) {
      if (at_ >= s_.size()) fail("a string without its closing quote");
      const auto b = static_cast<unsigned char>(s_[at_]);
      if (b == '"') {
        ++at_;
        return out;
      }
      if (b < 0x20) fail("a control character in a string");
      if (b >= 0x80) {
        const std::size_t n = utf8_length(s_, at_);
        if (n == 0) fail("invalid UTF-8 in a string");
        out.append(s_.substr(at_, n));
        at_ += n;
        continue;
      }
      ++at_;
      if (b != '\\') {
        out += static_cast<char>(b);
        continue;
      }
      if (at_ >= s_.size()) fail("a string without its closing quote");
      const char e = s_[at_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) fail("a \\u escape of a lone low surrogate");
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // a high surrogate: its low one must follow
            if (s_.substr(at_, 2) != "\\u") fail("a \\u escape of a high surrogate without its low one");
            at_ += 2;
            const unsigned low = hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail("a \\u escape of a high surrogate without its low one");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("an unknown escape in a string");
      }
    }
  }

  std::string_view s_;
  std::size_t at_ = 0;
};

// The value a whole JSON text holds; parse_error where it is not one.
inline Value parse(std::string_view text) { return Reader(text).document(); }

}  // namespace kiln::detail::json
