// flatshard._C's published weights: a reader's connection, the versions it opens (a lease on
// the version and its read-only mapping, shared by every tensor, array and memoryview made
// from it), and the version descriptions that Publish, List and WaitForVersion return.
//
// GIL: every call that may block (connect, open, wait, release, destruction of an open
// version) runs without it.

#include "client/python/weights.h"

#include <pybind11/stl.h>

#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/client_internal.h"
#include "client/python/binding_util.h"
#include "client/python/dlpack_export.h"
#include "client/python/memoryview_export.h"
#include "flatshard/dtype.h"
#include "tests/testing/simulated_gpu.h"

namespace flatshard::python {
namespace {

using client::OpenWeightsOptions;
using client::PublishedVersion;
using client::WeightsReader;
using client::WeightsTensor;
using client::WeightsVersion;

OpenWeightsOptions MakeOpenOptions(std::optional<uint64_t> version, int64_t owner_uid,
                                   std::string token) {
  OpenWeightsOptions o;
  o.version = version;
  o.owner_uid = owner_uid;
  o.token = std::move(token);
  return o;
}

// An open version as Python holds it. Every exported view shares the mapping and the C++
// WeightsVersion: views alive keep the lease (a reader that forgot close() still holds what it
// reads), and after release() (the lease ends at once) they still point at mapped memory.
class PyWeightsVersion {
 public:
  // `device_as_host`: device versions of simulated GPUs (host pointers) export as host memory.
  PyWeightsVersion(std::unique_ptr<WeightsVersion> v, bool device_as_host)
      : device_as_host_(device_as_host),
        v_(std::shared_ptr<WeightsVersion>(v.release())),
        info_(v_->info()),
        keep_(std::make_shared<const std::vector<std::shared_ptr<const void>>>(
            std::vector<std::shared_ptr<const void>>{v_->mapping(), v_})) {}

  // Views still alive keep the version (and its lease) until the last is freed.
  ~PyWeightsVersion() {
    WithoutGil([&] {
      v_.reset();
      keep_.reset();
    });
  }

  const PublishedVersion& info() const { return info_; }

  void Release() {
    absl::Status status;
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      if (!released_) status = v_->Release();
      released_ = true;
    }
    Check(status);
  }
  bool released() const {
    std::lock_guard<std::mutex> lock(mu_);
    return released_;
  }

  // (name, dtype name, shape, device) of every tensor, in the version's order.
  py::list Describe() const {
    py::list out;
    for (const WeightsTensor& t : v_->tensors()) {
      out.append(py::make_tuple(t.name, std::string(DTypeName(t.dtype)),
                                py::tuple(py::cast(t.shape)), t.device));
    }
    return out;
  }
  py::list Dlpack() const {
    py::list out;
    for (const WeightsTensor& t : Live()) {
      out.append(ToDlpack(RegionOf(t), keep_, device_as_host_));
    }
    return out;
  }
  py::list Numpy() const {
    py::list out;
    for (const WeightsTensor& t : Live()) {
      out.append(ToNumpy(RegionOf(t), keep_, false, device_as_host_));
    }
    return out;
  }
  py::list Memoryviews() const {
    py::list out;
    for (const WeightsTensor& t : Live()) {
      out.append(ToMemoryview(RegionOf(t), keep_, false, device_as_host_));
    }
    return out;
  }

 private:
  static Region RegionOf(const WeightsTensor& t) {
    return Region{const_cast<void*>(t.data), t.shape, t.dtype, t.device};
  }
  // The tensors, refused once released (new views of a version no longer held).
  const std::vector<WeightsTensor>& Live() const {
    if (released()) {
      throw StatusError(absl::FailedPreconditionError(absl::StrCat(
          "weights \"", info_.name, "\" version ", info_.version, ": released (closed)")));
    }
    return v_->tensors();
  }

  mutable std::mutex mu_;  // guards released_ and Release
  const bool device_as_host_;
  std::shared_ptr<WeightsVersion> v_;
  const PublishedVersion info_;
  Keepalive keep_;
  bool released_ = false;
};

class PyWeightsReader {
 public:
  PyWeightsReader(std::string address, double call_timeout, int max_attempts,
                  std::string tls_ca_file, std::string tls_cert_file, std::string tls_key_file,
                  bool simulated_gpus)
      : simulated_gpus_(simulated_gpus) {
    client::ClientOptions options;
    options.address = std::move(address);
    options.call_timeout = Seconds(call_timeout, "call_timeout");
    options.max_attempts = max_attempts;
    options.tls_ca_file = std::move(tls_ca_file);
    options.tls_cert_file = std::move(tls_cert_file);
    options.tls_key_file = std::move(tls_key_file);
    absl::StatusOr<std::unique_ptr<WeightsReader>> r;
    {
      py::gil_scoped_release release;
      r = simulated_gpus ? client::internal::WeightsReaderAccess::Connect(
                               std::move(options), std::make_unique<testing::SimulatedOpener>())
                         : WeightsReader::Connect(std::move(options));
    }
    reader_ = std::shared_ptr<WeightsReader>(Unwrap(std::move(r)).release());
  }
  ~PyWeightsReader() {
    WithoutGil([&] { reader_.reset(); });
  }

  std::shared_ptr<PyWeightsVersion> Open(const std::string& name, std::optional<uint64_t> version,
                                         int64_t owner_uid, std::string token) {
    const std::shared_ptr<WeightsReader> r = Get("open");
    const OpenWeightsOptions o = MakeOpenOptions(version, owner_uid, std::move(token));
    absl::StatusOr<std::unique_ptr<WeightsVersion>> v;
    std::shared_ptr<PyWeightsVersion> out;
    {
      py::gil_scoped_release release;
      v = r->Open(name, o);
      // Made here: a failure below must destroy the version (a Release RPC) without the GIL.
      if (v.ok()) out = std::make_shared<PyWeightsVersion>(*std::move(v), simulated_gpus_);
    }
    if (out == nullptr) throw StatusError(v.status());
    return out;
  }

  PublishedVersion WaitForVersion(const std::string& name, uint64_t after, double timeout,
                                  int64_t owner_uid, std::string token) {
    const std::shared_ptr<WeightsReader> r = Get("wait_for_version");
    const absl::Duration t = Seconds(timeout, "timeout");
    const OpenWeightsOptions o = MakeOpenOptions(std::nullopt, owner_uid, std::move(token));
    absl::StatusOr<PublishedVersion> v;
    {
      py::gil_scoped_release release;
      v = r->WaitForVersion(name, after, t, o);
    }
    return Unwrap(std::move(v));
  }

  std::vector<PublishedVersion> List() {
    const std::shared_ptr<WeightsReader> r = Get("list");
    absl::StatusOr<std::vector<PublishedVersion>> v;
    {
      py::gil_scoped_release release;
      v = r->List();
    }
    return Unwrap(std::move(v));
  }

  // Drops this connection once no call in flight uses it; open versions stay open.
  void Close() {
    std::shared_ptr<WeightsReader> r;
    {
      std::lock_guard<std::mutex> lock(mu_);
      r = std::move(reader_);
    }
    py::gil_scoped_release release;
    r.reset();
  }

 private:
  std::shared_ptr<WeightsReader> Get(const char* what) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (reader_ == nullptr) {
      throw StatusError(absl::FailedPreconditionError(
          absl::StrCat("weights reader ", what, ": the reader was closed")));
    }
    return reader_;
  }

  mutable std::mutex mu_;  // never held across a call into the reader
  const bool simulated_gpus_;
  std::shared_ptr<WeightsReader> reader_;
};

}  // namespace

client::PublishOptions MakePublishOptions(const std::string& dtype,
                                          const std::vector<int64_t>& reader_uids,
                                          const std::string& reader_token, int device) {
  client::PublishOptions o;
  o.device = device;
  if (!dtype.empty()) {
    o.dtype = ParseDType(dtype);
    if (!o.dtype) {
      throw StatusError(absl::InvalidArgumentError(
          absl::StrCat("publish: dtype: unknown dtype \"", dtype, "\"")));
    }
  }
  o.reader_uids = reader_uids;
  o.reader_token = reader_token;
  return o;
}

void DefineWeights(py::module_& m) {
  py::class_<PublishedVersion>(m, "PublishedVersion")
      .def_readonly("name", &PublishedVersion::name)
      .def_readonly("owner_uid", &PublishedVersion::owner_uid)
      .def_readonly("version", &PublishedVersion::version)
      .def_readonly("generation", &PublishedVersion::generation)
      .def_readonly("bytes", &PublishedVersion::bytes)
      .def_readonly("tensors", &PublishedVersion::tensors)
      .def_readonly("device", &PublishedVersion::device);

  py::class_<PyWeightsVersion, std::shared_ptr<PyWeightsVersion>>(m, "WeightsVersion")
      .def_property_readonly("info", &PyWeightsVersion::info)
      .def_property_readonly("released", &PyWeightsVersion::released)
      .def("release", &PyWeightsVersion::Release)
      .def("describe", &PyWeightsVersion::Describe)
      .def("dlpack", &PyWeightsVersion::Dlpack)
      .def("numpy", &PyWeightsVersion::Numpy)
      .def("memoryviews", &PyWeightsVersion::Memoryviews);

  py::class_<PyWeightsReader, std::shared_ptr<PyWeightsReader>>(m, "WeightsReader")
      .def(py::init<std::string, double, int, std::string, std::string, std::string, bool>(),
           py::arg("address"), py::arg("call_timeout"), py::arg("max_attempts"),
           py::arg("tls_ca_file"), py::arg("tls_cert_file"), py::arg("tls_key_file"),
           py::arg("simulated_gpus") = false)
      .def("open", &PyWeightsReader::Open, py::arg("name"), py::arg("version"),
           py::arg("owner_uid"), py::arg("token"))
      .def("wait_for_version", &PyWeightsReader::WaitForVersion, py::arg("name"), py::arg("after"),
           py::arg("timeout"), py::arg("owner_uid"), py::arg("token"))
      .def("list", &PyWeightsReader::List)
      .def("close", &PyWeightsReader::Close);
}

}  // namespace flatshard::python
