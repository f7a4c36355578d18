// Tests for common/manifest: parsing and validation of flatshard.manifest/1 (formats.md), refs
// to shared module instances, tied parameters, and ValidateManifest on manifests built in code.

#include "common/manifest.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/limits.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

// The example of formats.md, verbatim.
constexpr char kFormatsExample[] = R"({
  "format": "flatshard.manifest/1",
  "root": {
    "id": 0, "type": "GPT", "bases": ["Module"],
    "params": [
      {"name": "weight", "id": 0, "shape": [503, 48], "dtype": "float32", "requires_grad": true}
    ],
    "children": [
      {"name": "wte", "module": {"id": 1, "type": "Embedding", "bases": ["Module"], "params": [], "children": []}},
      {"name": "alias", "module": {"ref": 1}}
    ]
  }
})";

Json Param(const std::string& name, int64_t id, std::vector<int64_t> shape,
           const std::string& dtype = "float32", bool requires_grad = true) {
  return Json{{"name", name},
              {"id", id},
              {"shape", shape},
              {"dtype", dtype},
              {"requires_grad", requires_grad}};
}

Json Module(int64_t id, const std::string& type, Json params = Json::array(),
            Json children = Json::array()) {
  return Json{{"id", id},
              {"type", type},
              {"bases", {"Module"}},
              {"params", std::move(params)},
              {"children", std::move(children)}};
}

Json Child(const std::string& name, Json module) {
  return Json{{"name", name}, {"module", std::move(module)}};
}

Json Ref(int64_t id) { return Json{{"ref", id}}; }

Json Doc(Json root) { return Json{{"format", "flatshard.manifest/1"}, {"root", std::move(root)}}; }

absl::StatusOr<Manifest> Parse(const Json& doc) { return ManifestFromJson(doc.dump()); }

// Expects INVALID_ARGUMENT with exactly `message`.
void ExpectRefused(const Json& doc, const std::string& message) {
  absl::StatusOr<Manifest> m = Parse(doc);
  ASSERT_FALSE(m.ok()) << doc.dump();
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(m.status()), message);
}

TEST(ManifestTest, FormatsExampleParses) {
  absl::StatusOr<Manifest> m = ManifestFromJson(kFormatsExample);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->modules.size(), 2u);
  const ModuleDecl& root = m->root();
  EXPECT_EQ(root.id, 0);
  EXPECT_EQ(root.type, "GPT");
  EXPECT_EQ(root.bases, std::vector<std::string>{"Module"});
  ASSERT_EQ(root.params.size(), 1u);
  EXPECT_EQ(root.params[0].name, "weight");
  EXPECT_EQ(root.params[0].id, 0);
  EXPECT_EQ(root.params[0].shape, (std::vector<int64_t>{503, 48}));
  EXPECT_EQ(root.params[0].dtype, DType::kFloat32);
  EXPECT_TRUE(root.params[0].requires_grad);
  EXPECT_EQ(root.params[0].numel, 503 * 48);
  ASSERT_EQ(root.children.size(), 2u);
  EXPECT_EQ(root.children[0], (ChildDecl{"wte", 1}));
  // The ref reuses the index of the instance defined earlier.
  EXPECT_EQ(root.children[1], (ChildDecl{"alias", 1}));
  EXPECT_EQ(m->modules[1].id, 1);
  EXPECT_EQ(m->modules[1].type, "Embedding");
  EXPECT_TRUE(m->modules[1].params.empty());
}

TEST(ManifestTest, SharedModulesAreStoredOnceInPreOrder) {
  // root
  //   a (id 10): child x (id 11, param p0), child y (id 12)
  //   b -> ref 11 (a.x), c -> ref 10 (a), d (id 13) with child e -> ref 12
  Json x = Module(11, "Linear", Json::array({Param("w", 0, {2, 3})}));
  Json a = Module(10, "Block", Json::array(),
                  Json::array({Child("x", x), Child("y", Module(12, "ReLU"))}));
  Json d = Module(13, "Seq", Json::array(), Json::array({Child("e", Ref(12))}));
  Json root =
      Module(0, "Net", Json::array(),
             Json::array({Child("a", a), Child("b", Ref(11)), Child("c", Ref(10)), Child("d", d)}));
  absl::StatusOr<Manifest> m = Parse(Doc(root));
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->modules.size(), 5u);
  std::vector<int64_t> ids;
  for (const ModuleDecl& mod : m->modules) ids.push_back(mod.id);
  EXPECT_EQ(ids, (std::vector<int64_t>{0, 10, 11, 12, 13}));
  EXPECT_EQ(m->root().children, (std::vector<ChildDecl>{{"a", 1}, {"b", 2}, {"c", 1}, {"d", 4}}));
  EXPECT_EQ(m->modules[1].children, (std::vector<ChildDecl>{{"x", 2}, {"y", 3}}));
  EXPECT_EQ(m->modules[4].children, (std::vector<ChildDecl>{{"e", 3}}));
  EXPECT_TRUE(ValidateManifest(*m).ok());
}

TEST(ManifestTest, DanglingRefIsRefused) {
  ExpectRefused(Doc(Module(0, "Net", Json::array(), Json::array({Child("a", Ref(7))}))),
                "manifest: $.root.children[0].module.ref: dangling ref: no module with id 7 is "
                "defined before this point (a shared module is written in full at its first "
                "occurrence in pre-order)");
}

TEST(ManifestTest, ForwardRefIsRefused) {
  // The ref comes before the full definition of module 1.
  Json root = Module(0, "Net", Json::array(),
                     Json::array({Child("alias", Ref(1)), Child("wte", Module(1, "Embedding"))}));
  ExpectRefused(Doc(root),
                "manifest: $.root.children[0].module.ref: dangling ref: no module with id 1 is "
                "defined before this point (a shared module is written in full at its first "
                "occurrence in pre-order)");
}

TEST(ManifestTest, CyclicRefToAncestorIsRefused) {
  Json inner = Module(1, "Block", Json::array(), Json::array({Child("back", Ref(0))}));
  ExpectRefused(Doc(Module(0, "Net", Json::array(), Json::array({Child("a", inner)}))),
                "manifest: $.root.children[0].module.children[0].module.ref: cyclic ref: module "
                "id 0 is an ancestor of this position ($.root)");
  // A module referring to itself.
  Json self = Module(1, "Block", Json::array(), Json::array({Child("me", Ref(1))}));
  ExpectRefused(Doc(Module(0, "Net", Json::array(), Json::array({Child("a", self)}))),
                "manifest: $.root.children[0].module.children[0].module.ref: cyclic ref: module "
                "id 1 is an ancestor of this position ($.root.children[0].module)");
}

TEST(ManifestTest, RefWithExtraKeysIsRefused) {
  Json ref = Ref(1);
  ref["type"] = "Embedding";
  Json root = Module(0, "Net", Json::array(),
                     Json::array({Child("wte", Module(1, "Embedding")), Child("alias", ref)}));
  ExpectRefused(Doc(root),
                "manifest: $.root.children[1].module: a {\"ref\": ID} module must have no other "
                "keys");
}

TEST(ManifestTest, RefMustBeAnInteger) {
  Json root = Module(
      0, "Net", Json::array(),
      Json::array({Child("wte", Module(1, "Embedding")), Child("alias", Json{{"ref", "1"}})}));
  ExpectRefused(Doc(root),
                "manifest: $.root.children[1].module.ref: must be an integer, got a string");
}

TEST(ManifestTest, RootAsRefIsRefused) {
  ExpectRefused(Doc(Ref(0)), "manifest: $.root: the root module cannot be a ref");
}

TEST(ManifestTest, DuplicateModuleIdIsRefused) {
  Json root = Module(0, "Net", Json::array(),
                     Json::array({Child("a", Module(1, "A")), Child("b", Module(1, "B"))}));
  ExpectRefused(Doc(root),
                "manifest: $.root.children[1].module.id: module id 1 is defined twice (first at "
                "$.root.children[0].module); a module registered at several paths is written "
                "once and then as {\"ref\": 1}");
  // The root's id reused by a descendant.
  root = Module(5, "Net", Json::array(), Json::array({Child("a", Module(5, "A"))}));
  ExpectRefused(Doc(root),
                "manifest: $.root.children[0].module.id: module id 5 is defined twice (first at "
                "$.root); a module registered at several paths is written once and then as "
                "{\"ref\": 5}");
}

TEST(ManifestTest, DuplicateChildNamesAreRefused) {
  Json root = Module(0, "Net", Json::array(),
                     Json::array({Child("a", Module(1, "A")), Child("a", Module(2, "B"))}));
  ExpectRefused(Doc(root),
                "manifest: $.root.children[1].name: name \"a\" is already used on this module");
}

TEST(ManifestTest, DuplicateParamNamesAreRefused) {
  Json root = Module(0, "Net", Json::array({Param("w", 0, {2}), Param("w", 1, {2})}));
  ExpectRefused(Doc(root),
                "manifest: $.root.params[1].name: name \"w\" is already used on this module");
}

TEST(ManifestTest, ParamBufferAndChildShareOneNamespace) {
  Json root = Module(0, "Net", Json::array({Param("w", 0, {2})}));
  root["buffers"] = Json::array({Param("w", 1, {2})});
  ExpectRefused(Doc(root),
                "manifest: $.root.buffers[0].name: name \"w\" is already used on this module");
  root = Module(0, "Net", Json::array({Param("w", 0, {2})}),
                Json::array({Child("w", Module(1, "A"))}));
  ExpectRefused(Doc(root),
                "manifest: $.root.children[0].name: name \"w\" is already used on this module");
}

TEST(ManifestTest, NamesWithDotsOrEmptyAreRefused) {
  ExpectRefused(Doc(Module(0, "Net", Json::array(), Json::array({Child("a.b", Module(1, "A"))}))),
                "manifest: $.root.children[0].name: child name \"a.b\" must not contain \".\"");
  ExpectRefused(Doc(Module(0, "Net", Json::array(), Json::array({Child("", Module(1, "A"))}))),
                "manifest: $.root.children[0].name: child name must not be empty");
  ExpectRefused(Doc(Module(0, "Net", Json::array({Param("w.x", 0, {2})}))),
                "manifest: $.root.params[0].name: parameter name \"w.x\" must not contain \".\"");
  ExpectRefused(Doc(Module(0, "Net", Json::array({Param("", 0, {2})}))),
                "manifest: $.root.params[0].name: parameter name must not be empty");
  Json root = Module(0, "Net");
  root["buffers"] = Json::array({Param(".", 0, {2})});
  ExpectRefused(Doc(root),
                "manifest: $.root.buffers[0].name: buffer name \".\" must not contain \".\"");
}

TEST(ManifestTest, NegativeShapeDimIsRefused) {
  ExpectRefused(Doc(Module(0, "Net", Json::array({Param("w", 0, {2, -3})}))),
                "manifest: $.root.params[0].shape[1]: must be at least 0, got -3");
}

TEST(ManifestTest, ShapeWhoseProductOverflowsIsRefused) {
  ExpectRefused(Doc(Module(0, "Net", Json::array({Param("w", 0, {3037000500, 3037000500})}))),
                "manifest: $.root.params[0].shape: shape [3037000500, 3037000500] has more than "
                "2^63 elements");
  ExpectRefused(Doc(Module(0, "Net", Json::array({Param("w", 0, {2, 2, 4611686018427387904})}))),
                "manifest: $.root.params[0].shape: shape [2, 2, 4611686018427387904] has more "
                "than 2^63 elements");
  // Just below: 3037000499^2 = 9223372030926249001 fits.
  absl::StatusOr<Manifest> m =
      Parse(Doc(Module(0, "Net", Json::array({Param("w", 0, {3037000499, 3037000499})}))));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->root().params[0].numel, int64_t{9223372030926249001});
  m = Parse(
      Doc(Module(0, "Net", Json::array({Param("w", 0, {std::numeric_limits<int64_t>::max()})}))));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->root().params[0].numel, std::numeric_limits<int64_t>::max());
}

TEST(ManifestTest, FloatAndHugeDimsAreRefused) {
  Json doc = Doc(Module(0, "Net", Json::array({Param("w", 0, {2})})));
  doc["root"]["params"][0]["shape"] = Json::array({2.0, 3});
  ExpectRefused(doc,
                "manifest: $.root.params[0].shape[0]: must be an integer, got 2.0 (too large, or "
                "has a fraction or exponent)");
  doc["root"]["params"][0]["shape"] = Json::array({3, uint64_t{1} << 63});
  ExpectRefused(doc,
                "manifest: $.root.params[0].shape[1]: integer 9223372036854775808 overflows int64");
  doc["root"]["params"][0]["shape"] = "[2]";
  ExpectRefused(doc, "manifest: $.root.params[0].shape: must be an array, got a string");
}

TEST(ManifestTest, UnknownDTypeIsRefused) {
  ExpectRefused(Doc(Module(0, "Net", Json::array({Param("w", 0, {2}, "float8")}))),
                "manifest: $.root.params[0].dtype: unknown dtype \"float8\" (one of float32 "
                "float16 bfloat16 float64 int8 int32 int64 uint8 bool)");
}

TEST(ManifestTest, EveryDTypeIsAcceptedByTheParserIncludingIntegerParams) {
  // The planner, not the parser, refuses integer parameters in a unit.
  const std::vector<std::string> names = {"float32", "float16", "bfloat16", "float64", "int8",
                                          "int32",   "int64",   "uint8",    "bool"};
  Json params = Json::array();
  for (size_t i = 0; i < names.size(); ++i) {
    params.push_back(Param(absl::StrCat("p", i), static_cast<int64_t>(i), {3}, names[i], false));
  }
  absl::StatusOr<Manifest> m = Parse(Doc(Module(0, "Net", params)));
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->root().params.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(DTypeName(m->root().params[i].dtype), names[i]);
    EXPECT_FALSE(m->root().params[i].requires_grad);
  }
}

TEST(ManifestTest, RequiresGradDefaultsToTrue) {
  Json p = Param("w", 0, {2});
  p.erase("requires_grad");
  absl::StatusOr<Manifest> m = Parse(Doc(Module(0, "Net", Json::array({p}))));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->root().params[0].requires_grad);
  p["requires_grad"] = 1;
  ExpectRefused(Doc(Module(0, "Net", Json::array({p}))),
                "manifest: $.root.params[0].requires_grad: must be true or false, got an integer");
}

TEST(ManifestTest, TiedParamsMayRepeatWithEqualDeclarations) {
  Json lm_head = Module(2, "Linear", Json::array({Param("weight", 7, {4, 3})}));
  Json wte = Module(1, "Embedding", Json::array({Param("weight", 7, {4, 3})}));
  absl::StatusOr<Manifest> m = Parse(Doc(Module(
      0, "GPT", Json::array(), Json::array({Child("wte", wte), Child("lm_head", lm_head)}))));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->modules[1].params[0].id, 7);
  EXPECT_EQ(m->modules[2].params[0].id, 7);
}

TEST(ManifestTest, ConflictingTiedDeclarationsNameBothPaths) {
  auto doc_with = [](Json second) {
    Json wte = Module(1, "Embedding", Json::array({Param("weight", 7, {4, 3})}));
    Json lm_head = Module(2, "Linear", Json::array({std::move(second)}));
    return Doc(Module(0, "GPT", Json::array(),
                      Json::array({Child("wte", wte), Child("lm_head", lm_head)})));
  };
  ExpectRefused(
      doc_with(Param("weight", 7, {3, 4})),
      "manifest: $.root.children[1].module.params[0]: conflicting declarations of "
      "tied parameter id 7: shape [3, 4] vs [4, 3] at $.root.children[0].module.params[0]");
  ExpectRefused(doc_with(Param("weight", 7, {4, 3}, "float16")),
                "manifest: $.root.children[1].module.params[0]: conflicting declarations of "
                "tied parameter id 7: dtype float16 vs float32 at "
                "$.root.children[0].module.params[0]");
  ExpectRefused(doc_with(Param("weight", 7, {4, 3}, "float32", false)),
                "manifest: $.root.children[1].module.params[0]: conflicting declarations of "
                "tied parameter id 7: requires_grad false vs true at "
                "$.root.children[0].module.params[0]");
}

TEST(ManifestTest, UnknownKeysAreRefusedAtEveryLevel) {
  Json doc = Doc(Module(0, "Net", Json::array({Param("w", 0, {2})}),
                        Json::array({Child("a", Module(1, "A"))})));
  {
    Json d = doc;
    d["version"] = 1;
    ExpectRefused(d, "manifest: $: unknown key \"version\" (allowed: format, root)");
  }
  {
    Json d = doc;
    d["root"]["parameters"] = Json::array();
    ExpectRefused(d,
                  "manifest: $.root: unknown key \"parameters\" (allowed: id, type, bases, "
                  "params, buffers, children)");
  }
  {
    Json d = doc;
    d["root"]["params"][0]["stride"] = Json::array({1});
    ExpectRefused(d,
                  "manifest: $.root.params[0]: unknown key \"stride\" (allowed: name, id, shape, "
                  "dtype, requires_grad)");
  }
  {
    Json d = doc;
    d["root"]["children"][0]["path"] = "a";
    ExpectRefused(d, "manifest: $.root.children[0]: unknown key \"path\" (allowed: name, module)");
  }
  {
    Json d = doc;
    d["root"]["children"][0]["module"]["Type"] = "A";
    ExpectRefused(d,
                  "manifest: $.root.children[0].module: unknown key \"Type\" (allowed: id, type, "
                  "bases, params, buffers, children)");
  }
}

TEST(ManifestTest, FormatMustBePresentAndExact) {
  Json doc = Doc(Module(0, "Net"));
  doc["format"] = "flatshard.manifest/2";
  ExpectRefused(doc,
                "manifest: $.format: unknown format \"flatshard.manifest/2\", expected "
                "\"flatshard.manifest/1\"");
  doc["format"] = "flatshard.policy/1";
  ExpectRefused(doc,
                "manifest: $.format: unknown format \"flatshard.policy/1\", expected "
                "\"flatshard.manifest/1\"");
  doc.erase("format");
  ExpectRefused(doc, "manifest: $: missing required key \"format\"");
  doc = Doc(Module(0, "Net"));
  doc.erase("root");
  ExpectRefused(doc, "manifest: $: missing required key \"root\"");
}

TEST(ManifestTest, MissingOrBadModuleFieldsAreRefused) {
  Json m = Module(0, "Net");
  m.erase("id");
  ExpectRefused(Doc(m), "manifest: $.root: missing required key \"id\"");
  m = Module(0, "Net");
  m.erase("type");
  ExpectRefused(Doc(m), "manifest: $.root: missing required key \"type\"");
  ExpectRefused(Doc(Module(0, "")), "manifest: $.root.type: module type must not be empty");
  ExpectRefused(Doc(Json(5)), "manifest: $.root: must be an object, got an integer");
  ExpectRefused(Doc(Module(0, "Net", Json::array(), Json::array({Json{{"name", "a"}}}))),
                "manifest: $.root.children[0]: missing required key \"module\"");
  Json p = Param("w", 0, {2});
  p.erase("shape");
  ExpectRefused(Doc(Module(0, "Net", Json::array({p}))),
                "manifest: $.root.params[0]: missing required key \"shape\"");
  p = Param("w", 0, {2});
  p.erase("dtype");
  ExpectRefused(Doc(Module(0, "Net", Json::array({p}))),
                "manifest: $.root.params[0]: missing required key \"dtype\"");
  p = Param("w", 0, {2});
  p.erase("id");
  ExpectRefused(Doc(Module(0, "Net", Json::array({p}))),
                "manifest: $.root.params[0]: missing required key \"id\"");
}

TEST(ManifestTest, OptionalListsMayBeOmitted) {
  absl::StatusOr<Manifest> m =
      ManifestFromJson(R"({"format": "flatshard.manifest/1", "root": {"id": 3, "type": "Net"}})");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->modules.size(), 1u);
  EXPECT_EQ(m->root().id, 3);
  EXPECT_TRUE(m->root().bases.empty());
  EXPECT_TRUE(m->root().params.empty());
  EXPECT_TRUE(m->root().buffers.empty());
  EXPECT_TRUE(m->root().children.empty());
}

TEST(ManifestTest, ScalarShapeHasOneElementAndZeroDimsGiveZero) {
  absl::StatusOr<Manifest> m =
      Parse(Doc(Module(0, "Net",
                       Json::array({Param("s", 0, {}), Param("z", 1, {0}),
                                    Param("z2", 2, {5, 0, 7}), Param("v", 3, {2, 3, 4})}))));
  ASSERT_TRUE(m.ok()) << m.status();
  const auto& p = m->root().params;
  EXPECT_TRUE(p[0].shape.empty());
  EXPECT_EQ(p[0].numel, 1);
  EXPECT_EQ(p[1].numel, 0);
  EXPECT_EQ(p[2].numel, 0);
  EXPECT_EQ(p[3].numel, 24);
}

TEST(ManifestTest, IsInstanceOfChecksTypeAndBases) {
  ModuleDecl m;
  m.type = "BatchNorm2d";
  m.bases = {"_BatchNorm", "_NormBase", "Module"};
  EXPECT_TRUE(m.IsInstanceOf("BatchNorm2d"));
  EXPECT_TRUE(m.IsInstanceOf("_BatchNorm"));
  EXPECT_TRUE(m.IsInstanceOf("Module"));
  EXPECT_FALSE(m.IsInstanceOf("BatchNorm1d"));
  EXPECT_FALSE(m.IsInstanceOf("_Batch"));
  EXPECT_FALSE(m.IsInstanceOf(""));
}

Json RichDoc() {
  Json bn = Module(3, "BatchNorm2d", Json::array({Param("weight", 2, {8}), Param("bias", 3, {8})}));
  bn["bases"] = {"_BatchNorm", "_NormBase", "Module"};
  bn["buffers"] = Json::array({Param("running_mean", 4, {8}, "float32", false),
                               Param("num_batches_tracked", 5, {}, "int64", false)});
  Json conv = Module(2, "Conv2d",
                     Json::array({Param("weight", 0, {8, 3, 3, 3}, "bfloat16"),
                                  Param("frozen", 1, {0}, "float64", false)}));
  Json seq = Module(1, "Sequential", Json::array(),
                    Json::array({Child("0", conv), Child("1", bn), Child("2", Ref(2))}));
  Json head = Module(6, "Linear", Json::array({Param("weight", 0, {8, 3, 3, 3}, "bfloat16")}));
  return Doc(
      Module(0, "Net", Json::array({Param("scale", 9, {})}),
             Json::array({Child("features", seq), Child("again", Ref(1)), Child("head", head)})));
}

TEST(ManifestTest, ToJsonAndBackRoundTrips) {
  absl::StatusOr<Manifest> m = Parse(RichDoc());
  ASSERT_TRUE(m.ok()) << m.status();
  Json written = ManifestToJson(*m);
  EXPECT_EQ(written["format"], "flatshard.manifest/1");
  // Repeated instances are written as refs.
  EXPECT_EQ(written["root"]["children"][1]["module"], Ref(1));
  EXPECT_EQ(written["root"]["children"][0]["module"]["children"][2]["module"], Ref(2));
  absl::StatusOr<Manifest> again = ManifestFromJsonValue(written);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *m);
  // And through text.
  absl::StatusOr<Manifest> from_text = ManifestFromJson(written.dump());
  ASSERT_TRUE(from_text.ok()) << from_text.status();
  EXPECT_EQ(*from_text, *m);
  EXPECT_TRUE(ValidateManifest(*m).ok());
}

TEST(ManifestTest, FormatsExampleRoundTrips) {
  absl::StatusOr<Manifest> m = ManifestFromJson(kFormatsExample);
  ASSERT_TRUE(m.ok()) << m.status();
  absl::StatusOr<Manifest> again = ManifestFromJsonValue(ManifestToJson(*m));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *m);
}

// A code-built manifest: root(id 100) with children a(id 101) and b(id 102).
Manifest SmallManifest() {
  Manifest m;
  ModuleDecl root;
  root.id = 100;
  root.type = "Net";
  root.children = {{"a", 1}, {"b", 2}};
  ModuleDecl a;
  a.id = 101;
  a.type = "Linear";
  a.params.push_back(TensorDecl{"weight", 0, {2, 3}, DType::kFloat32, true, 6});
  ModuleDecl b;
  b.id = 102;
  b.type = "ReLU";
  m.modules = {root, a, b};
  return m;
}

TEST(ValidateManifestTest, AcceptsWellFormedCodeBuiltManifest) {
  EXPECT_TRUE(ValidateManifest(SmallManifest()).ok());
  Manifest shared = SmallManifest();
  shared.modules[0].children.push_back({"alias", 1});
  EXPECT_TRUE(ValidateManifest(shared).ok());
}

TEST(ValidateManifestTest, RefusesEmptyManifest) {
  absl::Status s = ValidateManifest(Manifest{});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(s), "manifest: no root module");
}

TEST(ValidateManifestTest, RefusesOutOfRangeChildIndex) {
  Manifest m = SmallManifest();
  m.modules[0].children[1].module = 3;
  absl::Status s = ValidateManifest(m);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(s), "manifest: module 100 child \"b\" refers to a missing module");
  m.modules[0].children[1].module = -1;
  EXPECT_EQ(Msg(ValidateManifest(m)),
            "manifest: module 100 child \"b\" refers to a missing module");
}

TEST(ValidateManifestTest, RefusesCycles) {
  Manifest m = SmallManifest();
  m.modules[1].children.push_back({"up", 0});
  absl::Status s = ValidateManifest(m);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(s), "manifest: cyclic module graph through module id 100");
  m = SmallManifest();
  m.modules[2].children.push_back({"self", 2});
  EXPECT_EQ(Msg(ValidateManifest(m)), "manifest: cyclic module graph through module id 102");
}

TEST(ValidateManifestTest, RefusesModulesNotInPreOrder) {
  Manifest m = SmallManifest();
  std::swap(m.modules[1], m.modules[2]);  // root.a now refers to index 2: pre-order is [0, 2, 1]
  m.modules[0].children = {{"a", 2}, {"b", 1}};
  absl::Status s = ValidateManifest(m);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("must be listed in pre-order of first occurrence"));
}

TEST(ValidateManifestTest, RefusesUnreachableModules) {
  Manifest m = SmallManifest();
  m.modules[0].children.pop_back();  // module 2 is now unreachable
  absl::Status s = ValidateManifest(m);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("each reachable from the root"));
}

TEST(ValidateManifestTest, AppliesTheJsonRules) {
  Manifest m = SmallManifest();
  m.modules[1].params[0].shape = {2, -3};
  absl::Status s = ValidateManifest(m);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s),
              HasSubstr("$.root.children[0].module.params[0].shape[1]: must be at least 0"));

  m = SmallManifest();
  m.modules[2].id = 101;
  EXPECT_THAT(Msg(ValidateManifest(m)), HasSubstr("module id 101 is defined twice"));

  m = SmallManifest();
  m.modules[0].children[1].name = "a";
  EXPECT_THAT(Msg(ValidateManifest(m)), HasSubstr("name \"a\" is already used on this module"));

  m = SmallManifest();
  m.modules[1].params[0].name = "w.x";
  EXPECT_THAT(Msg(ValidateManifest(m)), HasSubstr("must not contain \".\""));

  // A tied parameter declared with two shapes.
  m = SmallManifest();
  m.modules[2].params.push_back(TensorDecl{"weight", 0, {3, 2}, DType::kFloat32, true, 6});
  EXPECT_THAT(Msg(ValidateManifest(m)),
              HasSubstr("conflicting declarations of tied parameter id 0"));
}

TEST(ValidateManifestTest, RefusesNumelThatDoesNotMatchShape) {
  Manifest m = SmallManifest();
  m.modules[1].params[0].numel = 7;
  absl::Status s = ValidateManifest(m);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

TEST(ManifestTest, OversizedJsonIsRefusedBeforeParsing) {
  // Not even JSON: the size alone refuses it.
  const std::string text(kMaxManifestJsonBytes + 1, '[');
  absl::StatusOr<Manifest> m = ManifestFromJson(text);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(m.status().message(),
              HasSubstr(absl::StrCat("the JSON text has ", text.size(), " bytes, the limit is ",
                                     kMaxManifestJsonBytes)));
}

TEST(ManifestTest, TooManyModulesAreRefusedNamingTheLimit) {
  std::string children;
  for (int64_t i = 1; i <= kMaxManifestModules; ++i) {
    absl::StrAppend(&children, i == 1 ? "" : ",", R"({"name": "m)", i, R"(", "module": {"id": )", i,
                    R"(, "type": "Identity", "params": [], "children": []}})");
  }
  const std::string text = absl::StrCat(
      R"({"format": "flatshard.manifest/1", "root": {"id": 0, "type": "Wide", "params": [], )",
      R"("children": [)", children, "]}}");
  absl::StatusOr<Manifest> m = ManifestFromJson(text);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(m.status().message(),
              HasSubstr(absl::StrCat("more than ", kMaxManifestModules, " module instances")));
}

}  // namespace

}  // namespace flatshard
