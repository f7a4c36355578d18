#include "common/checkpoint/checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/file_system.h"
#include "common/status_macros.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace flatshard::checkpoint {
namespace {

// ---- CRC-32C ----

struct Crc32cTable {
  uint32_t t[8][256];
  Crc32cTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    }
  }
};

uint32_t Crc32cSoftware(uint32_t crc, const uint8_t* p, size_t n) {
  static const Crc32cTable table;
  const auto& t = table.t;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= crc;
    crc = t[7][v & 0xff] ^ t[6][(v >> 8) & 0xff] ^ t[5][(v >> 16) & 0xff] ^ t[4][(v >> 24) & 0xff] ^
          t[3][(v >> 32) & 0xff] ^ t[2][(v >> 40) & 0xff] ^ t[1][(v >> 48) & 0xff] ^ t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xff];
  return crc;
}

// GF(2) arithmetic modulo the (reflected) CRC-32C polynomial, as zlib's crc32_combine does it:
// a * b mod P, and x^(8 n) mod P (the operator that runs a CRC register over n zero bytes).
uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t m = uint32_t{1} << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ 0x82F63B78u : b >> 1;
  }
  return p;
}
uint32_t ShiftOperator(uint64_t n_bytes) {
  static const auto* table = [] {
    auto* t = new uint32_t[32];
    uint32_t p = uint32_t{1} << 30;  // x^1
    t[0] = p;
    for (int k = 1; k < 32; ++k) t[k] = p = MultModP(p, p);
    return t;
  }();
  uint32_t p = uint32_t{1} << 31;  // x^0
  uint64_t n = n_bytes;
  unsigned k = 3;  // x^(8 n) = x^(2^3 n)
  while (n) {
    if (n & 1) p = MultModP(table[k & 31], p);
    n >>= 1;
    ++k;
  }
  return p;
}

#if defined(__x86_64__)
// The raw CRC register (no pre/post inversion) over `n` bytes. Large inputs run three
// independent lanes interleaved (the crc32 instruction has a latency of 3 cycles and a
// throughput of 1), then combine them: R(c, A B) = x^(8|B|) R(c, A) + R(0, B).
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(uint32_t crc, const uint8_t* p,
                                                          size_t n) {
  constexpr size_t kMinInterleaved = 3 * 4096;
  while (n >= kMinInterleaved) {
    const size_t lane = std::min<size_t>(n / 3, size_t{1} << 20) & ~size_t{7};
    uint64_t a = crc, b = 0, c = 0;
    const uint8_t* pa = p;
    const uint8_t* pb = p + lane;
    const uint8_t* pc = p + 2 * lane;
    for (size_t i = 0; i < lane; i += 8) {
      uint64_t va, vb, vc;
      std::memcpy(&va, pa + i, 8);
      std::memcpy(&vb, pb + i, 8);
      std::memcpy(&vc, pc + i, 8);
      a = _mm_crc32_u64(a, va);
      b = _mm_crc32_u64(b, vb);
      c = _mm_crc32_u64(c, vc);
    }
    static thread_local size_t cached_lane = 0;
    static thread_local uint32_t op1 = 0, op2 = 0;
    if (cached_lane != lane) {
      cached_lane = lane;
      op1 = ShiftOperator(lane);
      op2 = ShiftOperator(2 * lane);
    }
    crc = MultModP(op2, static_cast<uint32_t>(a)) ^ MultModP(op1, static_cast<uint32_t>(b)) ^
          static_cast<uint32_t>(c);
    p += 3 * lane;
    n -= 3 * lane;
  }
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
bool HaveSse42() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

std::string Errno(absl::string_view what, const std::string& path, int err) {
  return absl::StrCat(path, ": ", what, ": ", std::strerror(err));
}

int64_t AlignUp(int64_t n) {
  return (n + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment;
}

// A file descriptor closed on scope exit.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

// A data file's size against its metadata's.
absl::Status CheckFileSize(const std::string& path, int64_t size, int64_t want) {
  if (size == want) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(path, ": ", size, " bytes, the metadata says ", want,
                   size < want ? " (truncated)" : " (longer than written)"));
}

// ---- Metadata parsing ----

absl::StatusOr<uint32_t> ParseHex32(const std::string& s, const JsonPath& path) {
  if (s.size() != 8 || s.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return path.Error("must be 8 lower-case hex digits");
  }
  return static_cast<uint32_t>(std::stoul(s, nullptr, 16));
}

std::string Hex32(uint32_t v) { return absl::StrFormat("%08x", v); }

}  // namespace

uint32_t Crc32c(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (HaveSse42()) return ~Crc32cHardware(crc, p, n);
#endif
  return ~Crc32cSoftware(crc, p, n);
}

namespace internal {
uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t n) {
  return ~Crc32cSoftware(~crc, static_cast<const uint8_t*>(data), n);
}
}  // namespace internal

std::string RankFileName(int32_t rank, int32_t world_size) {
  return absl::StrFormat("rank-%05d-of-%05d.bin", rank, world_size);
}

const TensorEntry* Metadata::FindTensor(int32_t rank, int32_t unit, absl::string_view name) const {
  for (const TensorEntry& t : tensors) {
    if (t.rank == rank && t.unit == unit && t.name == name) return &t;
  }
  return nullptr;
}

int64_t Metadata::total_bytes() const {
  int64_t n = 0;
  for (const FileEntry& f : files) n += f.bytes;
  return n;
}

nlohmann::ordered_json MetadataToJson(const Metadata& meta) {
  nlohmann::ordered_json doc;
  doc["format"] = std::string(kFormat);
  doc["module"] = meta.module;
  doc["group"] = meta.group;
  doc["world_size"] = meta.world_size;
  doc["generation"] = meta.generation;
  doc["created"] = meta.created;
  doc["checksum"] = "crc32c";
  nlohmann::ordered_json params = nlohmann::ordered_json::array();
  for (const PlanUnit& u : meta.plan.units) {
    for (const PlanParam& p : u.params) {
      nlohmann::ordered_json e;
      e["fqn"] = p.fqn;
      e["shape"] = p.shape;
      e["dtype"] = std::string(DTypeName(u.dtype));
      e["unit"] = u.index;
      e["offset"] = p.offset;
      e["numel"] = p.numel;
      std::vector<std::string> aliases;
      for (const SharedParam& s : u.shared) {
        if (s.same_as == p.fqn) aliases.push_back(s.fqn);
      }
      e["aliases"] = aliases;
      params.push_back(std::move(e));
    }
  }
  doc["params"] = std::move(params);
  nlohmann::ordered_json files = nlohmann::ordered_json::array();
  for (const FileEntry& f : meta.files) {
    nlohmann::ordered_json e;
    e["name"] = f.name;
    e["rank"] = f.rank;
    e["bytes"] = f.bytes;
    e["crc32c"] = Hex32(f.crc32c);
    files.push_back(std::move(e));
  }
  doc["files"] = std::move(files);
  nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
  for (const TensorEntry& t : meta.tensors) {
    nlohmann::ordered_json e;
    e["rank"] = t.rank;
    e["unit"] = t.unit;
    e["name"] = t.name;
    e["dtype"] = std::string(DTypeName(t.dtype));
    e["offset"] = t.offset;
    e["bytes"] = t.bytes;
    tensors.push_back(std::move(e));
  }
  doc["tensors"] = std::move(tensors);
  nlohmann::ordered_json tied = nlohmann::ordered_json::array();
  for (const SharedParam& t : meta.tied) tied.push_back({{"fqn", t.fqn}, {"same_as", t.same_as}});
  doc["tied"] = std::move(tied);
  if (!meta.state_specs.empty()) {
    nlohmann::ordered_json specs = nlohmann::ordered_json::array();
    for (const StateSpec& st : meta.state_specs) {
      nlohmann::ordered_json e;
      e["name"] = st.name;
      e["dtype"] = std::string(DTypeName(st.dtype));
      e["shape"] = std::string(StateShapeName(st.shape));
      specs.push_back(std::move(e));
    }
    doc["optimizer_state"] = std::move(specs);
  }
  doc["plan"] = PlanToJson(meta.plan);
  return doc;
}

absl::StatusOr<Metadata> MetadataFromJson(absl::string_view text, absl::string_view path) {
  const std::string doc_name(path);
  FS_ASSIGN_OR_RETURN(Json doc, ParseJson(text, doc_name));
  const JsonPath root(doc_name);
  FS_RETURN_IF_ERROR(
      ExpectObject(doc, root,
                   {"format", "module", "group", "world_size", "generation", "created", "checksum",
                    "params", "files", "tensors", "tied", "plan", "optimizer_state"}));
  Metadata m;
  FS_ASSIGN_OR_RETURN(std::string format, GetString(doc, "format", root));
  if (format != kFormat) {
    return root.Key("format").Error(
        absl::StrCat("unsupported format ", Quote(format), " (this build reads ", kFormat, ")"));
  }
  FS_ASSIGN_OR_RETURN(m.module, GetString(doc, "module", root));
  FS_ASSIGN_OR_RETURN(m.group, GetString(doc, "group", root));
  FS_ASSIGN_OR_RETURN(int64_t world, GetInt(doc, "world_size", root, 1, 1 << 24));
  m.world_size = static_cast<int32_t>(world);
  FS_ASSIGN_OR_RETURN(int64_t generation, GetInt(doc, "generation", root, 0));
  m.generation = static_cast<uint64_t>(generation);
  FS_RETURN_IF_ERROR(GetOptionalString(doc, "created", root, &m.created));
  FS_ASSIGN_OR_RETURN(std::string checksum, GetString(doc, "checksum", root));
  if (checksum != "crc32c") {
    return root.Key("checksum").Error(absl::StrCat("unsupported checksum ", Quote(checksum)));
  }
  if (!doc.contains("plan")) return root.Key("plan").Error("missing");
  {
    absl::StatusOr<Plan> plan = PlanFromJsonValue(doc["plan"]);
    if (!plan.ok()) {
      return root.Key("plan").Error(plan.status().message());
    }
    m.plan = *std::move(plan);
  }
  if (m.plan.world_size != m.world_size) {
    return root.Key("world_size")
        .Error(absl::StrCat(world, " differs from the plan's world_size ", m.plan.world_size));
  }
  // "params" is derived from the plan; it must agree with it (a hand-edited file is refused).
  if (!doc.contains("params")) return root.Key("params").Error("missing");
  FS_RETURN_IF_ERROR(ExpectArray(doc["params"], root.Key("params")));
  {
    size_t n = 0;
    for (const PlanUnit& u : m.plan.units) n += u.params.size();
    if (doc["params"].size() != n) {
      return root.Key("params").Error(
          absl::StrCat("has ", doc["params"].size(), " entries, the plan ", n, " parameters"));
    }
    size_t i = 0;
    for (const PlanUnit& u : m.plan.units) {
      for (const PlanParam& p : u.params) {
        const JsonPath at = root.Key("params").Index(i);
        const Json& e = doc["params"][i++];
        if (!e.is_object() || !e.contains("fqn") || e["fqn"] != p.fqn) {
          return at.Error(absl::StrCat("does not match the plan's parameter ", Quote(p.fqn)));
        }
      }
    }
  }
  const JsonPath files_path = root.Key("files");
  if (!doc.contains("files")) return files_path.Error("missing");
  FS_RETURN_IF_ERROR(ExpectArray(doc["files"], files_path));
  for (size_t i = 0; i < doc["files"].size(); ++i) {
    const Json& e = doc["files"][i];
    const JsonPath at = files_path.Index(i);
    FS_RETURN_IF_ERROR(ExpectObject(e, at, {"name", "rank", "bytes", "crc32c"}));
    FileEntry f;
    FS_ASSIGN_OR_RETURN(f.name, GetString(e, "name", at));
    FS_ASSIGN_OR_RETURN(int64_t rank, GetInt(e, "rank", at, 0, world - 1));
    f.rank = static_cast<int32_t>(rank);
    FS_ASSIGN_OR_RETURN(f.bytes, GetInt(e, "bytes", at, 0));
    FS_ASSIGN_OR_RETURN(std::string crc, GetString(e, "crc32c", at));
    FS_ASSIGN_OR_RETURN(f.crc32c, ParseHex32(crc, at.Key("crc32c")));
    if (f.rank != static_cast<int32_t>(i)) {
      return at.Key("rank").Error(
          absl::StrCat("is ", f.rank, ", expected ", i, " (files by rank)"));
    }
    if (f.name != RankFileName(f.rank, m.world_size)) {
      return at.Key("name").Error(absl::StrCat("must be ", RankFileName(f.rank, m.world_size)));
    }
    m.files.push_back(std::move(f));
  }
  if (static_cast<int64_t>(m.files.size()) != world) {
    return files_path.Error(absl::StrCat("has ", m.files.size(), " files for world_size ", world));
  }
  const JsonPath tensors_path = root.Key("tensors");
  if (!doc.contains("tensors")) return tensors_path.Error("missing");
  FS_RETURN_IF_ERROR(ExpectArray(doc["tensors"], tensors_path));
  std::set<std::tuple<int32_t, int32_t, std::string>> seen;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> extents(m.world_size);
  for (size_t i = 0; i < doc["tensors"].size(); ++i) {
    const Json& e = doc["tensors"][i];
    const JsonPath at = tensors_path.Index(i);
    FS_RETURN_IF_ERROR(ExpectObject(e, at, {"rank", "unit", "name", "dtype", "offset", "bytes"}));
    TensorEntry t;
    FS_ASSIGN_OR_RETURN(int64_t rank, GetInt(e, "rank", at, 0, world - 1));
    t.rank = static_cast<int32_t>(rank);
    FS_ASSIGN_OR_RETURN(int64_t unit,
                        GetInt(e, "unit", at, 0, static_cast<int64_t>(m.plan.units.size()) - 1));
    t.unit = static_cast<int32_t>(unit);
    FS_ASSIGN_OR_RETURN(t.name, GetString(e, "name", at));
    FS_ASSIGN_OR_RETURN(std::string dtype, GetString(e, "dtype", at));
    std::optional<DType> dt = ParseDType(dtype);
    if (!dt) return at.Key("dtype").Error(absl::StrCat("unknown dtype ", Quote(dtype)));
    t.dtype = *dt;
    FS_ASSIGN_OR_RETURN(t.offset, GetInt(e, "offset", at, 0));
    FS_ASSIGN_OR_RETURN(t.bytes, GetInt(e, "bytes", at, 0));
    if (t.offset % kTensorAlignment != 0) {
      return at.Key("offset").Error(absl::StrCat("is not a multiple of ", kTensorAlignment));
    }
    const FileEntry& f = m.files[t.rank];
    if (t.offset > f.bytes || t.bytes > f.bytes - t.offset) {
      return at.Error(absl::StrCat("bytes [", t.offset, ", ", t.offset + t.bytes, ") lie outside ",
                                   f.name, " (", f.bytes, " bytes)"));
    }
    if (!seen.insert({t.rank, t.unit, t.name}).second) {
      return at.Error(absl::StrCat("duplicate tensor (rank ", t.rank, ", unit ", t.unit, ", ",
                                   Quote(t.name), ")"));
    }
    if (t.name == kShardTensor) {
      const PlanUnit& u = m.plan.units[t.unit];
      if (t.dtype != u.dtype || t.bytes != u.shard_numel * ItemSize(u.dtype)) {
        return at.Error(absl::StrCat(
            "unit ", t.unit, "'s shard must be ", u.shard_numel * ItemSize(u.dtype), " bytes of ",
            DTypeName(u.dtype), ", not ", t.bytes, " of ", DTypeName(t.dtype)));
      }
    }
    extents[t.rank].push_back({t.offset, t.offset + t.bytes});
    m.tensors.push_back(std::move(t));
  }
  if (doc.contains("tied")) {
    const JsonPath tied_path = root.Key("tied");
    FS_RETURN_IF_ERROR(ExpectArray(doc["tied"], tied_path));
    std::set<std::string> planned;
    for (const PlanUnit& u : m.plan.units) {
      for (const PlanParam& p : u.params) planned.insert(p.fqn);
    }
    for (size_t i = 0; i < doc["tied"].size(); ++i) {
      const JsonPath at = tied_path.Index(i);
      const Json& e = doc["tied"][i];
      FS_RETURN_IF_ERROR(ExpectObject(e, at, {"fqn", "same_as"}));
      SharedParam t;
      FS_ASSIGN_OR_RETURN(t.fqn, GetString(e, "fqn", at));
      FS_ASSIGN_OR_RETURN(t.same_as, GetString(e, "same_as", at));
      if (!planned.contains(t.same_as)) {
        return at.Key("same_as").Error(
            absl::StrCat(Quote(t.same_as), " is not a parameter of the plan"));
      }
      m.tied.push_back(std::move(t));
    }
  }
  if (doc.contains("optimizer_state")) {
    const JsonPath specs_path = root.Key("optimizer_state");
    FS_RETURN_IF_ERROR(ExpectArray(doc["optimizer_state"], specs_path));
    for (size_t i = 0; i < doc["optimizer_state"].size(); ++i) {
      const JsonPath at = specs_path.Index(i);
      const Json& e = doc["optimizer_state"][i];
      FS_RETURN_IF_ERROR(ExpectObject(e, at, {"name", "dtype", "shape"}));
      StateSpec st;
      FS_ASSIGN_OR_RETURN(st.name, GetString(e, "name", at));
      if (st.name == kShardTensor) {
        return at.Key("name").Error(absl::StrCat(Quote(st.name), " is the parameters' tensor"));
      }
      FS_ASSIGN_OR_RETURN(std::string dtype, GetString(e, "dtype", at));
      std::optional<DType> dt = ParseDType(dtype);
      if (!dt) return at.Key("dtype").Error(absl::StrCat("unknown dtype ", Quote(dtype)));
      st.dtype = *dt;
      FS_ASSIGN_OR_RETURN(std::string shape, GetString(e, "shape", at));
      if (shape != "shard" && shape != "scalar") {
        return at.Key("shape").Error(
            absl::StrCat("must be \"shard\" or \"scalar\", got ", Quote(shape)));
      }
      st.shape = shape == "shard" ? StateShape::kShard : StateShape::kScalar;
      m.state_specs.push_back(std::move(st));
    }
    if (absl::Status v = ValidateStateSpecs(m.state_specs); !v.ok()) {
      return specs_path.Error(v.message());
    }
  }
  // Optimizer state tensors by (rank, unit, name) (FindTensor is a linear scan).
  std::map<std::tuple<int32_t, int32_t, std::string>, const TensorEntry*> state_index;
  if (!m.state_specs.empty()) {
    for (const TensorEntry& t : m.tensors) {
      if (t.name != kShardTensor) state_index[{t.rank, t.unit, t.name}] = &t;
    }
  }
  for (int32_t r = 0; r < m.world_size; ++r) {
    for (const PlanUnit& u : m.plan.units) {
      for (const StateSpec& st : m.state_specs) {
        auto found = state_index.find({r, u.index, st.name});
        const TensorEntry* t = found == state_index.end() ? nullptr : found->second;
        const int64_t bytes = st.Numel(u.shard_numel) * ItemSize(st.dtype);
        if (t == nullptr) {
          return tensors_path.Error(absl::StrCat("has no optimizer state ", Quote(st.name),
                                                 " of rank ", r, " unit ", u.index));
        }
        if (t->dtype != st.dtype || t->bytes != bytes) {
          return tensors_path.Error(absl::StrCat("optimizer state ", Quote(st.name), " of rank ", r,
                                                 " unit ", u.index, " must be ", bytes,
                                                 " bytes of ", DTypeName(st.dtype), ", not ",
                                                 t->bytes, " of ", DTypeName(t->dtype)));
        }
      }
      if (m.FindTensor(r, u.index, kShardTensor) == nullptr) {
        return tensors_path.Error(absl::StrCat("has no \"shard\" of rank ", r, " unit ", u.index,
                                               " (", Quote(u.module), ")"));
      }
    }
    auto& x = extents[r];
    std::sort(x.begin(), x.end());
    for (size_t i = 1; i < x.size(); ++i) {
      if (x[i].first < x[i - 1].second) {
        return tensors_path.Error(
            absl::StrCat("tensors of rank ", r, " overlap at byte ", x[i].first));
      }
    }
  }
  return m;
}

std::vector<SharedParam> TiedAliases(const Manifest& manifest, const Plan& plan) {
  std::set<std::string> named(plan.ignored_params.begin(), plan.ignored_params.end());
  std::set<std::string> params;
  for (const PlanUnit& u : plan.units) {
    for (const PlanParam& p : u.params) {
      named.insert(p.fqn);
      params.insert(p.fqn);
    }
    for (const SharedParam& s : u.shared) named.insert(s.fqn);
  }
  std::vector<std::pair<std::string, int64_t>> all;  // (path, tensor id), pre-order
  std::function<void(int32_t, const std::string&, int)> visit =
      [&](int32_t index, const std::string& prefix, int depth) {
        if (depth > kMaxJsonDepth) return;  // a validated manifest is far shallower
        const ModuleDecl& m = manifest.modules[index];
        for (const TensorDecl& t : m.params) all.push_back({prefix + t.name, t.id});
        for (const ChildDecl& c : m.children) visit(c.module, prefix + c.name + ".", depth + 1);
      };
  if (!manifest.modules.empty()) visit(0, "", 0);
  std::map<int64_t, std::string> canonical;  // tensor id -> the plan param holding it
  for (const auto& [path, id] : all) {
    if (params.contains(path) && !canonical.contains(id)) canonical[id] = path;
  }
  std::vector<SharedParam> out;
  std::set<std::string> seen;
  for (const auto& [path, id] : all) {
    if (named.contains(path) || !seen.insert(path).second) continue;
    auto it = canonical.find(id);
    if (it != canonical.end()) out.push_back(SharedParam{path, it->second});
  }
  return out;
}

// ---- Writing ----

namespace internal {

absl::Status ReadAll(int fd, void* data, size_t n, int64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, std::min<size_t>(n, size_t{1} << 30), offset);
    if (r < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(Errno("read", path, errno));
    }
    if (r == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": ends at byte ", offset, " (truncated)"));
    }
    p += r;
    n -= static_cast<size_t>(r);
    offset += r;
  }
  return absl::OkStatus();
}

absl::Status FsyncDir(const std::string& dir) { return FileSystem::Posix()->SyncDir(dir); }

std::string DirOf(const std::string& path) { return DirName(path); }

std::string NowText() {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone());
}

}  // namespace internal

absl::Status MakeDirs(const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("empty directory name");
  std::string prefix;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    prefix = dir.substr(0, pos);
    if (prefix.empty()) continue;
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::InternalError(Errno("mkdir", prefix, errno));
    }
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return absl::InternalError(Errno("stat", dir, errno));
  if (!S_ISDIR(st.st_mode)) return absl::FailedPreconditionError(dir + ": not a directory");
  return absl::OkStatus();
}

absl::StatusOr<WrittenFile> WriteRankFile(const std::string& dir, int32_t rank, int32_t world_size,
                                          const std::vector<TensorToWrite>& tensors,
                                          const ProgressFn& progress) {
  WrittenFile out;
  out.file.rank = rank;
  out.file.name = RankFileName(rank, world_size);
  AtomicWriteOptions options;
  options.mode = 0644;
  options.temp_suffix = ".tmp";
  options.sync_dir = false;  // WriteMetadata fsyncs the directory once for every data file
  FS_ASSIGN_OR_RETURN(
      std::unique_ptr<AtomicFile> file,
      AtomicFile::Create(FileSystem::Posix(), absl::StrCat(dir, "/", out.file.name), options));
  // Large sequential writes: the shards are written straight from their (mapped) memory, in
  // chunks so the CRC of a chunk is computed while it is still in cache and progress moves.
  constexpr int64_t kChunk = int64_t{8} << 20;
  static const char kZeros[kTensorAlignment] = {};
  uint32_t crc = 0;
  int64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    const int64_t start = AlignUp(offset);
    if (start > offset) {
      FS_RETURN_IF_ERROR(file->Append(absl::string_view(kZeros, start - offset)));
      crc = Crc32c(crc, kZeros, start - offset);
      offset = start;
    }
    const auto* p = static_cast<const char*>(t.data);
    for (int64_t done = 0; done < t.bytes;) {
      const int64_t n = std::min(kChunk, t.bytes - done);
      crc = Crc32c(crc, p + done, n);
      FS_RETURN_IF_ERROR(file->Append(absl::string_view(p + done, n)));
      done += n;
      offset += n;
      if (progress) progress(n);
    }
    out.tensors.push_back(TensorEntry{rank, t.unit, t.name, t.dtype, start, t.bytes});
  }
  FS_RETURN_IF_ERROR(file->Publish());
  out.file.bytes = offset;
  out.file.crc32c = crc;
  return out;
}

absl::Status WriteMetadata(const std::string& dir, const Metadata& meta) {
  // The data files' renames reach the disk with this directory fsync at the latest, before the
  // metadata's rename can (this fsyncs the directory after the data files' renames and again
  // after its own): a metadata file never names data files that are not durable.
  FS_RETURN_IF_ERROR(internal::FsyncDir(dir));
  AtomicWriteOptions options;
  options.mode = 0644;
  options.temp_suffix = ".tmp";
  return WriteFileAtomically(FileSystem::Posix(), absl::StrCat(dir, "/", kMetadataFile),
                             MetadataToJson(meta).dump(1), options);
}

// ---- Reading ----

absl::StatusOr<Checkpoint> OpenCheckpoint(const std::string& dir) {
  Checkpoint c;
  c.dir = dir;
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    return absl::NotFoundError(Errno("not a checkpoint directory", dir, errno));
  }
  const std::string meta_path = absl::StrCat(dir, "/", kMetadataFile);
  const int fd = ::open(meta_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) {
      return absl::FailedPreconditionError(
          absl::StrCat(meta_path,
                       ": missing (an incomplete checkpoint: its save did not finish, or this is "
                       "not a checkpoint directory)"));
    }
    return absl::FailedPreconditionError(Errno("open", meta_path, errno));
  }
  Fd f(fd);
  if (::fstat(fd, &st) != 0) return absl::InternalError(Errno("fstat", meta_path, errno));
  if (static_cast<size_t>(st.st_size) > kMaxJsonBytes) {
    return absl::FailedPreconditionError(
        absl::StrCat(meta_path, ": ", st.st_size, " bytes is over the limit of ", kMaxJsonBytes));
  }
  std::string text(st.st_size, '\0');
  FS_RETURN_IF_ERROR(internal::ReadAll(fd, text.data(), text.size(), 0, meta_path));
  absl::StatusOr<Metadata> meta = MetadataFromJson(text, meta_path);
  if (!meta.ok()) return absl::FailedPreconditionError(meta.status().message());
  c.meta = *std::move(meta);
  for (const FileEntry& e : c.meta.files) {
    const std::string path = absl::StrCat(dir, "/", e.name);
    if (::stat(path.c_str(), &st) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": missing (", std::strerror(errno), "); metadata.json lists it"));
    }
    FS_RETURN_IF_ERROR(CheckFileSize(path, st.st_size, e.bytes));
  }
  return c;
}

absl::Status ReadRankFile(const Checkpoint& ckpt, int32_t rank,
                          const std::vector<TensorDestination>& dests, const ProgressFn& progress) {
  const FileEntry& e = ckpt.meta.files.at(rank);
  const std::string path = absl::StrCat(ckpt.dir, "/", e.name);
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) return absl::FailedPreconditionError(Errno("open", path, errno));
  struct stat st;
  if (::fstat(f.fd, &st) != 0) return absl::InternalError(Errno("fstat", path, errno));
  FS_RETURN_IF_ERROR(CheckFileSize(path, st.st_size, e.bytes));
  std::vector<TensorDestination> order = dests;
  std::sort(order.begin(), order.end(),
            [](const auto& a, const auto& b) { return a.entry->offset < b.entry->offset; });
  // Sequential 8 MiB reads (mapping the file instead was slower from a cold page cache:
  // page-fault-driven readahead; measured with checkpoint_benchmark.py --drop-caches).
  constexpr int64_t kChunk = int64_t{8} << 20;
  ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  std::unique_ptr<char[]> scratch;  // for the bytes no destination takes
  uint32_t crc = 0;
  size_t next = 0;  // the first destination not wholly behind `off`
  for (int64_t off = 0; off < e.bytes;) {
    while (next < order.size() && order[next].entry->offset + order[next].entry->bytes <= off) {
      ++next;
    }
    int64_t n = std::min(kChunk, e.bytes - off);
    char* dst;
    if (next < order.size() && order[next].entry->offset <= off) {
      const TensorEntry& t = *order[next].entry;
      n = std::min(n, t.offset + t.bytes - off);
      dst = static_cast<char*>(order[next].data) + (off - t.offset);
    } else {
      if (next < order.size()) n = std::min(n, order[next].entry->offset - off);
      if (scratch == nullptr) scratch.reset(new char[kChunk]);
      dst = scratch.get();
    }
    FS_RETURN_IF_ERROR(internal::ReadAll(f.fd, dst, n, off, path));
    crc = Crc32c(crc, dst, n);
    off += n;
    if (progress) progress(n);
  }
  if (crc != e.crc32c) {
    return absl::DataLossError(absl::StrCat(path, ": CRC-32C ", Hex32(crc), ", the metadata says ",
                                            Hex32(e.crc32c), " (corrupt)"));
  }
  return absl::OkStatus();
}

absl::Status VerifyFiles(const Checkpoint& ckpt, const std::vector<int32_t>& ranks,
                         const ProgressFn& progress, int threads) {
  std::vector<int32_t> todo = ranks;
  if (todo.empty()) {
    for (const FileEntry& e : ckpt.meta.files) todo.push_back(e.rank);
  }
  std::vector<absl::Status> results(todo.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < todo.size(); i = next++) {
      results[i] = ReadRankFile(ckpt, todo[i], {}, progress);
    }
  };
  const int n = std::max(1, std::min<int>(threads, static_cast<int>(todo.size())));
  std::vector<std::thread> pool;
  for (int i = 1; i < n; ++i) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  for (const absl::Status& s : results) FS_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

absl::Status ReadFileRange(const Checkpoint& ckpt, int32_t rank, int64_t offset, int64_t bytes,
                           void* dst) {
  const FileEntry& e = ckpt.meta.files.at(rank);
  const std::string path = absl::StrCat(ckpt.dir, "/", e.name);
  if (offset < 0 || bytes < 0 || offset > e.bytes || bytes > e.bytes - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": bytes [", offset, ", ", offset + bytes, ") lie outside the file"));
  }
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) return absl::FailedPreconditionError(Errno("open", path, errno));
  return internal::ReadAll(f.fd, dst, bytes, offset, path);
}

}  // namespace flatshard::checkpoint
