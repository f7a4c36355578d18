#include "common/in_memory_file_system.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace flatshard {
namespace {

constexpr uint32_t kUmask = 022;

// Errors worded as the POSIX implementation's, so callers' messages read the same in tests.
absl::Status Missing(absl::string_view call, const std::string& path) {
  return absl::InternalError(absl::StrCat(call, " ", path, ": No such file or directory"));
}

}  // namespace

// Like a file descriptor: keeps writing to its node after a rename or a remove.
class InMemoryFileSystem::File final : public WritableFile {
 public:
  File(InMemoryFileSystem* fs, std::string path, std::shared_ptr<Node> node)
      : fs_(fs), path_(std::move(path)), node_(std::move(node)) {}

  absl::Status Append(absl::string_view data) override {
    absl::MutexLock lock(&fs_->mu_);
    if (absl::Status s = fs_->Check(Op::kAppend); !s.ok()) return Named("write", s);
    node_->data.append(data.data(), data.size());
    return absl::OkStatus();
  }
  absl::Status Sync() override {
    absl::MutexLock lock(&fs_->mu_);
    if (absl::Status s = fs_->Check(Op::kSync); !s.ok()) return Named("fsync", s);
    node_->synced = node_->data;
    return absl::OkStatus();
  }
  absl::Status Close() override {
    absl::MutexLock lock(&fs_->mu_);
    if (absl::Status s = fs_->Check(Op::kClose); !s.ok()) return Named("close", s);
    return absl::OkStatus();
  }

 private:
  absl::Status Named(absl::string_view call, const absl::Status& s) const {
    return absl::Status(s.code(), absl::StrCat(call, " ", path_, ": ", s.message()));
  }
  InMemoryFileSystem* const fs_;
  const std::string path_;
  const std::shared_ptr<Node> node_;
};

InMemoryFileSystem::InMemoryFileSystem() { dirs_["/"] = 0755; }
InMemoryFileSystem::~InMemoryFileSystem() = default;

absl::Status InMemoryFileSystem::Check(Op op) {
  ++calls_[op];
  if (killed_) return absl::AbortedError("the process was killed (InMemoryFileSystem::KillAt)");
  for (auto it = faults_.begin(); it != faults_.end(); ++it) {
    if (it->op != op) continue;
    if (it->skip-- > 0) continue;
    const absl::Status status = it->status;
    faults_.erase(it);
    if (status.ok()) {
      killed_ = true;
      return absl::AbortedError("the process was killed (InMemoryFileSystem::KillAt)");
    }
    return status;
  }
  return absl::OkStatus();
}

bool InMemoryFileSystem::IsDir(const std::string& path) const { return dirs_.contains(path); }

absl::StatusOr<std::unique_ptr<WritableFile>> InMemoryFileSystem::NewWritableFile(
    const std::string& path, const NewFileOptions& options) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Check(Op::kCreate); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("open ", path, ": ", s.message()));
  }
  if (!IsDir(DirName(path))) return Missing("open", path);
  if (IsDir(path)) return absl::InternalError(absl::StrCat("open ", path, ": Is a directory"));
  std::shared_ptr<Node>& node = files_[path];
  if (node != nullptr) {
    if (options.append) return std::make_unique<File>(this, path, node);
    if (options.exclusive) return absl::InternalError(absl::StrCat("open ", path, ": File exists"));
    node->data.clear();  // O_TRUNC; the mode stays
  } else {
    node = std::make_shared<Node>();
    node->mode = options.mode & ~kUmask;
  }
  return std::make_unique<File>(this, path, node);
}

absl::StatusOr<std::string> InMemoryFileSystem::ReadFile(const std::string& path) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Check(Op::kRead); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("read ", path, ": ", s.message()));
  }
  auto it = files_.find(path);
  if (it == files_.end()) {
    return absl::NotFoundError(absl::StrCat("open ", path, ": No such file or directory"));
  }
  return it->second->data;
}

absl::StatusOr<std::vector<std::string>> InMemoryFileSystem::ListDir(const std::string& dir) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Check(Op::kList); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("opendir ", dir, ": ", s.message()));
  }
  if (!IsDir(dir)) {
    return absl::NotFoundError(absl::StrCat("opendir ", dir, ": No such file or directory"));
  }
  std::vector<std::string> names;
  const size_t skip = dir == "/" ? 1 : dir.size() + 1;
  for (const auto& [path, node] : files_) {
    if (DirName(path) == dir) names.push_back(path.substr(skip));
  }
  for (const auto& [path, mode] : dirs_) {
    if (path != "/" && DirName(path) == dir) names.push_back(path.substr(skip));
  }
  return names;
}

bool InMemoryFileSystem::FileExists(const std::string& path) {
  absl::MutexLock lock(&mu_);
  return files_.contains(path) || IsDir(path);
}

absl::Status InMemoryFileSystem::RemoveFile(const std::string& path) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Check(Op::kRemove); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("unlink ", path, ": ", s.message()));
  }
  if (files_.erase(path) == 0) {
    return absl::NotFoundError(absl::StrCat("unlink ", path, ": No such file or directory"));
  }
  return absl::OkStatus();
}

absl::Status InMemoryFileSystem::RenameFile(const std::string& from, const std::string& to) {
  absl::MutexLock lock(&mu_);
  const std::string what = absl::StrCat(from, " to ", to);
  if (absl::Status s = Check(Op::kRename); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("rename ", what, ": ", s.message()));
  }
  auto it = files_.find(from);
  if (it == files_.end() || !IsDir(DirName(to))) return Missing("rename", what);
  std::shared_ptr<Node> node = it->second;
  files_.erase(it);
  files_[to] = std::move(node);
  return absl::OkStatus();
}

absl::Status InMemoryFileSystem::SyncDir(const std::string& dir) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Check(Op::kSyncDir); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("fsync directory ", dir, ": ", s.message()));
  }
  if (!IsDir(dir)) return Missing("open directory", dir);
  std::erase_if(durable_, [&](const auto& entry) { return DirName(entry.first) == dir; });
  for (const auto& [path, node] : files_) {
    if (DirName(path) == dir) durable_[path] = node;
  }
  return absl::OkStatus();
}

absl::Status InMemoryFileSystem::CreateDirs(const std::string& dir, uint32_t mode) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Check(Op::kCreateDirs); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("mkdir ", dir, ": ", s.message()));
  }
  if (dir.empty() || dir[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat("mkdir ", dir, ": not an absolute path"));
  }
  for (size_t pos = 0; pos != std::string::npos;) {
    pos = dir.find('/', pos + 1);
    const std::string prefix = dir.substr(0, pos);
    if (files_.contains(prefix)) {
      if (pos == std::string::npos) {
        return absl::FailedPreconditionError(absl::StrCat(dir, ": not a directory"));
      }
      return absl::InternalError(absl::StrCat("mkdir ", dir, ": Not a directory"));
    }
    dirs_.try_emplace(prefix, 0777 & ~kUmask);
  }
  dirs_[dir] = mode;
  return absl::OkStatus();
}

void InMemoryFileSystem::FailNext(Op op, absl::Status status, int skip) {
  FS_CHECK(!status.ok()) << "FailNext needs an error";
  absl::MutexLock lock(&mu_);
  faults_.push_back({op, skip, std::move(status)});
}

void InMemoryFileSystem::KillAt(Op op, int skip) {
  absl::MutexLock lock(&mu_);
  faults_.push_back({op, skip, absl::OkStatus()});
}

void InMemoryFileSystem::Restart() {
  absl::MutexLock lock(&mu_);
  killed_ = false;
  faults_.clear();
}

void InMemoryFileSystem::PowerLoss() {
  absl::MutexLock lock(&mu_);
  files_ = durable_;
  for (auto& [path, node] : files_) node->data = node->synced;
  killed_ = false;
  faults_.clear();
}

std::vector<std::string> InMemoryFileSystem::Files() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const auto& [path, node] : files_) out.push_back(path);
  return out;
}

int InMemoryFileSystem::Mode(const std::string& path) const {
  absl::MutexLock lock(&mu_);
  if (auto it = files_.find(path); it != files_.end()) return static_cast<int>(it->second->mode);
  if (auto it = dirs_.find(path); it != dirs_.end()) return static_cast<int>(it->second);
  return -1;
}

int InMemoryFileSystem::Calls(Op op) const {
  absl::MutexLock lock(&mu_);
  auto it = calls_.find(op);
  return it == calls_.end() ? 0 : it->second;
}

void InMemoryFileSystem::SetFile(const std::string& path, const std::string& contents,
                                 uint32_t mode) {
  absl::MutexLock lock(&mu_);
  FS_CHECK(IsDir(DirName(path))) << "SetFile " << path << ": no such directory";
  auto node = std::make_shared<Node>();
  node->data = node->synced = contents;
  node->mode = mode;
  files_[path] = node;
  durable_[path] = std::move(node);
}

}  // namespace flatshard
