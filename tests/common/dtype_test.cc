// Tests for common/dtype: JSON spellings, item sizes and which dtypes are floating point.

#include "common/dtype.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace flatshard {
namespace {

struct DTypeCase {
  DType dtype;
  const char* name;
  int64_t item_size;
  bool floating;
};

const std::vector<DTypeCase>& AllDTypes() {
  static const auto* cases = new std::vector<DTypeCase>{
      {DType::kFloat32, "float32", 4, true},   {DType::kFloat16, "float16", 2, true},
      {DType::kBFloat16, "bfloat16", 2, true}, {DType::kFloat64, "float64", 8, true},
      {DType::kInt8, "int8", 1, false},        {DType::kInt32, "int32", 4, false},
      {DType::kInt64, "int64", 8, false},      {DType::kUInt8, "uint8", 1, false},
      {DType::kBool, "bool", 1, false},
  };
  return *cases;
}

TEST(DTypeTest, EveryDTypeHasItsFormatsSpelling) {
  for (const DTypeCase& c : AllDTypes()) {
    EXPECT_EQ(std::string(DTypeName(c.dtype)), c.name);
  }
}

TEST(DTypeTest, NamesRoundTrip) {
  for (const DTypeCase& c : AllDTypes()) {
    SCOPED_TRACE(c.name);
    std::optional<DType> parsed = ParseDType(c.name);
    ASSERT_TRUE(parsed.has_value());
    EXPECT_EQ(*parsed, c.dtype);
    EXPECT_EQ(ParseDType(DTypeName(c.dtype)), c.dtype);
  }
}

TEST(DTypeTest, ItemSizes) {
  for (const DTypeCase& c : AllDTypes()) {
    EXPECT_EQ(ItemSize(c.dtype), c.item_size) << c.name;
  }
}

TEST(DTypeTest, OnlyTheFourFloatTypesAreFloatingPoint) {
  for (const DTypeCase& c : AllDTypes()) {
    EXPECT_EQ(IsFloatingPoint(c.dtype), c.floating) << c.name;
  }
}

TEST(DTypeTest, UnknownOrMisspelledNamesAreRefused) {
  for (const char* name :
       {"", "float", "Float32", "FLOAT32", "float32 ", " float32", "fp16", "half", "bf16", "double",
        "int", "long", "uint16", "float8", "torch.float32", "complex64"}) {
    EXPECT_FALSE(ParseDType(name).has_value()) << "'" << name << "'";
  }
  // An embedded NUL is not a prefix match.
  EXPECT_FALSE(ParseDType(absl::string_view("float32\0x", 9)).has_value());
}

}  // namespace
}  // namespace flatshard
