// A small JSON reader for slotpool's snapshot (sp_snapshot_json). Integers are kept exactly as
// 64-bit values (device addresses and stream handles do not fit a double).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace slotpool_torch::json {

struct Value {
  enum class Type { Null, Bool, Number, String, Array, Object };
  Type type = Type::Null;
  bool b = false;
  bool is_integer = false;
  bool negative = false;
  uint64_t u = 0;  // magnitude of an integer
  double d = 0.0;
  std::string s;
  std::vector<Value> arr;
  std::vector<std::pair<std::string, Value>> obj;

  const Value* get(const char* key) const {
    if (type != Type::Object) {
      return nullptr;
    }
    for (const auto& kv : obj) {
      if (kv.first == key) {
        return &kv.second;
      }
    }
    return nullptr;
  }
  uint64_t as_u64() const {
    if (type == Type::Bool) {
      return b ? 1 : 0;
    }
    if (type != Type::Number) {
      return 0;
    }
    if (is_integer) {
      return negative ? static_cast<uint64_t>(-static_cast<int64_t>(u)) : u;
    }
    return d < 0 ? 0 : static_cast<uint64_t>(d);
  }
  int64_t as_i64() const {
    if (type == Type::Bool) {
      return b ? 1 : 0;
    }
    if (type != Type::Number) {
      return 0;
    }
    if (is_integer) {
      return negative ? -static_cast<int64_t>(u) : static_cast<int64_t>(u);
    }
    return static_cast<int64_t>(d);
  }
  bool as_bool() const {
    return type == Type::Bool ? b : as_u64() != 0;
  }
  const std::string& as_str() const {
    return s;
  }
  // Member `key` as u64 (0 if absent).
  uint64_t u64(const char* key) const {
    const Value* v = get(key);
    return v ? v->as_u64() : 0;
  }
  int64_t i64(const char* key) const {
    const Value* v = get(key);
    return v ? v->as_i64() : 0;
  }
  bool boolean(const char* key) const {
    const Value* v = get(key);
    return v ? v->as_bool() : false;
  }
  std::string str(const char* key) const {
    const Value* v = get(key);
    return v && v->type == Type::String ? v->s : std::string();
  }
};

class Parser {
 public:
  Parser(const char* text, size_t len) : p_(text), end_(text + len) {}

  Value parse() {
    Value v = value();
    ws();
    if (p_ != end_) {
      fail("trailing characters");
    }
    return v;
  }

 private:
  [[noreturn]] void fail(const char* why) {
    throw std::runtime_error(std::string("slotpool snapshot JSON: ") + why);
  }
  void ws() {
    while (p_ != end_ && (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t')) {
      ++p_;
    }
  }
  bool eat(char c) {
    ws();
    if (p_ != end_ && *p_ == c) {
      ++p_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) {
      fail("unexpected character");
    }
  }
  bool literal(const char* word) {
    const char* q = p_;
    for (const char* w = word; *w; ++w, ++q) {
      if (q == end_ || *q != *w) {
        return false;
      }
    }
    p_ = q;
    return true;
  }

  Value value() {
    ws();
    if (p_ == end_) {
      fail("unexpected end");
    }
    Value v;
    switch (*p_) {
      case '{': {
        ++p_;
        v.type = Value::Type::Object;
        if (eat('}')) {
          return v;
        }
        do {
          ws();
          std::string k = string();
          expect(':');
          v.obj.emplace_back(std::move(k), value());
        } while (eat(','));
        expect('}');
        return v;
      }
      case '[': {
        ++p_;
        v.type = Value::Type::Array;
        if (eat(']')) {
          return v;
        }
        do {
          v.arr.push_back(value());
        } while (eat(','));
        expect(']');
        return v;
      }
      case '"':
        v.type = Value::Type::String;
        v.s = string();
        return v;
      case 't':
        if (!literal("true")) {
          fail("bad literal");
        }
        v.type = Value::Type::Bool;
        v.b = true;
        return v;
      case 'f':
        if (!literal("false")) {
          fail("bad literal");
        }
        v.type = Value::Type::Bool;
        return v;
      case 'n':
        if (!literal("null")) {
          fail("bad literal");
        }
        return v;
      default:
        return number();
    }
  }

  std::string string() {
    if (p_ == end_ || *p_ != '"') {
      fail("expected a string");
    }
    ++p_;
    std::string out;
    while (p_ != end_ && *p_ != '"') {
      char c = *p_++;
      if (c == '\\') {
        if (p_ == end_) {
          fail("bad escape");
        }
        char e = *p_++;
        switch (e) {
          case 'n': out += '\n'; break;
          case 't': out += '\t'; break;
          case 'r': out += '\r'; break;
          case 'b': out += '\b'; break;
          case 'f': out += '\f'; break;
          case 'u': {
            // Keep \uXXXX as '?' for non-ASCII: the snapshot's strings are ASCII names.
            if (end_ - p_ < 4) {
              fail("bad \\u escape");
            }
            unsigned code = std::strtoul(std::string(p_, 4).c_str(), nullptr, 16);
            p_ += 4;
            out += code < 0x80 ? static_cast<char>(code) : '?';
            break;
          }
          default: out += e; break;
        }
      } else {
        out += c;
      }
    }
    if (p_ == end_) {
      fail("unterminated string");
    }
    ++p_;
    return out;
  }

  Value number() {
    Value v;
    v.type = Value::Type::Number;
    const char* start = p_;
    if (p_ != end_ && *p_ == '-') {
      v.negative = true;
      ++p_;
    }
    bool integer = true;
    uint64_t mag = 0;
    bool overflow = false;
    const char* digits = p_;
    while (p_ != end_ && *p_ >= '0' && *p_ <= '9') {
      uint64_t next = mag * 10 + static_cast<uint64_t>(*p_ - '0');
      if (next / 10 != mag) {
        overflow = true;
      }
      mag = next;
      ++p_;
    }
    if (p_ == digits) {
      fail("expected a value");
    }
    if (p_ != end_ && (*p_ == '.' || *p_ == 'e' || *p_ == 'E')) {
      integer = false;
      ++p_;
      while (p_ != end_ && ((*p_ >= '0' && *p_ <= '9') || *p_ == '+' || *p_ == '-' || *p_ == 'e' ||
                            *p_ == 'E' || *p_ == '.')) {
        ++p_;
      }
    }
    v.is_integer = integer && !overflow;
    v.u = mag;
    v.d = std::strtod(std::string(start, p_).c_str(), nullptr);
    return v;
  }

  const char* p_;
  const char* end_;
};

inline Value parse(const char* text, size_t len) {
  return Parser(text, len).parse();
}

}  // namespace slotpool_torch::json
