#pragma once
// The JSON the one-pass readers (manifest_reader.h, plan_reader.h) read themselves: objects,
// arrays, strings without escapes, control characters or non-ASCII bytes, integers that fit
// int64 (no fraction, exponent or leading zero), true and false, nesting up to kMaxJsonDepth.
// Every method returns false for anything else, valid JSON included: the reader then gives up
// and its caller runs the strict DOM reader (json_util.h), whose error messages are the
// contract. Not thread-safe: one scanner per document.

#include <cstdint>
#include <cstring>
#include <limits>

#include "absl/strings/string_view.h"
#include "common/json_util.h"

namespace flatshard {

class JsonScanner {
 public:
  explicit JsonScanner(absl::string_view text) : p_(text.data()), end_(text.data() + text.size()) {}

  // Nothing but whitespace is left.
  bool AtEnd() {
    SkipWs();
    return p_ == end_;
  }

  bool String(absl::string_view* out) {
    if (!Consume('"')) return false;
    const char* start = p_;
    while (p_ < end_) {
      const auto c = static_cast<unsigned char>(*p_);
      if (c == '"') {
        *out = absl::string_view(start, static_cast<size_t>(p_ - start));
        ++p_;
        return true;
      }
      if (c < 0x20 || c == '\\' || c >= 0x80) return false;  // escapes and UTF-8: the DOM's
      ++p_;
    }
    return false;
  }
  // A number that does not end at a delimiter ("1.5", "01") fails where the caller expects one.
  bool Int(int64_t* out) {
    const bool negative = Consume('-');
    if (p_ == end_ || !IsDigit(*p_)) return false;
    uint64_t v = 0;
    if (*p_ == '0') {
      ++p_;
    } else {
      const char* start = p_;
      while (p_ < end_ && IsDigit(*p_)) {
        if (p_ - start == 19) return false;  // 19 digits cannot overflow uint64
        v = v * 10 + static_cast<uint64_t>(*p_ - '0');
        ++p_;
      }
    }
    const auto max = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    if (v > max + (negative ? 1 : 0)) return false;
    *out = negative ? static_cast<int64_t>(0 - v) : static_cast<int64_t>(v);
    return true;
  }
  // An integer in [min, max].
  bool Int(int64_t min, int64_t max, int64_t* out) {
    return Int(out) && *out >= min && *out <= max;
  }
  bool Bool(bool* out) {
    if (Literal("true")) {
      *out = true;
      return true;
    }
    if (Literal("false")) {
      *out = false;
      return true;
    }
    return false;
  }
  // An object: member(key) is called with the cursor on each value and must read it.
  template <typename F>
  bool Object(F&& member) {
    SkipWs();
    if (!Open('{')) return false;
    SkipWs();
    if (!Consume('}')) {
      do {
        SkipWs();
        absl::string_view key;
        if (!String(&key)) return false;
        SkipWs();
        if (!Consume(':')) return false;
        SkipWs();
        if (!member(key)) return false;
        SkipWs();
      } while (Consume(','));
      if (!Consume('}')) return false;
    }
    --depth_;
    return true;
  }
  // An array: element() is called with the cursor on each element and must read it.
  template <typename F>
  bool Array(F&& element) {
    SkipWs();
    if (!Open('[')) return false;
    SkipWs();
    if (!Consume(']')) {
      do {
        SkipWs();
        if (!element()) return false;
        SkipWs();
      } while (Consume(','));
      if (!Consume(']')) return false;
    }
    --depth_;
    return true;
  }
  // Marks member `bit` of an object as present; false when it was already (a duplicate key).
  static bool Once(uint32_t* seen, int bit) {
    if (*seen & (1u << bit)) return false;
    *seen |= 1u << bit;
    return true;
  }

 private:
  static bool IsDigit(char c) { return c >= '0' && c <= '9'; }
  void SkipWs() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t')) ++p_;
  }
  bool Consume(char c) {
    if (p_ == end_ || *p_ != c) return false;
    ++p_;
    return true;
  }
  bool Literal(absl::string_view word) {
    if (static_cast<size_t>(end_ - p_) < word.size() ||
        std::memcmp(p_, word.data(), word.size()) != 0) {
      return false;
    }
    p_ += word.size();
    return true;
  }
  bool Open(char c) {
    if (!Consume(c)) return false;
    return ++depth_ <= kMaxJsonDepth;  // ParseJson's limit on bracket nesting
  }

  const char* p_;
  const char* const end_;
  int depth_ = 0;
};

}  // namespace flatshard
