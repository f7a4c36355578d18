#pragma once
// What the binding's files share (module.cc, summons.h): absl::Status errors on their way to
// Python, running without the GIL, and the views' descriptions handed to Python.

#include <pybind11/pybind11.h>

#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/python/dlpack_export.h"
#include "flatshard/client.h"

namespace flatshard::python {

namespace py = pybind11;

// A failed absl::Status on its way to Python (see the translator in PYBIND11_MODULE).
class StatusError : public std::exception {
 public:
  explicit StatusError(absl::Status status)
      : status_(std::move(status)), what_(status_.ToString()) {}
  const absl::Status& status() const { return status_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  absl::Status status_;
  std::string what_;
};

inline void Check(absl::Status status) {
  if (!status.ok()) throw StatusError(std::move(status));
}

template <typename T>
T Unwrap(absl::StatusOr<T> value) {
  if (!value.ok()) throw StatusError(value.status());
  return *std::move(value);
}

inline absl::Duration Seconds(double seconds, const char* field) {
  if (!(seconds > 0)) {
    throw StatusError(absl::InvalidArgumentError(
        absl::StrCat("Client: ", field, " must be a positive number of seconds, got ", seconds)));
  }
  return absl::Seconds(seconds);
}

// Runs `f` with the GIL released when this thread holds it (destructors: Python frees objects
// with the GIL held, C++ may free them without).
template <typename F>
void WithoutGil(F&& f) {
  if (PyGILState_Check()) {
    py::gil_scoped_release release;
    f();
  } else {
    f();
  }
}

inline Keepalive ShareMappings(const std::vector<std::shared_ptr<const void>>& mappings) {
  return std::make_shared<const std::vector<std::shared_ptr<const void>>>(mappings);
}

// --- views ---------------------------------------------------------------------------------

// One view as Python sees it; the memory stays mapped while `keep` (shared by the arrays and
// tensors made from it) lives.
struct PyView {
  std::string fqn;
  int32_t unit = -1;
  Region region;
  int64_t numel = 0;
  bool writable = false;
};

// Copies the views' descriptions (so they outlive End) and shares their mappings.
struct ViewSet {
  std::vector<PyView> views;
  Keepalive keep;

  static ViewSet From(const client::ParamViews& views) {
    ViewSet out;
    out.keep = ShareMappings(views.mappings());
    out.views.reserve(views.size());
    for (const client::ParamView& v : views) {
      out.views.push_back(
          {v.fqn, v.unit, Region{v.data, v.shape, v.dtype, v.device}, v.numel, v.writable});
    }
    return out;
  }
};

}  // namespace flatshard::python
