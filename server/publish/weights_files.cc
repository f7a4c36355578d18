#include "server/publish/weights_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/file_system.h"
#include "common/json_util.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace flatshard::server {
namespace {

constexpr char kMagic[] = "flatshard.weights/1\n";
constexpr int64_t kHeaderAlign = 4096;

Json ToJson(const StoredWeights& m) {
  Json entries = Json::array();
  for (const WeightsEntry& e : m.layout.entries) {
    entries.push_back({{"name", e.name},
                       {"dtype", static_cast<int>(e.dtype)},
                       {"shape", e.shape},
                       {"offset", e.offset},
                       {"bytes", e.bytes}});
  }
  return {{"name", m.name},
          {"owner_uid", m.owner_uid},
          {"version", m.version},
          {"generation", m.generation},
          {"group", m.group},
          {"module", m.module},
          {"reader_uids", m.reader_uids},
          {"token", m.token},
          {"bytes", m.layout.bytes},
          {"entries", entries}};
}

absl::StatusOr<StoredWeights> FromJson(const Json& j) {
  try {
    StoredWeights m;
    m.name = j.at("name").get<std::string>();
    m.owner_uid = j.at("owner_uid").get<int64_t>();
    m.version = j.at("version").get<uint64_t>();
    m.generation = j.at("generation").get<uint64_t>();
    m.group = j.at("group").get<std::string>();
    m.module = j.at("module").get<std::string>();
    m.reader_uids = j.at("reader_uids").get<std::vector<int64_t>>();
    m.token = j.at("token").get<std::string>();
    m.layout.bytes = j.at("bytes").get<int64_t>();
    for (const Json& e : j.at("entries")) {
      WeightsEntry w;
      w.name = e.at("name").get<std::string>();
      const int dtype = e.at("dtype").get<int>();
      if (dtype < 0 || dtype > static_cast<int>(DType::kBool)) {
        return absl::InvalidArgumentError(absl::StrCat("entry ", w.name, ": dtype ", dtype));
      }
      w.dtype = static_cast<DType>(dtype);
      w.shape = e.at("shape").get<std::vector<int64_t>>();
      w.offset = e.at("offset").get<int64_t>();
      w.bytes = e.at("bytes").get<int64_t>();
      if (w.offset < 0 || w.bytes < 0 || w.offset + w.bytes > m.layout.bytes) {
        return absl::InvalidArgumentError(absl::StrCat("entry ", w.name, " outside the bytes"));
      }
      m.layout.entries.push_back(std::move(w));
    }
    return m;
  } catch (const std::exception& e) {  // nlohmann's type and key errors, at the boundary
    return absl::InvalidArgumentError(e.what());
  }
}

}  // namespace

std::string WeightsFiles::PathOf(int64_t owner_uid, const std::string& name) const {
  return absl::StrCat(dir_, "/v-", owner_uid, "-", absl::BytesToHexString(name), ".weights");
}

absl::Status WeightsFiles::Write(const StoredWeights& meta, const void* data) {
  FileSystem* fs = FileSystem::Posix();
  FS_RETURN_IF_ERROR(fs->CreateDirs(dir_, 0700));
  std::string header = absl::StrCat(kMagic, ToJson(meta).dump(), "\n");
  header.resize((header.size() + kHeaderAlign - 1) / kHeaderAlign * kHeaderAlign, '\0');
  FS_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFile> f,
                      AtomicFile::Create(fs, PathOf(meta.owner_uid, meta.name), {}));
  FS_RETURN_IF_ERROR(f->Append(header));
  constexpr int64_t kChunk = int64_t{64} << 20;
  for (int64_t at = 0; at < meta.layout.bytes; at += kChunk) {
    FS_RETURN_IF_ERROR(f->Append(absl::string_view(static_cast<const char*>(data) + at,
                                                   std::min(kChunk, meta.layout.bytes - at))));
  }
  return f->Publish();
}

void WeightsFiles::Remove(int64_t owner_uid, const std::string& name, uint64_t version) {
  if (!enabled()) return;
  const std::string path = PathOf(owner_uid, name);
  if (version != 0) {
    bool holds = false;
    for (const StoredWeights& m : List()) {
      holds |= m.path == path && m.version == version;
    }
    if (!holds) return;
  }
  (void)FileSystem::Posix()->RemoveFile(path);
}

void WeightsFiles::RemoveUnfinished() {
  if (!enabled()) return;
  absl::StatusOr<std::vector<std::string>> names = FileSystem::Posix()->ListDir(dir_);
  for (const std::string& n : names.ok() ? *names : std::vector<std::string>()) {
    if (!absl::StartsWith(n, kTempFilePrefix)) continue;
    if (FileSystem::Posix()->RemoveFile(absl::StrCat(dir_, "/", n)).ok()) {
      FS_LOG(INFO) << "removed " << dir_ << "/" << n << " (an unfinished write of weights)";
    }
  }
}

std::vector<StoredWeights> WeightsFiles::List() const {
  std::vector<StoredWeights> out;
  if (!enabled()) return out;
  absl::StatusOr<std::vector<std::string>> names = FileSystem::Posix()->ListDir(dir_);
  if (!names.ok()) return out;  // no directory yet: nothing stored
  for (const std::string& n : *names) {
    if (!absl::StartsWith(n, "v-") || !absl::EndsWith(n, ".weights")) continue;
    const std::string path = absl::StrCat(dir_, "/", n);
    auto refuse = [&](absl::string_view why) {
      FS_LOG(WARNING) << "published weights file " << path << " refused: " << why;
    };
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      refuse(std::strerror(errno));
      continue;
    }
    const off_t size = ::lseek(fd, 0, SEEK_END);
    // The header of a large model's index can be megabytes: read up to 256 MiB of it.
    std::string head(static_cast<size_t>(std::clamp<off_t>(size, 0, off_t{256} << 20)), '\0');
    const ssize_t got = ::pread(fd, head.data(), head.size(), 0);
    ::close(fd);
    head.resize(got > 0 ? static_cast<size_t>(got) : 0);
    const size_t line = head.find('\n', sizeof(kMagic) - 1);
    if (!absl::StartsWith(head, kMagic) || line == std::string::npos) {
      refuse("no header");
      continue;
    }
    absl::StatusOr<Json> j = ParseJson(
        absl::string_view(head).substr(sizeof(kMagic) - 1, line - (sizeof(kMagic) - 1)), path);
    absl::StatusOr<StoredWeights> m = j.ok() ? FromJson(*j) : j.status();
    if (!m.ok()) {
      refuse(m.status().message());
      continue;
    }
    m->path = path;
    m->data_offset =
        static_cast<int64_t>((line + 1 + kHeaderAlign - 1) / kHeaderAlign * kHeaderAlign);
    if (size != m->data_offset + m->layout.bytes || PathOf(m->owner_uid, m->name) != path) {
      refuse(absl::StrCat("size ", size, " or name does not match its header"));
      continue;
    }
    out.push_back(*std::move(m));
  }
  return out;
}

absl::Status WeightsFiles::ReadInto(const StoredWeights& meta, void* dst) {
  const int fd = ::open(meta.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::InternalError(absl::StrCat(meta.path, ": open: ", std::strerror(errno)));
  int64_t done = 0;
  while (done < meta.layout.bytes) {
    const ssize_t n =
        ::pread(fd, static_cast<char*>(dst) + done,
                static_cast<size_t>(std::min<int64_t>(meta.layout.bytes - done, 1 << 30)),
                meta.data_offset + done);
    if (n <= 0) {
      ::close(fd);
      return absl::InternalError(absl::StrCat(meta.path, ": read at ", done, ": ",
                                              n == 0 ? "end of file" : std::strerror(errno)));
    }
    done += n;
  }
  ::close(fd);
  return absl::OkStatus();
}

}  // namespace flatshard::server
