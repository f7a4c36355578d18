#include "server/durable/journal.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/sha256.h"
#include "common/status_macros.h"

namespace flatshard::server::state {
namespace {

using OJson = nlohmann::ordered_json;

// A frame whose checksum holds but whose body is not a frame of this group: a bug or an
// edit, never a torn write.
absl::StatusOr<JournalFrame> DecodeBody(const std::string& body, const GroupRecord& base,
                                        const std::string& where) {
  FS_ASSIGN_OR_RETURN(Json doc, ParseJson(body, where));
  const JsonPath p(where);
  FS_RETURN_IF_ERROR(ExpectObject(doc, p, {"group", "upsert", "drop"}));
  JournalFrame f;
  if (!doc.contains("group")) return p.Key("group").Error("missing");
  FS_RETURN_IF_ERROR(DecodeGroupFieldsJson(doc.at("group"), p.Key("group"), &f.group));
  if (f.group.id != base.id) {
    return p.Key("group").Key("group").Error(
        absl::StrCat("names group ", Quote(f.group.id), ", the record is of ", Quote(base.id)));
  }
  const JsonPath up = p.Key("upsert");
  if (!doc.contains("upsert")) return up.Error("missing");
  FS_RETURN_IF_ERROR(ExpectArray(doc.at("upsert"), up));
  for (size_t i = 0; i < doc.at("upsert").size(); ++i) {
    FS_ASSIGN_OR_RETURN(ModuleRecord m, DecodeModuleJson(doc.at("upsert")[i], up.Index(i)));
    for (const RankRecord& rr : m.ranks) {
      if (rr.rank >= f.group.world_size) {
        return up.Index(i).Key("ranks").Error(
            absl::StrCat("rank ", rr.rank, " is out of range for world_size ", f.group.world_size));
      }
    }
    f.group.modules.push_back(std::move(m));
  }
  const JsonPath dp = p.Key("drop");
  if (!doc.contains("drop")) return dp.Error("missing");
  FS_RETURN_IF_ERROR(ExpectArray(doc.at("drop"), dp));
  for (size_t i = 0; i < doc.at("drop").size(); ++i) {
    if (!doc.at("drop")[i].is_string()) return dp.Index(i).Error("must be a module name");
    f.drops.push_back(doc.at("drop")[i].get<std::string>());
  }
  return f;
}

}  // namespace

std::string JournalFileName(const std::string& group) {
  std::string name = RecordFileName(group);
  return absl::StrCat(name.substr(0, name.size() - 5), ".journal");  // ".json" -> ".journal"
}

std::string EncodeJournalFrame(const JournalFrame& frame) {
  std::string body =
      absl::StrCat("{\"group\":", EncodeGroupFieldsJson(frame.group), ",\"upsert\":[");
  for (size_t i = 0; i < frame.group.modules.size(); ++i) {
    if (i > 0) body += ',';
    body += EncodeModuleJson(frame.group.modules[i]);
  }
  body += "],\"drop\":";
  body += OJson(frame.drops).dump();
  body += '}';
  OJson header;
  header["journal"] = kJournalFormat;
  header["base"] = frame.base;
  header["sequence"] = frame.sequence;
  header["body_bytes"] = body.size();
  header["body_sha256"] = Sha256Hex(body);
  return absl::StrCat(header.dump(), "\n", body, "\n");
}

absl::StatusOr<Replayed> ReplayJournal(GroupRecord base, const std::string& bytes) {
  Replayed out;
  const uint64_t base_sequence = base.sequence;
  out.record = std::move(base);
  size_t at = 0;
  for (int n = 0; at < bytes.size(); ++n) {
    const std::string where = absl::StrCat("frame ", n, " at byte ", at);
    auto torn = [&](absl::string_view why) { out.torn = absl::StrCat(where, ": ", why); };
    const size_t nl = bytes.find('\n', at);
    if (nl == std::string::npos) {
      torn("header: no end of line");
      break;
    }
    absl::StatusOr<Json> header = ParseJson(absl::string_view(bytes).substr(at, nl - at), where);
    const JsonPath hp(where);
    if (!header.ok() ||
        !ExpectObject(*header, hp, {"journal", "base", "sequence", "body_bytes", "body_sha256"})
             .ok()) {
      torn("header: not a frame header");
      break;
    }
    absl::StatusOr<std::string> format = GetString(*header, "journal", hp);
    absl::StatusOr<int64_t> frame_base = GetInt(*header, "base", hp, 0);
    absl::StatusOr<int64_t> sequence = GetInt(*header, "sequence", hp, 0);
    absl::StatusOr<int64_t> body_bytes = GetInt(*header, "body_bytes", hp, 0);
    absl::StatusOr<std::string> sha = GetString(*header, "body_sha256", hp);
    if (!format.ok() || !frame_base.ok() || !sequence.ok() || !body_bytes.ok() || !sha.ok()) {
      torn("header: not a frame header");
      break;
    }
    if (*format != kJournalFormat) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": version: format is ", Quote(*format),
                                                     ", this daemon reads ", kJournalFormat));
    }
    const size_t body_at = nl + 1;
    if (bytes.size() - body_at < static_cast<size_t>(*body_bytes) + 1) {
      torn(absl::StrCat("size: the header says ", *body_bytes, " body bytes, ",
                        bytes.size() - body_at, " follow"));
      break;
    }
    const std::string body = bytes.substr(body_at, static_cast<size_t>(*body_bytes));
    if (Sha256Hex(body) != *sha || bytes[body_at + body.size()] != '\n') {
      torn("checksum: the body does not match its header");
      break;
    }
    at = body_at + body.size() + 1;
    if (static_cast<uint64_t>(*frame_base) != base_sequence) {
      ++out.stale;  // written on a base that was rewritten since
      continue;
    }
    FS_ASSIGN_OR_RETURN(JournalFrame f, DecodeBody(body, out.record, where));
    f.base = static_cast<uint64_t>(*frame_base);
    f.sequence = static_cast<uint64_t>(*sequence);
    ApplyFrame(f, &out.record);
    ++out.applied;
    out.max_sequence = std::max(out.max_sequence, f.sequence);
  }
  if (out.applied > 0) out.record.sequence = std::max(base_sequence, out.max_sequence);
  return out;
}

}  // namespace flatshard::server::state

namespace flatshard::server::state {

absl::StatusOr<GroupRecord> ReadGroupRecord(FileSystem* fs, const std::string& dir,
                                            const std::string& group) {
  const std::string file = absl::StrCat(dir, "/", RecordFileName(group));
  absl::StatusOr<std::string> bytes = fs->ReadFile(file);
  if (!bytes.ok()) return bytes.status();
  bool journaled = false;
  absl::StatusOr<GroupRecord> base = DecodeGroupRecord(*bytes, &journaled);
  if (!base.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", base.status().message()));
  }
  const std::string journal_file = absl::StrCat(dir, "/", JournalFileName(group));
  absl::StatusOr<std::string> journal =
      journaled ? fs->ReadFile(journal_file) : absl::NotFoundError("a /1 base");
  if (!journal.ok() && !absl::IsNotFound(journal.status())) return journal.status();
  absl::StatusOr<Replayed> replayed =
      ReplayJournal(*std::move(base), journal.ok() ? *journal : std::string());
  if (!replayed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(journal_file, ": ", replayed.status().message()));
  }
  return std::move(replayed->record);
}

}  // namespace flatshard::server::state
