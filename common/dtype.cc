#include "common/dtype.h"

#include <array>
#include <utility>

namespace flatshard {
namespace {

struct DTypeInfo {
  DType dtype;
  absl::string_view name;
  int64_t item_size;
  bool floating;
};

constexpr std::array<DTypeInfo, 9> kDTypes = {{
    {DType::kFloat32, "float32", 4, true},
    {DType::kFloat16, "float16", 2, true},
    {DType::kBFloat16, "bfloat16", 2, true},
    {DType::kFloat64, "float64", 8, true},
    {DType::kInt8, "int8", 1, false},
    {DType::kInt32, "int32", 4, false},
    {DType::kInt64, "int64", 8, false},
    {DType::kUInt8, "uint8", 1, false},
    {DType::kBool, "bool", 1, false},
}};

const DTypeInfo& Info(DType dtype) { return kDTypes[static_cast<size_t>(dtype)]; }

}  // namespace

absl::string_view DTypeName(DType dtype) { return Info(dtype).name; }

std::optional<DType> ParseDType(absl::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

int64_t ItemSize(DType dtype) { return Info(dtype).item_size; }
bool IsFloatingPoint(DType dtype) { return Info(dtype).floating; }

}  // namespace flatshard
