// Tests for common/manifest_reader: the one-pass manifest reader accepts exactly what the strict
// DOM reader (ParseJson + ManifestFromJsonValue) accepts, with an equal Manifest, and leaves
// every error to it, so ManifestFromJson's messages are the DOM reader's, byte for byte.
// The mutation corpus is generated from a fixed seed: the same cases on every run.

#include "common/manifest_reader.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/json_util.h"
#include "common/manifest.h"
#include "common/manifest_json_writer.h"
#include "gtest/gtest.h"

namespace flatshard {
namespace {

// The old ManifestFromJson: the reference for results and messages.
absl::StatusOr<Manifest> ReadWithDom(const std::string& text) {
  absl::StatusOr<Json> doc = ParseJson(text, "manifest");
  if (!doc.ok()) return doc.status();
  return ManifestFromJsonValue(*doc);
}

// A small model with every feature: bases, buffers, a tied parameter, a shared module (ref),
// negative and zero ids, a scalar and an empty shape, requires_grad false, nesting.
constexpr char kModel[] = R"({"format": "flatshard.manifest/1", "root": {
  "id": 0, "type": "Net", "bases": ["Base", "Module"],
  "params": [{"name": "w", "id": 7, "shape": [4, 3], "dtype": "float32", "requires_grad": true}],
  "buffers": [{"name": "b", "id": 8, "shape": [], "dtype": "int64", "requires_grad": false}],
  "children": [
    {"name": "enc", "module": {"id": -5, "type": "Enc", "bases": [], "params": [
        {"name": "tied", "id": 7, "shape": [4, 3], "dtype": "float32"},
        {"name": "z", "id": 9, "shape": [0, 2], "dtype": "bfloat16", "requires_grad": false}],
      "children": [{"name": "shared", "module": {"id": 12, "type": "Rot", "params": [],
                    "buffers": [{"name": "f", "id": 3, "shape": [2], "dtype": "float16"}]}}]}},
    {"name": "again", "module": {"ref": 12}},
    {"name": "dec", "module": {"type": "Dec", "id": 2, "children": [
        {"module": {"ref": -5}, "name": "enc2"}]}}
  ]}})";

// The same model as nlohmann writes it: keys sorted ("children" before "id"), no spaces.
std::string SortedKeys(const std::string& text) { return Json::parse(text).dump(); }
std::string Pretty(const std::string& text) { return Json::parse(text).dump(2); }

void ExpectSameAsDom(const std::string& text) {
  absl::StatusOr<Manifest> dom = ReadWithDom(text);
  std::optional<Manifest> fast = ReadValidManifest(text);
  if (fast.has_value()) {
    ASSERT_TRUE(dom.ok()) << "the fast reader accepted what the DOM reader refuses ("
                          << dom.status() << "): " << text;
    EXPECT_TRUE(*fast == *dom) << text;
  }
  absl::StatusOr<Manifest> got = ManifestFromJson(text);
  ASSERT_EQ(got.status(), dom.status()) << text;
  if (got.ok()) {
    EXPECT_TRUE(*got == *dom) << text;
  }
}

TEST(ManifestReaderTest, ReadsEverySpellingOfAValidManifestAsTheDomReaderDoes) {
  for (const std::string& text : {std::string(kModel), SortedKeys(kModel), Pretty(kModel)}) {
    std::optional<Manifest> fast = ReadValidManifest(text);
    ASSERT_TRUE(fast.has_value()) << text;
    absl::StatusOr<Manifest> dom = ReadWithDom(text);
    ASSERT_TRUE(dom.ok()) << dom.status();
    EXPECT_TRUE(*fast == *dom);
    ASSERT_EQ(fast->modules.size(), 4u);  // the shared instance once
    EXPECT_EQ(fast->modules[2].id, 12);
    EXPECT_EQ(fast->modules[1].children[0].module, 2);
    EXPECT_EQ(fast->modules[0].children[1].module, 2);
    EXPECT_EQ(fast->modules[3].children[0].module, 1);
    EXPECT_FALSE(fast->modules[0].buffers[0].requires_grad);
    EXPECT_EQ(fast->modules[0].buffers[0].numel, 1);
  }
}

TEST(ManifestReaderTest, LeavesEscapesAndNonAsciiToTheDomReader) {
  // Valid, but spelled with an escape or UTF-8: the DOM reader reads them (same result).
  for (const char* text : {
           R"({"format": "flatshard.manifest/1", "root": {"id": 0, "type": "N\u0065t"}})",
           "{\"format\": \"flatshard.manifest/1\", \"root\": {\"id\": 0, \"type\": "
           "\"N\xc3\xa9t\"}}",
           "\xef\xbb\xbf{\"format\": \"flatshard.manifest/1\", \"root\": {\"id\": 0, \"type\": "
           "\"Net\"}}",
       }) {
    EXPECT_FALSE(ReadValidManifest(text).has_value()) << text;
    ExpectSameAsDom(text);
  }
  absl::StatusOr<Manifest> m = ManifestFromJson(
      R"({"format": "flatshard.manifest/1", "root": {"id": 0, "type": "N\u0065t"}})");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->modules[0].type, "Net");
}

// Each rule the DOM reader names, broken once: the fast reader gives up and the message is the
// DOM reader's (unknown, duplicate, missing and mistyped fields; ids, refs, names, tied tensors,
// numbers the DOM reader reads as floats or unsigned; JSON syntax; trailing bytes).
TEST(ManifestReaderTest, EveryRefusalIsTheDomReadersMessage) {
  const std::string head = R"({"format": "flatshard.manifest/1", "root": )";
  const std::vector<std::string> roots = {
      R"({"id": 0, "type": "N", "extra": 1})",
      R"({"id": 0, "type": "N", "id": 1})",
      R"({"type": "N"})",
      R"({"id": 0})",
      R"({})",
      R"({"ref": 0})",
      R"({"id": 0, "type": ""})",
      R"({"id": "0", "type": "N"})",
      R"({"id": 0.0, "type": "N"})",
      R"({"id": 1e3, "type": "N"})",
      R"({"id": 9223372036854775808, "type": "N"})",
      R"({"id": -9223372036854775809, "type": "N"})",
      R"({"id": 18446744073709551616, "type": "N"})",
      R"({"id": 01, "type": "N"})",
      R"({"id": -, "type": "N"})",
      R"({"id": 0, "type": "N", "bases": "Module"})",
      R"({"id": 0, "type": "N", "bases": [1]})",
      R"({"id": 0, "type": "N", "params": {}})",
      R"({"id": 0, "type": "N", "params": [{"name": "w", "id": 1, "shape": [-1], "dtype": "float32"}]})",
      R"({"id": 0, "type": "N", "params": [{"name": "w", "id": 1, "shape": [1.5], "dtype": "float32"}]})",
      R"({"id": 0, "type": "N", "params": [{"name": "w", "id": 1, "shape": [4294967296, 4294967296], "dtype": "float32"}]})",
      R"({"id": 0, "type": "N", "params": [{"name": "w", "id": 1, "shape": [1], "dtype": "float33"}]})",
      R"({"id": 0, "type": "N", "params": [{"name": "w", "id": 1, "shape": [1]}]})",
      R"({"id": 0, "type": "N", "params": [{"name": "w", "id": 1, "shape": [1], "dtype": "float32", "requires_grad": 1}]})",
      R"({"id": 0, "type": "N", "params": [{"name": "w.x", "id": 1, "shape": [1], "dtype": "float32"}]})",
      R"({"id": 0, "type": "N", "params": [{"name": "", "id": 1, "shape": [1], "dtype": "float32"}]})",
      R"({"id": 0, "type": "N", "params": [{"name": "w", "id": 1, "shape": [1], "dtype": "float32"}], "buffers": [{"name": "w", "id": 2, "shape": [1], "dtype": "float32"}]})",
      R"({"id": 0, "type": "N", "params": [{"name": "w", "id": 1, "shape": [1], "dtype": "float32"}, {"name": "v", "id": 1, "shape": [2], "dtype": "float32"}]})",
      R"({"id": 0, "type": "N", "params": [{"name": "w", "id": 1, "shape": [1], "dtype": "float32"}, {"name": "v", "id": 1, "shape": [1], "dtype": "float16"}]})",
      R"({"id": 0, "type": "N", "params": [{"name": "w", "id": 1, "shape": [1], "dtype": "float32"}, {"name": "v", "id": 1, "shape": [1], "dtype": "float32", "requires_grad": false}]})",
      R"({"id": 0, "type": "N", "children": [{"name": "a", "module": {"ref": 0}}]})",
      R"({"children": [{"name": "a", "module": {"ref": 0}}], "id": 0, "type": "N"})",
      R"({"id": 0, "type": "N", "children": [{"name": "a", "module": {"ref": 1}}, {"name": "b", "module": {"id": 1, "type": "M"}}]})",
      R"({"id": 0, "type": "N", "children": [{"name": "a", "module": {"id": 1, "type": "M"}}, {"name": "b", "module": {"ref": 1, "id": 2}}]})",
      R"({"id": 0, "type": "N", "children": [{"name": "a", "module": {"id": 1, "type": "M"}}, {"name": "b", "module": {"id": 2, "ref": 1}}]})",
      R"({"id": 0, "type": "N", "children": [{"name": "a", "module": {"id": 1, "type": "M"}}, {"name": "a", "module": {"ref": 1}}]})",
      R"({"id": 0, "type": "N", "children": [{"name": "a", "module": {"id": 0, "type": "M"}}]})",
      R"({"children": [{"name": "a", "module": {"id": 0, "type": "M"}}], "id": 0, "type": "N"})",
      R"({"id": 0, "type": "N", "children": [{"name": "a"}]})",
      R"({"id": 0, "type": "N", "children": [{"module": {"id": 1, "type": "M"}}]})",
      R"({"id": 0, "type": "N", "children": [{"name": "a", "module": 1}]})",
      R"({"id": 0, "type": "N", "children": [{"name": "a", "module": {"ref": "1"}}]})",
      R"({"id": 0, "type": "N", "children": {}})",
      R"({"id": 0, "type": "N",})",
      R"({"id": 0 "type": "N"})",
      R"({"id": 0, "type": "N"}, "format": "flatshard.manifest/1")",
      R"({"id": 0, "type": "N"})"
      "\n}x",
      R"({"id": 0, "type": "N"}})"
      "\x01",
      "{\"id\": 0, \"type\": \"N\t\"}}",
      R"({"id": 0, "type": "N"})",  // missing the document's '}'
  };
  for (const std::string& root : roots) {
    const std::string text = head + root + (root == roots.back() ? "" : "}");
    EXPECT_FALSE(ReadValidManifest(text).has_value()) << text;
    ExpectSameAsDom(text);
  }
  for (
      const char* text :
      {"", "[]", "{}", R"({"format": "flatshard.manifest/2", "root": {"id": 0, "type": "N"}})",
       R"({"root": {"id": 0, "type": "N"}})",
       R"({"format": "flatshard.manifest/1", "format": "flatshard.manifest/1", "root": {"id": 0, "type": "N"}})"}) {
    EXPECT_FALSE(ReadValidManifest(text).has_value()) << text;
    ExpectSameAsDom(text);
  }
}

TEST(ManifestReaderTest, DepthLimitsAreTheDomReaders) {
  // A chain of modules 160 deep is accepted; 161 is refused, as are refs that expand deeper.
  auto chain = [](int levels) {
    std::string text = R"({"format": "flatshard.manifest/1", "root": )";
    for (int i = 0; i < levels; ++i) {
      absl::StrAppend(&text, R"({"id": )", i, R"(, "type": "M")",
                      i + 1 < levels ? R"(, "children": [{"name": "c", "module": )" : "");
    }
    text += "}";  // the innermost module
    for (int i = 1; i < levels; ++i) text += "}]}";
    return text + "}";
  };
  ASSERT_TRUE(ReadWithDom(chain(kMaxModuleDepth)).ok());
  ASSERT_TRUE(ReadValidManifest(chain(kMaxModuleDepth)).has_value());
  ExpectSameAsDom(chain(kMaxModuleDepth));
  EXPECT_FALSE(ReadValidManifest(chain(kMaxModuleDepth + 1)).has_value());
  ExpectSameAsDom(chain(kMaxModuleDepth + 1));
  ExpectSameAsDom(chain(200));  // deeper than the JSON nesting limit
}

// Byte-level mutations of valid documents (deleted, replaced and inserted bytes, digits
// changed to make ids collide or refs dangle, spans repeated to duplicate keys): whatever the
// fast reader accepts the DOM reader accepts equally, and ManifestFromJson answers as the DOM
// reader, message included.
TEST(ManifestReaderTest, MutatedDocumentsGetTheDomReadersAnswer) {
  std::mt19937 rng(27);  // fixed: the same corpus on every run
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  const std::string snippets[] = {"{",           "}",
                                  "[",           "]",
                                  "\"",          ":",
                                  ",",           "0",
                                  "-",           ".",
                                  "e",           "\\",
                                  " ",           "\"ref\": 1, ",
                                  "\"id\": 2, ", "true",
                                  "null",        "1.0",
                                  "\"x\"",       "\"type\": \"T\", "};
  int accepted = 0, total = 0;
  for (const std::string& base : {std::string(kModel), SortedKeys(kModel)}) {
    for (int round = 0; round < 1500; ++round) {
      std::string text = base;
      const int edits = 1 + static_cast<int>(pick(2));
      for (int e = 0; e < edits; ++e) {
        const size_t at = pick(text.size());
        switch (pick(5)) {
          case 0:
            text.erase(at, 1 + pick(3));
            break;
          case 1:
            text.insert(at, snippets[pick(std::size(snippets))]);
            break;
          case 2: {  // a digit: collide ids, dangle refs, change shapes
            const size_t digit = text.find_first_of("0123456789", at);
            if (digit != std::string::npos) text[digit] = static_cast<char>('0' + pick(10));
            break;
          }
          case 3: {  // repeat a span: duplicate keys and members
            const size_t len = 1 + pick(40);
            text.insert(at, text.substr(at, len));
            break;
          }
          default:
            text[at] = snippets[pick(std::size(snippets))][0];
        }
      }
      ++total;
      if (ReadValidManifest(text).has_value()) ++accepted;
      ExpectSameAsDom(text);
      if (HasFatalFailure()) return;
    }
  }
  RecordProperty("accepted", accepted);
  RecordProperty("mutants", total);
  // Some mutants stay valid (a changed digit of a shape, a space): the fast path saw them.
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, total);
}

// ValidateManifest's fast path writes the document ManifestToJson holds as text and reads it
// back; strings that would need an escape take the DOM path.
TEST(ManifestReaderTest, PlainTextIsTheDocumentManifestToJsonHolds) {
  for (const std::string& text : {std::string(kModel), SortedKeys(kModel)}) {
    absl::StatusOr<Manifest> m = ManifestFromJson(text);
    ASSERT_TRUE(m.ok()) << m.status();
    std::optional<std::string> plain = ManifestToPlainJsonText(*m);
    ASSERT_TRUE(plain.has_value());
    EXPECT_EQ(Json::parse(*plain), ManifestToJson(*m));
    EXPECT_TRUE(ValidateManifest(*m).ok());
  }
  absl::StatusOr<Manifest> m = ManifestFromJson(kModel);
  ASSERT_TRUE(m.ok());
  for (const std::string& odd :
       {std::string("a\"b"), std::string("\\"), std::string("\x01"), std::string("N\xc3\xa9t")}) {
    Manifest copy = *m;
    copy.modules[0].type = odd;
    EXPECT_FALSE(ManifestToPlainJsonText(copy).has_value()) << odd;
    EXPECT_TRUE(ValidateManifest(copy).ok()) << odd;  // the DOM path reads it
  }
  Manifest bad = *m;
  bad.modules[1].params[0].name = "a.b";
  EXPECT_EQ(ValidateManifest(bad).message(),
            "manifest: $.root.children[0].module.params[0].name: parameter name \"a.b\" must not "
            "contain \".\"");
}

}  // namespace
}  // namespace flatshard
