#pragma once
// Element types of parameters and buffers, with their JSON spellings (formats.md).
// Public header of the client library (installed as <flatshard/dtype.h>); the daemon and the
// planner use the same type through common/dtype.h. C++17. Thread-safe: pure functions.

#include <cstdint>
#include <optional>

#include "absl/strings/string_view.h"

namespace flatshard {

enum class DType : uint8_t {
  kFloat32,
  kFloat16,
  kBFloat16,
  kFloat64,
  kInt8,
  kInt32,
  kInt64,
  kUInt8,
  kBool,
};

// The spelling used in JSON and messages: "float32", "bfloat16", ...
absl::string_view DTypeName(DType dtype);
// Parses a JSON spelling; nullopt for anything else.
std::optional<DType> ParseDType(absl::string_view name);
// Bytes per element.
int64_t ItemSize(DType dtype);
// float32, float16, bfloat16 and float64: the only dtypes a unit may flatten.
bool IsFloatingPoint(DType dtype);

}  // namespace flatshard
