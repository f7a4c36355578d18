#include "server/durable/state_dir.h"

#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/durable/journal.h"

namespace flatshard::server::state {
namespace {

std::string Errno(int err) { return std::strerror(err); }

}  // namespace

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

absl::Status StateDir::Write(const GroupRecord& record) {
  std::shared_ptr<PerGroup> g = GroupState(record.id);
  absl::MutexLock lock(&g->mu);
  const uint64_t seq = record.sequence;
  if (seq <= g->removed && g->removed != 0) return absl::OkStatus();
  GroupRecord merged;
  if (g->current.has_value()) merged = *g->current;
  bool changed = false;
  if (seq > g->fields || !g->current.has_value()) {
    CopyGroupFields(record, &merged);
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
    } else if (const ModuleRecord* kept = FindModule(merged.modules, m.name)) {
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
  CopyGroupFields(fields || !g->current.has_value() ? record : *g->current, &frame.group);
  std::vector<std::string> applied;
  int64_t modules = g->current.has_value() ? static_cast<int64_t>(g->current->modules.size()) : 0;
  for (const std::string& name : touched) {
    auto it = g->modules.find(name);
    const uint64_t newest = std::max(g->whole, it == g->modules.end() ? 0 : it->second);
    if (seq <= newest && newest != 0) continue;
    const ModuleRecord* m = FindModule(record.modules, name);
    const bool on_disk = g->current.has_value() && FindModule(g->current->modules, name) != nullptr;
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
