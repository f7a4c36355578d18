#include "server/durable/record_codec.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/sha256.h"
#include "common/status_macros.h"

namespace flatshard::server::state {
namespace {

using OJson = nlohmann::ordered_json;

OJson RanksJson(const std::vector<int32_t>& ranks) {
  OJson a = OJson::array();
  for (int32_t r : ranks) a.push_back(r);
  return a;
}

absl::StatusOr<std::vector<int32_t>> RankList(const Json& obj, absl::string_view key,
                                              const JsonPath& path) {
  const JsonPath p = path.Key(key);
  if (!obj.contains(std::string(key))) return p.Error("missing");
  const Json& v = obj.at(std::string(key));
  FS_RETURN_IF_ERROR(ExpectArray(v, p));
  std::vector<int32_t> out;
  for (size_t i = 0; i < v.size(); ++i) {
    FS_ASSIGN_OR_RETURN(int64_t r, AsInt(v[i], p.Index(i), 0, INT32_MAX));
    out.push_back(static_cast<int32_t>(r));
  }
  return out;
}

absl::StatusOr<PendingCommit> PendingFrom(const Json& v, const JsonPath& p) {
  FS_RETURN_IF_ERROR(ExpectObject(v, p, {"generation", "kind", "ready_ranks", "done_ranks"}));
  PendingCommit out;
  FS_ASSIGN_OR_RETURN(int64_t g, GetInt(v, "generation", p, 0));
  out.generation = static_cast<uint64_t>(g);
  FS_ASSIGN_OR_RETURN(out.kind, GetString(v, "kind", p));
  if (out.kind != "commit" && out.kind != "end" && out.kind != "init" && out.kind != "load") {
    return p.Key("kind").Error(
        absl::StrCat("must be commit, end, init or load, got ", Quote(out.kind)));
  }
  FS_ASSIGN_OR_RETURN(out.ready_ranks, RankList(v, "ready_ranks", p));
  FS_ASSIGN_OR_RETURN(out.done_ranks, RankList(v, "done_ranks", p));
  return out;
}

absl::StatusOr<std::vector<StateSpec>> StateSpecsFrom(const Json& v, const JsonPath& p) {
  FS_RETURN_IF_ERROR(ExpectArray(v, p));
  std::vector<StateSpec> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const JsonPath q = p.Index(i);
    FS_RETURN_IF_ERROR(ExpectObject(v[i], q, {"name", "dtype", "shape"}));
    StateSpec spec;
    FS_ASSIGN_OR_RETURN(spec.name, GetString(v[i], "name", q));
    FS_ASSIGN_OR_RETURN(std::string dtype, GetString(v[i], "dtype", q));
    std::optional<DType> parsed = ParseDType(dtype);
    if (!parsed.has_value()) {
      return q.Key("dtype").Error(absl::StrCat("unknown dtype ", Quote(dtype)));
    }
    spec.dtype = *parsed;
    FS_ASSIGN_OR_RETURN(std::string shape, GetString(v[i], "shape", q));
    if (shape == StateShapeName(StateShape::kShard)) {
      spec.shape = StateShape::kShard;
    } else if (shape == StateShapeName(StateShape::kScalar)) {
      spec.shape = StateShape::kScalar;
    } else {
      return q.Key("shape").Error(absl::StrCat("must be shard or scalar, got ", Quote(shape)));
    }
    out.push_back(std::move(spec));
  }
  if (!out.empty()) {
    if (absl::Status s = ValidateStateSpecs(out); !s.ok()) return p.Error(s.message());
  }
  return out;
}

absl::Status CheckSegmentName(const std::string& segment, const JsonPath& p) {
  if (segment.size() < 2 || segment[0] != '/' || segment.find('/', 1) != std::string::npos) {
    return p.Error(absl::StrCat("must be a shm name \"/name\", got ", Quote(segment)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<KeptRecord>> KeptFrom(const Json& v, const JsonPath& p) {
  FS_RETURN_IF_ERROR(ExpectArray(v, p));
  std::vector<KeptRecord> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const JsonPath q = p.Index(i);
    FS_RETURN_IF_ERROR(
        ExpectObject(v[i], q, {"owner", "rank", "unit", "use", "kind", "segment", "bytes"}));
    KeptRecord k;
    // KeptOwner, KeptUse and BufferKind (kUnsharded, kStaging) values.
    FS_ASSIGN_OR_RETURN(int64_t owner, GetInt(v[i], "owner", q, 0, 3));
    FS_ASSIGN_OR_RETURN(int64_t rank, GetInt(v[i], "rank", q, -1, INT32_MAX));
    FS_ASSIGN_OR_RETURN(int64_t unit, GetInt(v[i], "unit", q, 0, INT32_MAX));
    FS_ASSIGN_OR_RETURN(int64_t use, GetInt(v[i], "use", q, 0, 4));
    FS_ASSIGN_OR_RETURN(int64_t kind, GetInt(v[i], "kind", q, 2, 3));
    k.owner = static_cast<int32_t>(owner);
    k.rank = static_cast<int32_t>(rank);
    k.unit = static_cast<int32_t>(unit);
    k.use = static_cast<int32_t>(use);
    k.kind = static_cast<int32_t>(kind);
    FS_ASSIGN_OR_RETURN(k.segment, GetString(v[i], "segment", q));
    FS_RETURN_IF_ERROR(CheckSegmentName(k.segment, q.Key("segment")));
    FS_ASSIGN_OR_RETURN(k.bytes, GetInt(v[i], "bytes", q, 0));
    out.push_back(std::move(k));
  }
  return out;
}

absl::StatusOr<std::vector<DeferredRecord>> DeferredFrom(const Json& v, const JsonPath& p) {
  FS_RETURN_IF_ERROR(ExpectArray(v, p));
  std::vector<DeferredRecord> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const JsonPath q = p.Index(i);
    FS_RETURN_IF_ERROR(ExpectObject(v[i], q,
                                    {"rank", "unit", "generation", "segment", "kind",
                                     "segment_bytes", "src_offset", "dst_offset", "bytes"}));
    DeferredRecord d;
    FS_ASSIGN_OR_RETURN(int64_t rank, GetInt(v[i], "rank", q, 0, INT32_MAX));
    FS_ASSIGN_OR_RETURN(int64_t unit, GetInt(v[i], "unit", q, 0, INT32_MAX));
    FS_ASSIGN_OR_RETURN(int64_t generation, GetInt(v[i], "generation", q, 0));
    FS_ASSIGN_OR_RETURN(int64_t kind, GetInt(v[i], "kind", q, 0, 3));  // BufferKind
    d.rank = static_cast<int32_t>(rank);
    d.unit = static_cast<int32_t>(unit);
    d.generation = static_cast<uint64_t>(generation);
    d.kind = static_cast<int32_t>(kind);
    FS_ASSIGN_OR_RETURN(d.segment, GetString(v[i], "segment", q));
    FS_RETURN_IF_ERROR(CheckSegmentName(d.segment, q.Key("segment")));
    FS_ASSIGN_OR_RETURN(d.segment_bytes, GetInt(v[i], "segment_bytes", q, 0));
    FS_ASSIGN_OR_RETURN(d.src_offset, GetInt(v[i], "src_offset", q, 0));
    FS_ASSIGN_OR_RETURN(d.dst_offset, GetInt(v[i], "dst_offset", q, 0));
    FS_ASSIGN_OR_RETURN(d.bytes, GetInt(v[i], "bytes", q, 0));
    if (d.src_offset + d.bytes > d.segment_bytes) {
      return q.Error(absl::StrCat("src_offset ", d.src_offset, " + bytes ", d.bytes,
                                  " is past the segment's ", d.segment_bytes, " bytes"));
    }
    out.push_back(std::move(d));
  }
  return out;
}

absl::StatusOr<ModuleRecord> ModuleFrom(const Json& v, const JsonPath& p) {
  FS_RETURN_IF_ERROR(ExpectObject(v, p,
                                  {"name", "plan", "manifest", "initialized", "pending", "voted",
                                   "ranks", "state_specs", "kept", "deferred"}));
  ModuleRecord m;
  FS_ASSIGN_OR_RETURN(m.name, GetString(v, "name", p));
  FS_ASSIGN_OR_RETURN(m.plan_json, GetString(v, "plan", p));
  FS_ASSIGN_OR_RETURN(m.manifest_json, GetString(v, "manifest", p));
  FS_ASSIGN_OR_RETURN(m.initialized, GetBool(v, "initialized", p));
  if (v.contains("pending") && !v.at("pending").is_null()) {
    FS_ASSIGN_OR_RETURN(m.pending, PendingFrom(v.at("pending"), p.Key("pending")));
  }
  if (v.contains("voted")) {
    FS_ASSIGN_OR_RETURN(int64_t voted, GetInt(v, "voted", p, 0));
    m.voted = static_cast<uint64_t>(voted);
  }
  if (v.contains("state_specs")) {
    FS_ASSIGN_OR_RETURN(m.state_specs, StateSpecsFrom(v.at("state_specs"), p.Key("state_specs")));
  }
  if (v.contains("kept")) {
    FS_ASSIGN_OR_RETURN(m.kept, KeptFrom(v.at("kept"), p.Key("kept")));
  }
  if (v.contains("deferred")) {
    FS_ASSIGN_OR_RETURN(m.deferred, DeferredFrom(v.at("deferred"), p.Key("deferred")));
  }
  const JsonPath rp = p.Key("ranks");
  if (!v.contains("ranks")) return rp.Error("missing");
  const Json& ranks = v.at("ranks");
  FS_RETURN_IF_ERROR(ExpectArray(ranks, rp));
  for (size_t i = 0; i < ranks.size(); ++i) {
    const JsonPath q = rp.Index(i);
    FS_RETURN_IF_ERROR(ExpectObject(ranks[i], q, {"rank", "generation", "units"}));
    RankRecord r;
    FS_ASSIGN_OR_RETURN(int64_t rank, GetInt(ranks[i], "rank", q, 0, INT32_MAX));
    r.rank = static_cast<int32_t>(rank);
    FS_ASSIGN_OR_RETURN(int64_t gen, GetInt(ranks[i], "generation", q, 0));
    r.generation = static_cast<uint64_t>(gen);
    const JsonPath up = q.Key("units");
    if (!ranks[i].contains("units")) return up.Error("missing");
    const Json& units = ranks[i].at("units");
    FS_RETURN_IF_ERROR(ExpectArray(units, up));
    for (size_t j = 0; j < units.size(); ++j) {
      const JsonPath uq = up.Index(j);
      FS_RETURN_IF_ERROR(ExpectObject(units[j], uq, {"unit", "buffers"}));
      UnitRecord u;
      FS_ASSIGN_OR_RETURN(int64_t unit, GetInt(units[j], "unit", uq, 0, INT32_MAX));
      u.unit = static_cast<int32_t>(unit);
      const JsonPath bp = uq.Key("buffers");
      if (!units[j].contains("buffers")) return bp.Error("missing");
      const Json& buffers = units[j].at("buffers");
      FS_RETURN_IF_ERROR(ExpectArray(buffers, bp));
      for (size_t k = 0; k < buffers.size(); ++k) {
        const JsonPath bq = bp.Index(k);
        FS_RETURN_IF_ERROR(ExpectObject(buffers[k], bq, {"role", "segment", "bytes"}));
        BufferRecord b;
        FS_ASSIGN_OR_RETURN(b.role, GetString(buffers[k], "role", bq));
        FS_ASSIGN_OR_RETURN(b.segment, GetString(buffers[k], "segment", bq));
        FS_ASSIGN_OR_RETURN(b.bytes, GetInt(buffers[k], "bytes", bq, 0));
        if (b.role.empty()) return bq.Key("role").Error("must not be empty");
        FS_RETURN_IF_ERROR(CheckSegmentName(b.segment, bq.Key("segment")));
        u.buffers.push_back(std::move(b));
      }
      r.units.push_back(std::move(u));
    }
    m.ranks.push_back(std::move(r));
  }
  return m;
}

absl::Status GroupFieldsFrom(const Json& doc, const JsonPath& p, GroupRecord* r) {
  FS_ASSIGN_OR_RETURN(r->id, GetString(doc, "group", p));
  if (r->id.empty()) return p.Key("group").Error("must not be empty");
  FS_ASSIGN_OR_RETURN(int64_t ws, GetInt(doc, "world_size", p, 1, INT32_MAX));
  r->world_size = static_cast<int32_t>(ws);
  FS_ASSIGN_OR_RETURN(r->token, GetString(doc, "token", p));
  FS_ASSIGN_OR_RETURN(r->owner_uid, GetInt(doc, "owner_uid", p, -1));
  FS_ASSIGN_OR_RETURN(r->coordinator, GetString(doc, "coordinator", p));
  FS_ASSIGN_OR_RETURN(r->local_ranks, RankList(doc, "local_ranks", p));
  FS_ASSIGN_OR_RETURN(int64_t epoch, GetInt(doc, "epoch", p, 0));
  r->epoch = static_cast<uint64_t>(epoch);
  return absl::OkStatus();
}

absl::Status CheckRanksInWorld(const ModuleRecord& m, int32_t world_size, const JsonPath& p) {
  for (const RankRecord& rr : m.ranks) {
    if (rr.rank >= world_size) {
      return p.Key("ranks").Error(
          absl::StrCat("rank ", rr.rank, " is out of range for world_size ", world_size));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModuleRecord> DecodeModuleJson(const Json& v, const JsonPath& path) {
  return ModuleFrom(v, path);
}

absl::Status DecodeGroupFieldsJson(const Json& v, const JsonPath& path, GroupRecord* record) {
  FS_RETURN_IF_ERROR(ExpectObject(
      v, path,
      {"group", "world_size", "token", "owner_uid", "coordinator", "local_ranks", "epoch"}));
  return GroupFieldsFrom(v, path, record);
}

std::string RecordFileName(const std::string& group) {
  return absl::StrCat("group-", Sha256Hex(group).substr(0, 32), ".json");
}

namespace {

OJson ModuleOJson(const ModuleRecord& m) {
  OJson mj;
  mj["name"] = m.name;
  mj["plan"] = m.plan_json;
  mj["manifest"] = m.manifest_json;
  mj["initialized"] = m.initialized;
  if (m.pending.has_value()) {
    OJson pj;
    pj["generation"] = m.pending->generation;
    pj["kind"] = m.pending->kind;
    pj["ready_ranks"] = RanksJson(m.pending->ready_ranks);
    pj["done_ranks"] = RanksJson(m.pending->done_ranks);
    mj["pending"] = std::move(pj);
  } else {
    mj["pending"] = nullptr;
  }
  if (m.voted != 0) mj["voted"] = m.voted;
  OJson ranks = OJson::array();
  for (const RankRecord& r : m.ranks) {
    OJson rj;
    rj["rank"] = r.rank;
    rj["generation"] = r.generation;
    OJson units = OJson::array();
    for (const UnitRecord& u : r.units) {
      OJson uj;
      uj["unit"] = u.unit;
      OJson buffers = OJson::array();
      for (const BufferRecord& b : u.buffers) {
        buffers.push_back(OJson{{"role", b.role}, {"segment", b.segment}, {"bytes", b.bytes}});
      }
      uj["buffers"] = std::move(buffers);
      units.push_back(std::move(uj));
    }
    rj["units"] = std::move(units);
    ranks.push_back(std::move(rj));
  }
  mj["ranks"] = std::move(ranks);
  if (!m.state_specs.empty()) {
    OJson specs = OJson::array();
    for (const StateSpec& spec : m.state_specs) {
      specs.push_back(OJson{{"name", spec.name},
                            {"dtype", std::string(DTypeName(spec.dtype))},
                            {"shape", StateShapeName(spec.shape)}});
    }
    mj["state_specs"] = std::move(specs);
  }
  if (!m.kept.empty()) {
    OJson kept = OJson::array();
    for (const KeptRecord& k : m.kept) {
      kept.push_back(OJson{{"owner", k.owner},
                           {"rank", k.rank},
                           {"unit", k.unit},
                           {"use", k.use},
                           {"kind", k.kind},
                           {"segment", k.segment},
                           {"bytes", k.bytes}});
    }
    mj["kept"] = std::move(kept);
  }
  if (!m.deferred.empty()) {
    OJson deferred = OJson::array();
    for (const DeferredRecord& d : m.deferred) {
      deferred.push_back(OJson{{"rank", d.rank},
                               {"unit", d.unit},
                               {"generation", d.generation},
                               {"segment", d.segment},
                               {"kind", d.kind},
                               {"segment_bytes", d.segment_bytes},
                               {"src_offset", d.src_offset},
                               {"dst_offset", d.dst_offset},
                               {"bytes", d.bytes}});
    }
    mj["deferred"] = std::move(deferred);
  }
  return mj;
}

OJson GroupFieldsOJson(const GroupRecord& record) {
  OJson body;
  body["group"] = record.id;
  body["world_size"] = record.world_size;
  body["token"] = record.token;
  body["owner_uid"] = record.owner_uid;
  body["coordinator"] = record.coordinator;
  body["local_ranks"] = RanksJson(record.local_ranks);
  body["epoch"] = record.epoch;
  return body;
}

}  // namespace

std::string EncodeModuleJson(const ModuleRecord& module) { return ModuleOJson(module).dump(); }

std::string EncodeGroupFieldsJson(const GroupRecord& record) {
  return GroupFieldsOJson(record).dump();
}

std::string EncodeGroupRecord(const GroupRecord& record) {
  OJson body = GroupFieldsOJson(record);
  body["sequence"] = record.sequence;
  OJson modules = OJson::array();
  for (const ModuleRecord& m : record.modules) modules.push_back(ModuleOJson(m));
  body["modules"] = std::move(modules);
  const std::string text = body.dump();
  OJson header;
  header["format"] = kStateFormat;
  header["body_bytes"] = text.size();
  header["body_sha256"] = Sha256Hex(text);
  return absl::StrCat(header.dump(), "\n", text);
}

absl::StatusOr<GroupRecord> DecodeGroupRecord(const std::string& bytes, bool* journaled) {
  const size_t nl = bytes.find('\n');
  if (nl == std::string::npos) {
    return absl::InvalidArgumentError("header: no header line (truncated or not a state record)");
  }
  absl::StatusOr<Json> header = ParseJson(bytes.substr(0, nl), "header");
  if (!header.ok()) return header.status();
  const JsonPath hp("header");
  FS_RETURN_IF_ERROR(ExpectObject(*header, hp, {"format", "body_bytes", "body_sha256"}));
  FS_ASSIGN_OR_RETURN(std::string format, GetString(*header, "format", hp));
  if (format != kStateFormat && format != kStateFormatV3 && format != kStateFormatV2 &&
      format != kStateFormatV1) {
    return absl::InvalidArgumentError(
        absl::StrCat("version: format is ", Quote(format), ", this daemon reads ", kStateFormat,
                     ", ", kStateFormatV3, ", ", kStateFormatV2, " and ", kStateFormatV1));
  }
  if (journaled != nullptr) *journaled = format != kStateFormatV1;
  FS_ASSIGN_OR_RETURN(int64_t body_bytes, GetInt(*header, "body_bytes", hp, 0));
  FS_ASSIGN_OR_RETURN(std::string sha, GetString(*header, "body_sha256", hp));
  const std::string body = bytes.substr(nl + 1);
  if (static_cast<int64_t>(body.size()) != body_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("size: the body has ", body.size(),
                                                   " bytes, the header says ", body_bytes,
                                                   " (truncated or appended to)"));
  }
  const std::string actual = Sha256Hex(body);
  if (actual != sha) {
    return absl::InvalidArgumentError(
        absl::StrCat("checksum: the body's sha256 is ", actual, ", the header says ", Quote(sha)));
  }
  FS_ASSIGN_OR_RETURN(Json doc, ParseJson(body, "body"));
  const JsonPath p("body");
  FS_RETURN_IF_ERROR(ExpectObject(doc, p,
                                  {"group", "world_size", "token", "owner_uid", "coordinator",
                                   "local_ranks", "epoch", "sequence", "modules"}));
  GroupRecord r;
  FS_RETURN_IF_ERROR(GroupFieldsFrom(doc, p, &r));
  FS_ASSIGN_OR_RETURN(int64_t seq, GetInt(doc, "sequence", p, 0));
  r.sequence = static_cast<uint64_t>(seq);
  const JsonPath mp = p.Key("modules");
  if (!doc.contains("modules")) return mp.Error("missing");
  FS_RETURN_IF_ERROR(ExpectArray(doc.at("modules"), mp));
  for (size_t i = 0; i < doc.at("modules").size(); ++i) {
    FS_ASSIGN_OR_RETURN(ModuleRecord m, ModuleFrom(doc.at("modules")[i], mp.Index(i)));
    FS_RETURN_IF_ERROR(CheckRanksInWorld(m, r.world_size, mp.Index(i)));
    r.modules.push_back(std::move(m));
  }
  return r;
}

void CopyGroupFields(const GroupRecord& from, GroupRecord* to) {
  to->id = from.id;
  to->world_size = from.world_size;
  to->token = from.token;
  to->owner_uid = from.owner_uid;
  to->coordinator = from.coordinator;
  to->local_ranks = from.local_ranks;
  to->epoch = from.epoch;
}

const ModuleRecord* FindModule(const std::vector<ModuleRecord>& modules, const std::string& name) {
  for (const ModuleRecord& m : modules) {
    if (m.name == name) return &m;
  }
  return nullptr;
}

void ApplyFrame(const JournalFrame& f, GroupRecord* r) {
  CopyGroupFields(f.group, r);
  auto named = [r](const std::string& name) {
    return std::find_if(r->modules.begin(), r->modules.end(),
                        [&](const ModuleRecord& m) { return m.name == name; });
  };
  for (const std::string& name : f.drops) {
    if (auto at = named(name); at != r->modules.end()) r->modules.erase(at);
  }
  for (const ModuleRecord& m : f.group.modules) {
    if (auto at = named(m.name); at != r->modules.end()) {
      *at = m;
      continue;
    }
    auto at =
        std::lower_bound(r->modules.begin(), r->modules.end(), m.name,
                         [](const ModuleRecord& x, const std::string& n) { return x.name < n; });
    r->modules.insert(at, m);
  }
}

std::vector<std::string> SegmentNamesIn(const std::string& bytes, const std::string& prefix) {
  std::vector<std::string> out;
  const std::string needle = absl::StrCat("\"/", prefix, ".");
  for (size_t at = bytes.find(needle); at != std::string::npos; at = bytes.find(needle, at + 1)) {
    const size_t end = bytes.find('"', at + 1);
    if (end == std::string::npos) break;
    out.push_back(bytes.substr(at + 1, end - at - 1));
  }
  return out;
}

}  // namespace flatshard::server::state
