#include "common/file_system.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace flatshard {
namespace {

// INTERNAL, or NOT_FOUND where the caller asked for it (ENOENT means "absent" there, not a
// failure).
absl::Status ErrnoStatus(absl::string_view call, const std::string& path, int err,
                         bool enoent_is_not_found = false) {
  std::string message = absl::StrCat(call, " ", path, ": ", std::strerror(err));
  if (enoent_is_not_found && err == ENOENT) return absl::NotFoundError(std::move(message));
  return absl::InternalError(std::move(message));
}

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
  }

  absl::Status Append(absl::string_view data) override {
    const char* p = data.data();
    size_t n = data.size();
    while (n > 0) {
      // Linux writes at most ~2 GiB per call; smaller calls keep a short write cheap to retry.
      const ssize_t w = ::write(fd_, p, std::min<size_t>(n, size_t{1} << 30));
      if (w < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus("write", path_, errno);
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
    return absl::OkStatus();
  }

  absl::Status Sync() override {
    if (::fsync(fd_) != 0) return ErrnoStatus("fsync", path_, errno);
    return absl::OkStatus();
  }

  absl::Status Close() override {
    const int fd = fd_;
    fd_ = -1;  // closed even when close() fails: retrying it could close another file
    if (::close(fd) != 0) return ErrnoStatus("close", path_, errno);
    return absl::OkStatus();
  }

 private:
  const std::string path_;
  int fd_;
};

class PosixFileSystem final : public FileSystem {
 public:
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path, const NewFileOptions& options) override {
    const int flags = O_WRONLY | O_CREAT | O_CLOEXEC |
                      (options.append ? O_APPEND : (options.exclusive ? O_EXCL : O_TRUNC));
    const int fd = ::open(path.c_str(), flags, static_cast<mode_t>(options.mode));
    if (fd < 0) return ErrnoStatus("open", path, errno);
    return std::make_unique<PosixWritableFile>(path, fd);
  }

  absl::StatusOr<std::string> ReadFile(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus("open", path, errno, /*enoent_is_not_found=*/true);
    std::string out;
    struct stat st;
    if (::fstat(fd, &st) == 0 && st.st_size > 0) out.reserve(static_cast<size_t>(st.st_size));
    char buf[64 << 10];
    while (true) {
      const ssize_t r = ::read(fd, buf, sizeof(buf));
      if (r < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        ::close(fd);
        return ErrnoStatus("read", path, err);
      }
      if (r == 0) break;
      out.append(buf, static_cast<size_t>(r));
    }
    ::close(fd);
    return out;
  }

  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) override {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) return ErrnoStatus("opendir", dir, errno, /*enoent_is_not_found=*/true);
    std::vector<std::string> names;
    while (struct dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    ::closedir(d);
    return names;
  }

  bool FileExists(const std::string& path) override {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0;
  }

  absl::Status RemoveFile(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) {
      return ErrnoStatus("unlink", path, errno, /*enoent_is_not_found=*/true);
    }
    return absl::OkStatus();
  }

  absl::Status RenameFile(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      return ErrnoStatus("rename", absl::StrCat(from, " to ", to), errno);
    }
    return absl::OkStatus();
  }

  absl::Status SyncDir(const std::string& dir) override {
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus("open directory", dir, errno);
    const int rc = ::fsync(fd);
    const int err = errno;
    ::close(fd);
    if (rc != 0) return ErrnoStatus("fsync directory", dir, err);
    return absl::OkStatus();
  }

  absl::Status CreateDirs(const std::string& dir, uint32_t mode) override {
    if (dir.empty()) return absl::InvalidArgumentError("mkdir: empty directory name");
    for (size_t pos = 0; pos != std::string::npos;) {
      pos = dir.find('/', pos + 1);
      const std::string prefix = dir.substr(0, pos);
      if (::mkdir(prefix.c_str(), 0777) != 0 && errno != EEXIST) {
        return ErrnoStatus("mkdir", prefix, errno);
      }
    }
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0) return ErrnoStatus("stat", dir, errno);
    if (!S_ISDIR(st.st_mode)) return absl::FailedPreconditionError(dir + ": not a directory");
    if ((st.st_mode & 0777) != mode && ::chmod(dir.c_str(), static_cast<mode_t>(mode)) != 0) {
      return ErrnoStatus(absl::StrFormat("chmod %04o", mode), dir, errno);
    }
    return absl::OkStatus();
  }
};

}  // namespace

FileSystem* FileSystem::Posix() {
  static FileSystem* const fs = new PosixFileSystem();
  return fs;
}

std::string DirName(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

absl::StatusOr<std::unique_ptr<AtomicFile>> AtomicFile::Create(FileSystem* fs, std::string path,
                                                               AtomicWriteOptions options) {
  static std::atomic<uint64_t> counter{0};
  std::string temp;
  NewFileOptions file_options;
  file_options.mode = options.mode;
  if (options.temp_suffix.empty()) {
    const size_t slash = path.find_last_of('/');
    const size_t base = slash == std::string::npos ? 0 : slash + 1;
    temp = absl::StrCat(path.substr(0, base), kTempFilePrefix, path.substr(base), ".", ::getpid(),
                        ".", counter.fetch_add(1));
    file_options.exclusive = true;
  } else {
    temp = path + options.temp_suffix;
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> file = fs->NewWritableFile(temp, file_options);
  if (!file.ok()) {
    return absl::Status(file.status().code(), absl::StrCat(path, ": ", file.status().message()));
  }
  return std::unique_ptr<AtomicFile>(
      new AtomicFile(fs, std::move(path), std::move(temp), std::move(options), *std::move(file)));
}

AtomicFile::AtomicFile(FileSystem* fs, std::string path, std::string temp,
                       AtomicWriteOptions options, std::unique_ptr<WritableFile> file)
    : fs_(fs),
      path_(std::move(path)),
      temp_(std::move(temp)),
      options_(std::move(options)),
      file_(std::move(file)) {}

AtomicFile::~AtomicFile() {
  if (renamed_) return;
  file_.reset();
  // Never published: nothing half-written stays behind (a killed writer's temp file is what
  // StateDir::Open, or the next write with the same temp_suffix, takes care of).
  fs_->RemoveFile(temp_).IgnoreError();
}

absl::Status AtomicFile::Fail(const absl::Status& s) const {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(path_, ": ", s.message()));
}

absl::Status AtomicFile::Append(absl::string_view data) { return Fail(file_->Append(data)); }

absl::Status AtomicFile::Publish() {
  if (options_.sync) FS_RETURN_IF_ERROR(Fail(file_->Sync()));
  const absl::Status closed = file_->Close();
  file_.reset();
  FS_RETURN_IF_ERROR(Fail(closed));
  FS_RETURN_IF_ERROR(Fail(fs_->RenameFile(temp_, path_)));
  renamed_ = true;
  if (options_.sync && options_.sync_dir) return Fail(fs_->SyncDir(DirName(path_)));
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(FileSystem* fs, const std::string& path,
                                 absl::string_view contents, const AtomicWriteOptions& options) {
  FS_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFile> file, AtomicFile::Create(fs, path, options));
  FS_RETURN_IF_ERROR(file->Append(contents));
  return file->Publish();
}

}  // namespace flatshard
