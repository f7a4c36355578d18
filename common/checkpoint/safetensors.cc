#include "common/checkpoint/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/checkpoint/checkpoint.h"
#include "common/file_system.h"
#include "common/json_util.h"
#include "common/status_macros.h"

namespace flatshard::safetensors {
namespace {

struct CodeEntry {
  absl::string_view code;
  int64_t size;
  std::optional<DType> dtype;
};
constexpr CodeEntry kCodes[] = {
    {"BOOL", 1, DType::kBool},    {"U8", 1, DType::kUInt8},     {"I8", 1, DType::kInt8},
    {"F8_E5M2", 1, std::nullopt}, {"F8_E4M3", 1, std::nullopt}, {"I16", 2, std::nullopt},
    {"U16", 2, std::nullopt},     {"F16", 2, DType::kFloat16},  {"BF16", 2, DType::kBFloat16},
    {"I32", 4, DType::kInt32},    {"U32", 4, std::nullopt},     {"F32", 4, DType::kFloat32},
    {"F64", 8, DType::kFloat64},  {"I64", 8, DType::kInt64},    {"U64", 8, std::nullopt},
};

absl::Status Bad(absl::string_view path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": safetensors: ", what));
}

}  // namespace

absl::string_view CodeOf(DType dtype) {
  for (const CodeEntry& e : kCodes) {
    if (e.dtype == dtype) return e.code;
  }
  return "?";
}

std::optional<DType> DTypeOfCode(absl::string_view code) {
  for (const CodeEntry& e : kCodes) {
    if (e.code == code) return e.dtype;
  }
  return std::nullopt;
}

int64_t CodeSize(absl::string_view code) {
  for (const CodeEntry& e : kCodes) {
    if (e.code == code) return e.size;
  }
  return 0;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const TensorInfo* Header::Find(absl::string_view name) const {
  for (const TensorInfo& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

absl::StatusOr<Header> ParseHeader(absl::string_view header_json, int64_t file_size,
                                   absl::string_view path) {
  Header h;
  h.data_start = 8 + static_cast<int64_t>(header_json.size());
  if (header_json.empty() || header_json[0] != '{') {
    return Bad(path, "the header must be a JSON object starting with '{'");
  }
  // Trailing spaces are padding (the reference writer aligns the byte buffer to 8).
  absl::StatusOr<Json> doc = ParseJson(header_json, absl::StrCat(path, ": safetensors header"));
  if (!doc.ok()) return absl::InvalidArgumentError(doc.status().message());
  if (!doc->is_object()) return Bad(path, "the header is not a JSON object");
  const int64_t buffer_bytes = file_size - h.data_start;
  for (auto it = doc->begin(); it != doc->end(); ++it) {
    const std::string& name = it.key();
    const Json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return Bad(path, "__metadata__ must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return Bad(path, absl::StrCat("__metadata__.", m.key(), " must be a string"));
        }
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string at = absl::StrCat("tensor ", Quote(name));
    if (!v.is_object() || v.size() != 3 || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets")) {
      return Bad(path, absl::StrCat(at, ": must be {\"dtype\", \"shape\", \"data_offsets\"}"));
    }
    TensorInfo t;
    t.name = name;
    if (!v["dtype"].is_string()) return Bad(path, absl::StrCat(at, ": dtype must be a string"));
    t.code = v["dtype"].get<std::string>();
    const int64_t size = CodeSize(t.code);
    if (size == 0) return Bad(path, absl::StrCat(at, ": unknown dtype ", Quote(t.code)));
    if (!v["shape"].is_array()) return Bad(path, absl::StrCat(at, ": shape must be an array"));
    int64_t numel = 1;
    for (const Json& d : v["shape"]) {
      if (!d.is_number_unsigned()) {
        return Bad(path, absl::StrCat(at, ": shape entries must be non-negative integers"));
      }
      const uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(INT64_MAX) ||
          __builtin_mul_overflow(numel, static_cast<int64_t>(dim), &numel)) {
        return Bad(path, absl::StrCat(at, ": shape overflows"));
      }
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    const Json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned()) {
      return Bad(path, absl::StrCat(at, ": data_offsets must be [begin, end]"));
    }
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    if (b > e || e > static_cast<uint64_t>(std::max<int64_t>(buffer_bytes, 0))) {
      return Bad(path, absl::StrCat(at, ": data_offsets [", b, ", ", e,
                                    "] lie outside the byte buffer of ", buffer_bytes, " bytes"));
    }
    t.begin = static_cast<int64_t>(b);
    t.end = static_cast<int64_t>(e);
    int64_t want;
    if (__builtin_mul_overflow(numel, size, &want) || want != t.end - t.begin) {
      return Bad(path, absl::StrCat(at, ": data_offsets span ", t.end - t.begin,
                                    " bytes, its shape and dtype need ", numel * size));
    }
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  int64_t at = 0;
  for (const TensorInfo& t : h.tensors) {
    if (t.begin != at) {
      return Bad(path, absl::StrCat("tensor ", Quote(t.name), " starts at byte ", t.begin,
                                    " of the byte buffer, expected ", at,
                                    t.begin < at ? " (overlap)" : " (a hole)"));
    }
    at = t.end;
  }
  if (at != buffer_bytes) {
    return Bad(path, absl::StrCat("the tensors cover ", at, " bytes of a ", buffer_bytes,
                                  "-byte buffer", at < buffer_bytes ? " (trailing bytes)" : ""));
  }
  return h;
}

absl::StatusOr<Header> ReadHeader(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(path, ": open: ", std::strerror(errno)));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return absl::InternalError(absl::StrCat(path, ": fstat: ", std::strerror(errno)));
  }
  if (st.st_size < 8)
    return Bad(path, absl::StrCat("only ", st.st_size, " bytes (no header size)"));
  unsigned char len[8];
  FS_RETURN_IF_ERROR(checkpoint::internal::ReadAll(fd, len, 8, 0, path));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];  // little-endian
  if (n > static_cast<uint64_t>(kMaxHeaderBytes)) {
    return Bad(path, absl::StrCat("header size ", n, " is over the limit of ", kMaxHeaderBytes));
  }
  if (static_cast<int64_t>(n) > st.st_size - 8) {
    return Bad(path, absl::StrCat("header size ", n, " runs past the end of the file (", st.st_size,
                                  " bytes)"));
  }
  std::string text(n, '\0');
  FS_RETURN_IF_ERROR(checkpoint::internal::ReadAll(fd, text.data(), n, 8, path));
  return ParseHeader(text, st.st_size, path);
}

std::string HeaderText(const std::vector<Writer::Spec>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json doc = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    doc["__metadata__"] = std::move(m);
  }
  int64_t at = 0;
  for (const Writer::Spec& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    const int64_t bytes = numel * ItemSize(t.dtype);
    nlohmann::ordered_json e;
    e["dtype"] = std::string(CodeOf(t.dtype));
    e["shape"] = t.shape;
    e["data_offsets"] = {at, at + bytes};
    doc[t.name] = std::move(e);
    at += bytes;
  }
  std::string text = doc.dump();
  // Pad with spaces so the byte buffer (8 + N) starts at a multiple of 8.
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');
  return text;
}

absl::StatusOr<std::unique_ptr<Writer>> Writer::Create(
    const std::string& path, const std::vector<Spec>& tensors,
    const std::map<std::string, std::string>& metadata) {
  std::set<std::string> names;
  for (const Spec& t : tensors) {
    if (t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor name ", Quote(t.name), " is duplicate or reserved"));
    }
    if (CodeOf(t.dtype) == "?") {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor ", Quote(t.name), ": dtype ",
                                                     DTypeName(t.dtype),
                                                     " has no safetensors code"));
    }
  }
  const std::string header = HeaderText(tensors, metadata);
  std::unique_ptr<Writer> w(new Writer());
  AtomicWriteOptions options;
  options.mode = 0644;
  options.temp_suffix = ".tmp";
  FS_ASSIGN_OR_RETURN(w->file_, AtomicFile::Create(FileSystem::Posix(), path, options));
  char len[8];
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>(n >> (8 * i));
  FS_RETURN_IF_ERROR(w->file_->Append(absl::string_view(len, 8)));
  FS_RETURN_IF_ERROR(w->file_->Append(header));
  w->offset_ = 8 + static_cast<int64_t>(header.size());
  w->end_ = w->offset_;
  for (const Spec& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    w->end_ += numel * ItemSize(t.dtype);
  }
  return w;
}

// An unfinished Writer's AtomicFile removes "<path>.tmp": nothing half-written stays behind.
Writer::~Writer() = default;

absl::Status Writer::Append(const void* data, int64_t bytes) {
  if (bytes > end_ - offset_) {
    return absl::InternalError(
        absl::StrCat(file_->temp_path(), ": ", bytes, " more bytes than the header has"));
  }
  FS_RETURN_IF_ERROR(
      file_->Append(absl::string_view(static_cast<const char*>(data), static_cast<size_t>(bytes))));
  offset_ += bytes;
  return absl::OkStatus();
}

absl::Status Writer::Finish() {
  if (offset_ != end_) {
    return absl::InternalError(
        absl::StrCat(file_->temp_path(), ": ", end_ - offset_, " bytes not written"));
  }
  return file_->Publish();
}

}  // namespace flatshard::safetensors
