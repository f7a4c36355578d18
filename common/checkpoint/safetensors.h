#pragma once
// The safetensors format (https://github.com/huggingface/safetensors, README "Format"):
//   8 bytes: N, the header size, little-endian u64;
//   N bytes: UTF-8 JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...,
//            optional "__metadata__": {string: string}}, possibly padded with trailing spaces;
//   the byte buffer: offsets are relative to its start; tensors are contiguous, do not overlap
//   and cover it entirely; e - b = numel * dtype size; little-endian, C order.
// The writer pads the header with spaces so the byte buffer starts at a multiple of 8 (as the
// reference implementation does) and lays tensors out in the order given. The reader refuses a
// header over 100 MB (the reference implementation's limit), duplicate names, unknown dtypes,
// holes, overlaps and sizes that disagree with shape and dtype, naming the file and the tensor.
// Thread-safe: pure functions; a Writer is used by one thread.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/file_system.h"

namespace flatshard::safetensors {

inline constexpr int64_t kMaxHeaderBytes = int64_t{100} << 20;

// "F32", "F16", "BF16", "F64", "I8", "I32", "I64", "U8", "BOOL" for flatshard's dtypes.
absl::string_view CodeOf(DType dtype);
// The flatshard dtype of a safetensors code; nullopt for codes flatshard has no type for
// (I16, U16, U32, U64, F8_*) and for unknown ones.
std::optional<DType> DTypeOfCode(absl::string_view code);
// Bytes per element of any code the format defines; 0 for an unknown code.
int64_t CodeSize(absl::string_view code);

struct TensorInfo {
  std::string name;
  std::string code;  // the dtype as written ("F32")
  std::vector<int64_t> shape;
  int64_t begin = 0;  // data_offsets, relative to the byte buffer
  int64_t end = 0;
  int64_t numel() const;
};

struct Header {
  std::vector<TensorInfo> tensors;  // in order of data_offsets
  std::map<std::string, std::string> metadata;
  int64_t data_start = 0;  // absolute file offset of the byte buffer (8 + N)
  const TensorInfo* Find(absl::string_view name) const;
};

// Parses and checks a header given the whole file size. INVALID_ARGUMENT naming `path` (and
// the tensor) and the rule broken.
absl::StatusOr<Header> ParseHeader(absl::string_view header_json, int64_t file_size,
                                   absl::string_view path);
// Reads the first 8 + N bytes of `path` and parses them.
absl::StatusOr<Header> ReadHeader(const std::string& path);

// Writes a safetensors file through an AtomicFile (common/file_system.h): header first (so
// every tensor's size must be known up front), then each tensor's bytes in order, then fsync
// and rename of "<path>.tmp" to `path`, fsync of the directory.
class Writer {
 public:
  struct Spec {
    std::string name;
    DType dtype = DType::kFloat32;
    std::vector<int64_t> shape;
  };
  // Opens "<path>.tmp" and writes the header.
  static absl::StatusOr<std::unique_ptr<Writer>> Create(
      const std::string& path, const std::vector<Spec>& tensors,
      const std::map<std::string, std::string>& metadata);
  ~Writer();
  // Appends bytes of the current tensor (tensors in the order of Create; any chunking).
  absl::Status Append(const void* data, int64_t bytes);
  // Checks every tensor was written whole, fsyncs, renames, fsyncs the directory.
  absl::Status Finish();

 private:
  Writer() = default;
  std::unique_ptr<AtomicFile> file_;
  int64_t offset_ = 0;
  int64_t end_ = 0;  // file size once complete
};

// The JSON header text Writer writes for `tensors` (tests compare golden bytes with it).
std::string HeaderText(const std::vector<Writer::Spec>& tensors,
                       const std::map<std::string, std::string>& metadata);

}  // namespace flatshard::safetensors
