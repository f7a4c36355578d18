#include "server/durable/state_dir.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <signal.h>
#include <sys/mman.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/json_util.h"
#include "common/logging.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "server/durable/journal.h"

namespace flatshard::server::state {
namespace {

using OJson = nlohmann::ordered_json;

std::string Errno(int err) { return std::strerror(err); }

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

absl::StatusOr<std::unique_ptr<StateDir>> StateDir::Open(const std::string& path, bool sync,
                                                         FileSystem* fs) {
  if (absl::Status s = fs->CreateDirs(path, 0700); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--state_dir ", path,
        ": cannot make it a 0700 directory (records hold group tokens): ", s.message()));
  }
  // Temp files of a writer killed mid-write: never a record.
  absl::StatusOr<std::vector<std::string>> names = fs->ListDir(path);
  if (!names.ok()) FS_LOG(WARNING) << "state dir " << path << ": " << names.status().message();
  const std::vector<std::string> all = names.ok() ? *names : std::vector<std::string>();
  for (const std::string& name : all) {
    // A journal whose base is gone (its group was removed mid-way): never read.
    if (absl::StartsWith(name, "group-") && absl::EndsWith(name, ".journal")) {
      const std::string base = absl::StrCat(name.substr(0, name.size() - 8), ".json");
      if (std::find(all.begin(), all.end(), base) == all.end()) {
        fs->RemoveFile(absl::StrCat(path, "/", name)).IgnoreError();
        FS_LOG(INFO) << "state dir " << path << ": removed " << name << " (its record is gone)";
      }
      continue;
    }
    if (!absl::StartsWith(name, kTempFilePrefix)) continue;
    if (absl::Status s = fs->RemoveFile(absl::StrCat(path, "/", name)); s.ok()) {
      FS_LOG(INFO) << "state dir " << path << ": removed " << name << " (an unfinished write)";
    } else {
      FS_LOG(WARNING) << "state dir " << path << ": " << s.message();
    }
  }
  return std::unique_ptr<StateDir>(new StateDir(path, sync, fs));
}

std::shared_ptr<StateDir::PerGroup> StateDir::GroupState(const std::string& group) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<PerGroup>& slot = groups_[group];
  if (!slot) slot = std::make_shared<PerGroup>();
  return slot;
}

namespace {

void CopyFields(const GroupRecord& from, GroupRecord* to) {
  to->id = from.id;
  to->world_size = from.world_size;
  to->token = from.token;
  to->owner_uid = from.owner_uid;
  to->coordinator = from.coordinator;
  to->local_ranks = from.local_ranks;
  to->epoch = from.epoch;
}

const ModuleRecord* Named(const std::vector<ModuleRecord>& v, const std::string& name) {
  for (const ModuleRecord& m : v) {
    if (m.name == name) return &m;
  }
  return nullptr;
}

}  // namespace

void ApplyFrame(const JournalFrame& f, GroupRecord* r) {
  CopyFields(f.group, r);
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

namespace {}  // namespace

absl::Status StateDir::Write(const GroupRecord& record) {
  std::shared_ptr<PerGroup> g = GroupState(record.id);
  absl::MutexLock lock(&g->mu);
  const uint64_t seq = record.sequence;
  if (seq <= g->removed && g->removed != 0) return absl::OkStatus();
  GroupRecord merged;
  if (g->current.has_value()) merged = *g->current;
  bool changed = false;
  if (seq > g->fields || !g->current.has_value()) {
    CopyFields(record, &merged);
    changed = true;
  }
  // The record's modules in its order, then the ones only the disk has; each part from the
  // newer of the two.
  auto newest = [&](const std::string& name) {
    auto it = g->modules.find(name);
    return std::max(g->whole, it == g->modules.end() ? 0 : it->second);
  };
  std::vector<ModuleRecord> modules;
  std::vector<std::string> applied;
  std::set<std::string> seen;
  for (const ModuleRecord& m : record.modules) {
    seen.insert(m.name);
    const uint64_t n = newest(m.name);
    if (seq > n || n == 0) {
      modules.push_back(m);
      applied.push_back(m.name);
      changed = true;
    } else if (const ModuleRecord* kept = Named(merged.modules, m.name)) {
      modules.push_back(*kept);  // a newer write of this module is on disk
    }
  }
  for (const ModuleRecord& m : merged.modules) {
    if (seen.contains(m.name)) continue;
    const uint64_t n = newest(m.name);
    if (seq > n || n == 0) {
      applied.push_back(m.name);  // dropped: the record no longer lists it
      changed = true;
    } else {
      modules.push_back(m);
    }
  }
  merged.modules = std::move(modules);
  if (!changed) return absl::OkStatus();
  merged.sequence = std::max(seq, g->last);
  if (merged.modules.empty()) {
    if (g->current.has_value()) FS_RETURN_IF_ERROR(RemoveFiles(*g, record.id));
  } else {
    FS_RETURN_IF_ERROR(RewriteBase(*g, std::move(merged)));
  }
  g->last = std::max(g->last, seq);
  g->whole = std::max(g->whole, seq);
  g->fields = std::max(g->fields, seq);
  for (const std::string& name : applied) g->modules[name] = seq;
  return absl::OkStatus();
}

absl::Status StateDir::WriteModules(const GroupRecord& record,
                                    const std::vector<std::string>& touched, bool sync) {
  std::shared_ptr<PerGroup> g = GroupState(record.id);
  absl::MutexLock lock(&g->mu);
  const uint64_t seq = record.sequence;
  if (seq <= g->removed && g->removed != 0) return absl::OkStatus();
  // O(what changed): the frame and the edit of `current` name the touched modules only.
  const bool fields = seq > g->fields || !g->current.has_value();
  JournalFrame frame;
  CopyFields(fields || !g->current.has_value() ? record : *g->current, &frame.group);
  std::vector<std::string> applied;
  int64_t modules = g->current.has_value() ? static_cast<int64_t>(g->current->modules.size()) : 0;
  for (const std::string& name : touched) {
    auto it = g->modules.find(name);
    const uint64_t newest = std::max(g->whole, it == g->modules.end() ? 0 : it->second);
    if (seq <= newest && newest != 0) continue;
    const ModuleRecord* m = Named(record.modules, name);
    const bool on_disk = g->current.has_value() && Named(g->current->modules, name) != nullptr;
    if (m == nullptr && !on_disk) continue;  // nothing to drop
    if (m != nullptr) {
      frame.group.modules.push_back(*m);
      modules += on_disk ? 0 : 1;
    } else {
      frame.drops.push_back(name);
      --modules;
    }
    applied.push_back(name);
  }
  if (applied.empty()) return absl::OkStatus();  // the fields alone go with the next write
  frame.sequence = std::max(seq, g->last);
  if (modules <= 0) {
    FS_RETURN_IF_ERROR(RemoveFiles(*g, record.id));  // its last module dropped
  } else {
    FS_RETURN_IF_ERROR(Append(*g, std::move(frame), sync));
  }
  g->last = std::max(g->last, seq);
  if (fields) g->fields = seq;
  for (const std::string& name : applied) g->modules[name] = seq;
  return absl::OkStatus();
}

absl::Status StateDir::Append(PerGroup& g, JournalFrame frame, bool sync) {
  const bool compact = g.journal_bytes > std::max<int64_t>(min_compact_bytes_.load(), g.base_bytes);
  if (!g.current.has_value() || !g.journal_clean || g.journal == nullptr || compact) {
    GroupRecord merged = g.current.value_or(GroupRecord());
    ApplyFrame(frame, &merged);
    merged.sequence = std::max(merged.sequence, frame.sequence);
    return RewriteBase(g, std::move(merged));
  }
  frame.base = g.base;
  const std::string bytes = EncodeJournalFrame(frame);
  absl::Status s = g.journal->Append(bytes);
  if (s.ok() && sync_ && sync) s = g.journal->Sync();
  if (!s.ok()) {
    // The frame may be on disk in part: the next write starts a new base instead.
    g.journal_clean = false;
    return absl::Status(s.code(), absl::StrCat("state journal ", s.message()));
  }
  g.journal_bytes += static_cast<int64_t>(bytes.size());
  ApplyFrame(frame, &*g.current);
  g.current->sequence = std::max(g.current->sequence, frame.sequence);
  return absl::OkStatus();
}

absl::Status StateDir::RewriteBase(PerGroup& g, GroupRecord merged) {
  // A sequence of its own: the frames of the journal it replaces (naming the old base) are
  // stale from the moment it is in place, even if truncating that journal does not last.
  merged.sequence = std::max(merged.sequence, g.base + 1);
  const std::string bytes = EncodeGroupRecord(merged);
  AtomicWriteOptions options;
  options.sync = sync_;
  options.mode = 0600;
  if (absl::Status s = WriteFileAtomically(fs_, absl::StrCat(path_, "/", RecordFileName(merged.id)),
                                           bytes, options);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("state record ", s.message()));
  }
  g.base = merged.sequence;
  g.base_bytes = static_cast<int64_t>(bytes.size());
  g.current = std::move(merged);
  // A new journal for the new base. If it cannot be made, the base holds everything and the
  // next write rewrites the base again.
  const std::string journal = absl::StrCat(path_, "/", JournalFileName(g.current->id));
  const bool existed = fs_->FileExists(journal);
  g.journal.reset();
  g.journal_clean = false;
  g.journal_bytes = 0;
  NewFileOptions file_options;
  file_options.mode = 0600;
  absl::StatusOr<std::unique_ptr<WritableFile>> f = fs_->NewWritableFile(journal, file_options);
  if (!f.ok()) {
    FS_LOG(WARNING) << "state journal " << journal << ": " << f.status().message()
                    << " (the record is written whole until it can be made)";
    return absl::OkStatus();
  }
  // Its directory entry lasts before a frame relies on it (once: later bases truncate it).
  if (!existed && sync_) {
    if (absl::Status s = fs_->SyncDir(path_); !s.ok()) {
      FS_LOG(WARNING) << "state journal " << journal << ": " << s.message();
      return absl::OkStatus();
    }
  }
  g.journal = *std::move(f);
  g.journal_clean = true;
  return absl::OkStatus();
}

absl::Status StateDir::RemoveFiles(PerGroup& g, const std::string& group) {
  // The base first: a journal without its base is never read (Open removes it).
  const std::string file = absl::StrCat(path_, "/", RecordFileName(group));
  if (absl::Status s = fs_->RemoveFile(file); !s.ok() && !absl::IsNotFound(s)) {
    return absl::Status(s.code(), absl::StrCat("state record ", file, ": ", s.message()));
  }
  g.journal.reset();
  g.journal_clean = false;
  g.journal_bytes = 0;
  g.current.reset();
  const std::string journal = absl::StrCat(path_, "/", JournalFileName(group));
  if (absl::Status s = fs_->RemoveFile(journal); !s.ok() && !absl::IsNotFound(s)) {
    FS_LOG(WARNING) << "state journal " << journal << ": " << s.message();
  }
  // Best effort: a removal the disk forgets only brings back a record the next daemon adopts
  // or refuses, never a torn one.
  if (sync_) fs_->SyncDir(path_).IgnoreError();
  return absl::OkStatus();
}

absl::Status StateDir::Remove(const std::string& group, uint64_t sequence) {
  std::shared_ptr<PerGroup> g = GroupState(group);
  absl::MutexLock lock(&g->mu);
  if (sequence <= g->last && g->last != 0) return absl::OkStatus();
  FS_RETURN_IF_ERROR(RemoveFiles(*g, group));
  g->last = sequence;
  g->removed = sequence;
  return absl::OkStatus();
}

StateDir::Loaded StateDir::LoadAll() {
  Loaded out;
  std::vector<std::string> files;
  // A directory that cannot be listed has no records to adopt (Open made it).
  absl::StatusOr<std::vector<std::string>> names = fs_->ListDir(path_);
  for (const std::string& name : names.ok() ? *names : std::vector<std::string>()) {
    if (absl::StartsWith(name, "group-") && absl::EndsWith(name, ".json")) {
      files.push_back(absl::StrCat(path_, "/", name));
    }
  }
  std::sort(files.begin(), files.end());
  for (const std::string& file : files) {
    absl::StatusOr<std::string> bytes = fs_->ReadFile(file);
    if (!bytes.ok()) {
      out.refused.push_back({file, absl::StrCat("read: ", bytes.status().message())});
      continue;
    }
    bool journaled = false;
    absl::StatusOr<GroupRecord> record = DecodeGroupRecord(*bytes, &journaled);
    if (!record.ok()) {
      out.refused.push_back({file, std::string(record.status().message())});
      continue;
    }
    const std::string expected = RecordFileName(record->id);
    if (file.substr(file.find_last_of('/') + 1) != expected) {
      out.refused.push_back({file, absl::StrCat("name: the record of group ", Quote(record->id),
                                                " belongs in ", expected)});
      continue;
    }
    const uint64_t base = record->sequence;
    const std::string journal_file = absl::StrCat(path_, "/", JournalFileName(record->id));
    // A /1 base was written whole: a journal beside it predates it (never applied).
    absl::StatusOr<std::string> journal =
        journaled ? fs_->ReadFile(journal_file) : absl::NotFoundError("a /1 base");
    if (!journal.ok() && !absl::IsNotFound(journal.status())) {
      out.refused.push_back({file, absl::StrCat("read: ", journal.status().message())});
      continue;
    }
    absl::StatusOr<Replayed> replayed =
        ReplayJournal(*std::move(record), journal.ok() ? *journal : std::string());
    if (!replayed.ok()) {
      out.refused.push_back(
          {file, absl::StrCat("journal ", journal_file, ": ", replayed.status().message())});
      continue;
    }
    if (!replayed->torn.empty()) {
      FS_LOG(WARNING) << "state journal " << journal_file << ": " << replayed->applied
                      << " frame(s) applied; the rest is ignored (a write torn by a kill): "
                      << replayed->torn;
    }
    // The next write of the group appends to this journal only when it ends cleanly.
    std::shared_ptr<PerGroup> g = GroupState(replayed->record.id);
    {
      absl::MutexLock lock(&g->mu);
      g->current = replayed->record;
      g->base = base;
      g->base_bytes = static_cast<int64_t>(bytes->size());
      g->journal_bytes = journal.ok() ? static_cast<int64_t>(journal->size()) : 0;
      g->journal_clean = false;
      if (replayed->torn.empty() && replayed->stale == 0 && journal.ok()) {
        NewFileOptions append;
        append.append = true;
        absl::StatusOr<std::unique_ptr<WritableFile>> f =
            fs_->NewWritableFile(journal_file, append);
        if (f.ok()) {
          g->journal = *std::move(f);
          g->journal_clean = true;
        }
      }
    }
    max_loaded_sequence_ = std::max(max_loaded_sequence_, replayed->record.sequence);
    out.groups.push_back(std::move(replayed->record));
  }
  return out;
}

std::vector<std::string> StateDir::SegmentsNamedBy(const Loaded& loaded,
                                                   const std::string& prefix) {
  std::vector<std::string> keep;
  for (const Refused& r : loaded.refused) {
    absl::StatusOr<std::string> bytes = fs_->ReadFile(r.file);
    std::vector<std::string> names =
        bytes.ok() ? SegmentNamesIn(*bytes, prefix) : std::vector<std::string>();
    // Its journal's too (the file is "group-<hex>.json", the journal "group-<hex>.journal").
    if (absl::EndsWith(r.file, ".json")) {
      absl::StatusOr<std::string> journal =
          fs_->ReadFile(absl::StrCat(r.file.substr(0, r.file.size() - 5), ".journal"));
      if (journal.ok()) {
        for (std::string& n : SegmentNamesIn(*journal, prefix)) {
          if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
        }
      }
    }
    FS_LOG(ERROR) << "state record " << r.file << " refused: " << r.why
                  << "; its group is not adopted and its " << names.size()
                  << " segment(s) are left alone"
                  << (names.empty() ? "" : absl::StrCat(" (", absl::StrJoin(names, ", "), ")"));
    keep.insert(keep.end(), names.begin(), names.end());
  }
  for (const GroupRecord& g : loaded.groups) {
    for (const ModuleRecord& m : g.modules) {
      for (const RankRecord& r : m.ranks) {
        for (const UnitRecord& u : r.units) {
          for (const BufferRecord& b : u.buffers) keep.push_back(b.segment);
        }
      }
      for (const KeptRecord& k : m.kept) keep.push_back(k.segment);
      for (const DeferredRecord& d : m.deferred) keep.push_back(d.segment);
    }
  }
  FS_LOG(INFO) << "state dir " << path_ << ": " << loaded.groups.size() << " group record(s), "
               << loaded.refused.size() << " refused";
  return keep;
}

}  // namespace flatshard::server::state

namespace flatshard::server::state {

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

absl::Status UnlinkUnreferencedSegments(const std::string& prefix,
                                        const std::vector<std::string>& keep) {
  const std::set<std::string> kept(keep.begin(), keep.end());
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("opendir /dev/shm: ", Errno(errno)));
  }
  const std::string start = absl::StrCat(prefix, ".");
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (!absl::StartsWith(name, start)) continue;
    const std::string rest = name.substr(start.size());
    const size_t dot = rest.find('.');
    if (dot == std::string::npos || dot == 0) continue;
    int64_t pid = 0;
    if (!absl::SimpleAtoi(rest.substr(0, dot), &pid) || pid <= 0 ||
        pid > std::numeric_limits<pid_t>::max()) {
      continue;  // only "<pid>.<counter>" is ours; anything else merely shares the prefix
    }
    if (pid != ::getpid() && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM)) {
      continue;  // another live process's (a second daemon, a parallel test)
    }
    names.push_back(name);
  }
  ::closedir(dir);
  int removed = 0;
  for (const std::string& name : names) {
    if (kept.contains("/" + name)) continue;
    struct stat st = {};
    const std::string path = "/dev/shm/" + name;
    const int64_t bytes = ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
    if (::shm_unlink(("/" + name).c_str()) == 0) {
      ++removed;
      FS_LOG(INFO) << "removed segment /" << name << " (" << bytes
                   << " bytes): no state record references it";
    } else if (errno != ENOENT) {
      FS_LOG(WARNING) << "cannot remove segment /" << name << ": " << Errno(errno);
    }
  }
  FS_LOG(INFO) << "segments with prefix " << prefix << ": removed " << removed << " unreferenced, "
               << kept.size() << " referenced by state records";
  return absl::OkStatus();
}

}  // namespace flatshard::server::state
