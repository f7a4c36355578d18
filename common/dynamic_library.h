#pragma once
// A shared library opened with dlopen at run time, for the optional GPU libraries (libcudart,
// libnccl): one build runs on hosts without them, and GPU features light up where they are
// found, as PyTorch's and NVIDIA's own loaders do.
//
// Open() tries, in order: the file named by `env_var` (when set and not empty), the soname
// through the dynamic loader (LD_LIBRARY_PATH, ldconfig's cache, the default directories), then
// `<dir>/<soname>` for each fallback directory. The library is opened RTLD_NOW | RTLD_LOCAL, so
// its symbols never interpose on another copy that the process loads (torch's libcudart).
//
// Thread safety: Symbol() is thread-safe; the library stays loaded until the object is destroyed.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard {

struct DynamicLibrarySpec {
  std::string name;     // for messages: "the CUDA runtime (libcudart)"
  std::string soname;   // "libcudart.so.13"
  std::string env_var;  // an explicit file path overrides the search: "FLATSHARD_CUDA_LIBRARY"
  std::vector<std::string> fallback_dirs;  // tried after the loader's own search
};

class DynamicLibrary {
 public:
  // FAILED_PRECONDITION "<name> (<soname>) not found; tried: <place>: <dlerror>; ..." naming
  // every place tried with the loader's reason, and the environment variable that overrides.
  static absl::StatusOr<std::unique_ptr<DynamicLibrary>> Open(const DynamicLibrarySpec& spec);

  ~DynamicLibrary();
  DynamicLibrary(const DynamicLibrary&) = delete;
  DynamicLibrary& operator=(const DynamicLibrary&) = delete;

  // The address of `symbol`; FAILED_PRECONDITION naming the symbol and the file when missing.
  absl::StatusOr<void*> Symbol(absl::string_view symbol) const;

  // Symbol() cast to the entry point's type, e.g. Resolve("cudaFree", &table.cudaFree).
  template <typename F>
  absl::Status Resolve(absl::string_view symbol, F* out) const {
    absl::StatusOr<void*> address = Symbol(symbol);
    if (!address.ok()) return address.status();
    *out = reinterpret_cast<F>(*address);
    return absl::OkStatus();
  }

  // The file that was opened, as the loader resolved it ("/usr/local/cuda/lib64/libcudart.so.13").
  const std::string& path() const { return path_; }

 private:
  DynamicLibrary(std::string name, std::string path, void* handle)
      : name_(std::move(name)), path_(std::move(path)), handle_(handle) {}

  const std::string name_;
  const std::string path_;
  void* const handle_;
};

// The CUDA toolkit's library directories for this architecture: /usr/local/cuda/lib64 and
// /usr/local/cuda/targets/<arch>-linux/lib.
std::vector<std::string> CudaToolkitLibraryDirs();

}  // namespace flatshard
