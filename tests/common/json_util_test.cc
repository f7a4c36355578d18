// Tests for common/json_util: strict parsing (malformed input, duplicate keys, depth limit)
// and the typed accessors' error messages, which must name the document and the JSON path.

#include "common/json_util.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

Json MustParse(const std::string& text) {
  absl::StatusOr<Json> v = ParseJson(text, "doc");
  EXPECT_TRUE(v.ok()) << v.status();
  return v.ok() ? *v : Json();
}

std::string Nested(int depth, const std::string& open, const std::string& close,
                   const std::string& inner = "") {
  std::string s;
  for (int i = 0; i < depth; ++i) s += open;
  s += inner;
  for (int i = 0; i < depth; ++i) s += close;
  return s;
}

TEST(ParseJsonTest, AcceptsWellFormedDocument) {
  Json v = MustParse(R"({"a": [1, 2, {"b": "c"}], "d": null, "e": true})");
  EXPECT_EQ(v["a"][2]["b"], "c");
  EXPECT_TRUE(v["d"].is_null());
}

TEST(ParseJsonTest, MalformedJsonIsInvalidArgumentWithoutThrowing) {
  for (const char* text :
       {"", "{", "{\"a\": }", "[1, 2,]", "{\"a\": 1} trailing", "NaN", "{'a': 1}", "// comment\n{}",
        "{\"a\": \"\xff\"}", "\"unterminated", "[1 2]", "{\"a\" 1}"}) {
    SCOPED_TRACE(text);
    absl::StatusOr<Json> v;
    EXPECT_NO_THROW(v = ParseJson(text, "manifest"));
    ASSERT_FALSE(v.ok());
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Msg(v.status()), StartsWith("manifest: malformed JSON: "));
    // nlohmann's "[json.exception.parse_error.101] " prefix is dropped.
    EXPECT_THAT(Msg(v.status()), ::testing::Not(HasSubstr("json.exception")));
  }
}

TEST(ParseJsonTest, DuplicateKeysAreRefused) {
  absl::StatusOr<Json> v = ParseJson(R"({"a": 1, "b": 2, "a": 3})", "policy");
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(v.status()), "policy: duplicate key \"a\" in an object");
}

TEST(ParseJsonTest, DuplicateKeysInNestedObjectAreRefused) {
  absl::StatusOr<Json> v = ParseJson(R"({"x": [{"k": 1, "k": 2}]})", "doc");
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(Msg(v.status()), "doc: duplicate key \"k\" in an object");
  // A duplicate after a nested object closes is still in the outer object.
  v = ParseJson(R"({"a": {"b": 1}, "a": 2})", "doc");
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(Msg(v.status()), "doc: duplicate key \"a\" in an object");
}

TEST(ParseJsonTest, SameKeyInDifferentObjectsIsAccepted) {
  Json v = MustParse(R"({"a": {"x": 1}, "b": {"x": 2, "a": 3}, "c": [{"x": 1}, {"x": 2}]})");
  EXPECT_EQ(v["b"]["x"], 2);
  EXPECT_EQ(v["c"][1]["x"], 2);
}

TEST(ParseJsonTest, NestingAtTheLimitIsAccepted) {
  Json v = MustParse(Nested(kMaxJsonDepth, "[", "]"));
  EXPECT_TRUE(v.is_array());
  v = MustParse(Nested(kMaxJsonDepth / 2, "{\"a\":[", "]}"));
  EXPECT_TRUE(v.is_object());
}

TEST(ParseJsonTest, NestingOneBeyondTheLimitIsRefused) {
  absl::StatusOr<Json> v = ParseJson(Nested(kMaxJsonDepth + 1, "[", "]"), "manifest");
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(v.status()), "manifest: JSON nests deeper than 512 levels");
}

TEST(ParseJsonTest, HundredThousandOpenBracketsAreRefusedWithoutCrashing) {
  const std::string deep(100000, '[');
  absl::StatusOr<Json> v = ParseJson(deep, "manifest");
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(Msg(v.status()), "manifest: JSON nests deeper than 512 levels");
  // Closed, and with objects.
  v = ParseJson(Nested(100000, "{\"a\":", "}", "1"), "manifest");
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(Msg(v.status()), "manifest: JSON nests deeper than 512 levels");
  v = ParseJson(Nested(100000, "[", "]"), "manifest");
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(Msg(v.status()), "manifest: JSON nests deeper than 512 levels");
}

TEST(ParseJsonTest, BracketsInsideStringsDoNotCount) {
  const std::string brackets(100000, '[');
  Json v = MustParse("{\"a\": \"" + brackets + "\", \"b\": [\"" + std::string(1000, '{') + "\"]}");
  EXPECT_EQ(v["a"].get<std::string>().size(), 100000u);
  // An escaped quote does not end the string.
  v = MustParse("[\"\\\"" + brackets + "\"]");
  EXPECT_EQ(v[0].get<std::string>().size(), 100001u);
}

TEST(ParseJsonTest, EscapedBackslashEndsStringSoLaterBracketsCount) {
  // "\\" is a complete string: the brackets after it are structure and must be counted.
  const std::string text = "[\"\\\\\"," + Nested(kMaxJsonDepth, "[", "]") + "]";
  absl::StatusOr<Json> v = ParseJson(text, "doc");
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(Msg(v.status()), "doc: JSON nests deeper than 512 levels");
}

TEST(JsonPathTest, FormatsKeysAndIndices) {
  JsonPath p("manifest");
  EXPECT_EQ(p.str(), "$");
  EXPECT_EQ(p.doc(), "manifest");
  JsonPath q = p.Key("root").Key("children").Index(3).Key("module");
  EXPECT_EQ(q.str(), "$.root.children[3].module");
  absl::Status s = q.Error("bad thing");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(s), "manifest: $.root.children[3].module: bad thing");
  // Key/Index do not modify the original.
  EXPECT_EQ(p.str(), "$");
}

TEST(ExpectObjectTest, UnknownKeyNamesKeyPathAndAllowedKeys) {
  Json v = MustParse(R"({"name": "x", "shpae": [1]})");
  absl::Status s =
      ExpectObject(v, JsonPath("manifest").Key("root").Key("params").Index(2), {"name", "shape"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(s), "manifest: $.root.params[2]: unknown key \"shpae\" (allowed: name, shape)");
}

TEST(ExpectObjectTest, RefusesNonObjects) {
  JsonPath p("doc");
  EXPECT_EQ(Msg(ExpectObject(MustParse("[1]"), p.Key("x"), {"a"})),
            "doc: $.x: must be an object, got an array");
  EXPECT_EQ(Msg(ExpectObject(MustParse("\"s\""), p, {"a"})),
            "doc: $: must be an object, got a string");
  EXPECT_EQ(Msg(ExpectObject(MustParse("null"), p, {"a"})), "doc: $: must be an object, got null");
  EXPECT_TRUE(ExpectObject(MustParse("{}"), p, {}).ok());
  EXPECT_TRUE(ExpectObject(MustParse(R"({"a": 1})"), p, {"a", "b"}).ok());
}

TEST(ExpectArrayTest, RefusesNonArrays) {
  JsonPath p("doc");
  EXPECT_TRUE(ExpectArray(MustParse("[]"), p).ok());
  EXPECT_EQ(Msg(ExpectArray(MustParse("{}"), p.Key("l"))),
            "doc: $.l: must be an array, got an object");
  EXPECT_EQ(Msg(ExpectArray(MustParse("true"), p)), "doc: $: must be an array, got a boolean");
}

class GetIntTest : public ::testing::Test {
 protected:
  absl::StatusOr<int64_t> Get(const std::string& value, int64_t min = INT64_MIN,
                              int64_t max = INT64_MAX) {
    Json obj = MustParse("{\"n\": " + value + "}");
    return GetInt(obj, "n", JsonPath("doc").Key("outer"), min, max);
  }
};

TEST_F(GetIntTest, AcceptsIntegersIncludingInt64Extremes) {
  EXPECT_EQ(*Get("0"), 0);
  EXPECT_EQ(*Get("-17"), -17);
  EXPECT_EQ(*Get("9223372036854775807"), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(*Get("-9223372036854775808"), std::numeric_limits<int64_t>::min());
}

TEST_F(GetIntTest, RefusesFloats) {
  EXPECT_EQ(Msg(Get("1.5").status()),
            "doc: $.outer.n: must be an integer, got 1.5 (too large, or has a fraction or "
            "exponent)");
  EXPECT_EQ(Msg(Get("2.0").status()),
            "doc: $.outer.n: must be an integer, got 2.0 (too large, or has a fraction or "
            "exponent)");
  EXPECT_THAT(Msg(Get("1e3").status()), StartsWith("doc: $.outer.n: must be an integer, got "));
  EXPECT_EQ(Get("1e3").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(GetIntTest, RefusesUnsignedAboveInt64Max) {
  EXPECT_EQ(Msg(Get("9223372036854775808").status()),
            "doc: $.outer.n: integer 9223372036854775808 overflows int64");
  EXPECT_EQ(Msg(Get("18446744073709551615").status()),
            "doc: $.outer.n: integer 18446744073709551615 overflows int64");
  // Beyond uint64 nlohmann reads a double: still refused, never truncated.
  absl::StatusOr<int64_t> v = Get("18446744073709551616");
  ASSERT_FALSE(v.ok());
  EXPECT_THAT(Msg(v.status()), StartsWith("doc: $.outer.n: must be an integer, got "));
  v = Get("-9223372036854775809");
  ASSERT_FALSE(v.ok());
  EXPECT_THAT(Msg(v.status()), StartsWith("doc: $.outer.n: must be an integer, got "));
}

TEST_F(GetIntTest, RefusesValuesOutOfRange) {
  EXPECT_EQ(Msg(Get("-1", 0).status()), "doc: $.outer.n: must be at least 0, got -1");
  EXPECT_EQ(Msg(Get("11", 0, 10).status()), "doc: $.outer.n: must be in [0, 10], got 11");
  EXPECT_EQ(Msg(Get("-1", 0, 10).status()), "doc: $.outer.n: must be in [0, 10], got -1");
  EXPECT_EQ(*Get("10", 0, 10), 10);
  EXPECT_EQ(*Get("0", 0), 0);
}

TEST_F(GetIntTest, RefusesNonNumbers) {
  EXPECT_EQ(Msg(Get("\"5\"").status()), "doc: $.outer.n: must be an integer, got a string");
  EXPECT_EQ(Msg(Get("true").status()), "doc: $.outer.n: must be an integer, got a boolean");
  EXPECT_EQ(Msg(Get("null").status()), "doc: $.outer.n: must be an integer, got null");
  EXPECT_EQ(Msg(Get("[1]").status()), "doc: $.outer.n: must be an integer, got an array");
}

TEST(GetIntMissingTest, MissingRequiredKeyNamesKeyAndParentPath) {
  Json obj = MustParse("{}");
  absl::StatusOr<int64_t> v = GetInt(obj, "id", JsonPath("manifest").Key("root"));
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(Msg(v.status()), "manifest: $.root: missing required key \"id\"");
}

TEST(GetOptionalIntTest, LeavesOutputUnchangedWhenAbsent) {
  Json obj = MustParse(R"({"a": 5})");
  int64_t out = 42;
  EXPECT_TRUE(GetOptionalInt(obj, "b", JsonPath("doc"), 0, 100, &out).ok());
  EXPECT_EQ(out, 42);
  EXPECT_TRUE(GetOptionalInt(obj, "a", JsonPath("doc"), 0, 100, &out).ok());
  EXPECT_EQ(out, 5);
  absl::Status s = GetOptionalInt(obj, "a", JsonPath("doc"), 6, 100, &out);
  EXPECT_EQ(Msg(s), "doc: $.a: must be in [6, 100], got 5");
  EXPECT_EQ(out, 5);
}

TEST(AsIntTest, ConvertsValuesDirectly) {
  JsonPath p = JsonPath("doc").Key("shape").Index(1);
  EXPECT_EQ(*AsInt(Json(7), p, 0, 10), 7);
  EXPECT_EQ(Msg(AsInt(Json(-3), p, 0, INT64_MAX).status()),
            "doc: $.shape[1]: must be at least 0, got -3");
  EXPECT_EQ(Msg(AsInt(Json(uint64_t{1} << 63), p, 0, INT64_MAX).status()),
            "doc: $.shape[1]: integer 9223372036854775808 overflows int64");
}

TEST(GetStringTest, TypesAndMissingKeys) {
  Json obj = MustParse(R"({"s": "hi", "n": 3})");
  JsonPath p("doc");
  EXPECT_EQ(*GetString(obj, "s", p), "hi");
  EXPECT_EQ(Msg(GetString(obj, "n", p).status()), "doc: $.n: must be a string, got an integer");
  EXPECT_EQ(Msg(GetString(obj, "x", p).status()), "doc: $: missing required key \"x\"");
  std::string out = "unchanged";
  EXPECT_TRUE(GetOptionalString(obj, "x", p, &out).ok());
  EXPECT_EQ(out, "unchanged");
  EXPECT_TRUE(GetOptionalString(obj, "s", p, &out).ok());
  EXPECT_EQ(out, "hi");
  EXPECT_EQ(Msg(GetOptionalString(obj, "n", p, &out)),
            "doc: $.n: must be a string, got an integer");
  EXPECT_EQ(Msg(AsString(Json(1.5), p.Index(0)).status()),
            "doc: $[0]: must be a string, got a number with a fraction or exponent");
}

TEST(GetBoolTest, TypesAndMissingKeys) {
  Json obj = MustParse(R"({"t": true, "f": false, "n": 1, "s": "true"})");
  JsonPath p = JsonPath("policy");
  EXPECT_TRUE(*GetBool(obj, "t", p));
  EXPECT_FALSE(*GetBool(obj, "f", p));
  EXPECT_EQ(Msg(GetBool(obj, "n", p).status()),
            "policy: $.n: must be true or false, got an integer");
  EXPECT_EQ(Msg(GetBool(obj, "s", p).status()), "policy: $.s: must be true or false, got a string");
  EXPECT_EQ(Msg(GetBool(obj, "x", p).status()), "policy: $: missing required key \"x\"");
  bool out = true;
  EXPECT_TRUE(GetOptionalBool(obj, "x", p, &out).ok());
  EXPECT_TRUE(out);
  EXPECT_TRUE(GetOptionalBool(obj, "f", p, &out).ok());
  EXPECT_FALSE(out);
  EXPECT_EQ(Msg(GetOptionalBool(obj, "n", p, &out)),
            "policy: $.n: must be true or false, got an integer");
}

TEST(GetOptionalStringListTest, ReadsListsAndNamesBadElements) {
  Json obj = MustParse(R"({"l": ["a", "b"], "e": [], "bad": ["a", 2], "s": "a"})");
  JsonPath p = JsonPath("policy").Key("auto_wrap");
  std::vector<std::string> out = {"default"};
  EXPECT_TRUE(GetOptionalStringList(obj, "missing", p, &out).ok());
  EXPECT_EQ(out, std::vector<std::string>{"default"});
  EXPECT_TRUE(GetOptionalStringList(obj, "e", p, &out).ok());
  EXPECT_TRUE(out.empty());
  EXPECT_TRUE(GetOptionalStringList(obj, "l", p, &out).ok());
  EXPECT_EQ(out, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(Msg(GetOptionalStringList(obj, "bad", p, &out)),
            "policy: $.auto_wrap.bad[1]: must be a string, got an integer");
  EXPECT_EQ(out, (std::vector<std::string>{"a", "b"}));  // unchanged on error
  EXPECT_EQ(Msg(GetOptionalStringList(obj, "s", p, &out)),
            "policy: $.auto_wrap.s: must be an array of strings, got a string");
}

TEST(QuoteTest, QuotesAndEscapesWithoutThrowing) {
  EXPECT_EQ(Quote("abc"), "\"abc\"");
  EXPECT_EQ(Quote("a\"b"), "\"a\\\"b\"");
  EXPECT_EQ(Quote("a\nb"), "\"a\\nb\"");
  EXPECT_EQ(Quote(""), "\"\"");
  // Invalid UTF-8 is replaced, not thrown.
  std::string q;
  EXPECT_NO_THROW(q = Quote("\xff"));
  EXPECT_EQ(q, "\"\xEF\xBF\xBD\"");
}

}  // namespace
}  // namespace flatshard
