#include "common/dynamic_library.h"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace flatshard {
namespace {

// dlopen's reason for the last failure, or a generic one when it gave none.
std::string LastDlError() {
  const char* e = dlerror();
  return e != nullptr ? std::string(e) : std::string("unknown dlopen error");
}

}  // namespace

absl::StatusOr<std::unique_ptr<DynamicLibrary>> DynamicLibrary::Open(
    const DynamicLibrarySpec& spec) {
  struct Place {
    std::string file;   // what dlopen gets
    std::string label;  // how the error names it
  };
  std::vector<Place> places;
  if (!spec.env_var.empty()) {
    const char* path = std::getenv(spec.env_var.c_str());
    if (path != nullptr && *path != '\0')
      places.push_back({path, absl::StrCat(spec.env_var, "=", path)});
  }
  places.push_back({spec.soname, "the dynamic loader's search path (LD_LIBRARY_PATH, ldconfig)"});
  for (const std::string& dir : spec.fallback_dirs) {
    places.push_back({absl::StrCat(dir, "/", spec.soname), dir});
  }
  std::vector<std::string> tried;
  for (Place& place : places) {
    void* handle = dlopen(place.file.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) {
      // The file the loader chose (a soname alone does not say which copy that is).
      const link_map* map = nullptr;
      if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr &&
          map->l_name[0] != '\0') {
        place.file = map->l_name;
      }
      return std::unique_ptr<DynamicLibrary>(
          new DynamicLibrary(spec.name, std::move(place.file), handle));
    }
    tried.push_back(absl::StrCat(place.label, ": ", LastDlError()));
  }
  std::string message = absl::StrCat(spec.name, " (", spec.soname,
                                     ") not found; tried: ", absl::StrJoin(tried, "; "));
  if (!spec.env_var.empty()) {
    absl::StrAppend(&message, ". Set ", spec.env_var, " to the library's file to use another");
  }
  return absl::FailedPreconditionError(message);
}

DynamicLibrary::~DynamicLibrary() { dlclose(handle_); }

absl::StatusOr<void*> DynamicLibrary::Symbol(absl::string_view symbol) const {
  const std::string name(symbol);
  dlerror();  // clear a stale error: a symbol's address may legitimately be null
  void* address = dlsym(handle_, name.c_str());
  if (address == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(name_, " at ", path_, " lacks the symbol ", name, " (", LastDlError(),
                     "); flatshard needs a newer version of the library"));
  }
  return address;
}

std::vector<std::string> CudaToolkitLibraryDirs() {
#if defined(__x86_64__)
  constexpr const char* kTarget = "/usr/local/cuda/targets/x86_64-linux/lib";
#elif defined(__aarch64__)
  constexpr const char* kTarget = "/usr/local/cuda/targets/sbsa-linux/lib";
#else
  constexpr const char* kTarget = nullptr;
#endif
  std::vector<std::string> dirs = {"/usr/local/cuda/lib64"};
  if (kTarget != nullptr) dirs.emplace_back(kTarget);
  return dirs;
}

}  // namespace flatshard
