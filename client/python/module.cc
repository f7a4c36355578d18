// flatshard._C: the Python binding of the C++ client library (flatshard/client.h). It adds no
// protocol of its own: every call goes through flatshard::client::Client. The pure-Python
// package (client/python/flatshard/) wraps these classes into the public API.
//
// GIL: every call that may block (connect, RPCs, ending summons, destroying a Client) runs
// with the GIL released; Python objects are only touched with it held. Objects handed to
// Python are shared_ptr-owned, so a call in flight keeps what it uses alive when another
// thread closes the Client or ends the summon.
//
// Errors: an absl::Status error becomes flatshard.errors.<Class>(code, message) through
// flatshard.errors._from_status, the message unchanged.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/client_internal.h"
#include "client/python/binding_util.h"
#include "client/python/dlpack_export.h"
#include "client/python/memoryview_export.h"
#include "client/python/summons.h"
#include "client/python/weights.h"
#include "common/plan.h"
#include "common/plan_json_writer.h"
#include "flatshard/client.h"
#include "tests/testing/simulated_gpu.h"

namespace flatshard::python {
namespace {

using client::Client;
using client::ClientOptions;
using client::FinishingReduceScatter;
using client::InitMode;
using client::ParamView;
using client::ParamViews;
using client::PendingReduceScatter;
using client::PendingSummon;
using client::ReduceOp;
using client::RegisteredModule;
using client::ShardViews;
using client::SummonedParams;
using client::SummonOptions;
using client::UnitShardView;

// --- gradient reduce-scatter ---------------------------------------------------------------

class PyPendingReduceScatter {
 public:
  PyPendingReduceScatter(std::unique_ptr<PendingReduceScatter> pending, bool device_as_host)
      : pending_(std::move(pending)),
        device_as_host_(device_as_host),
        grads_(ViewSet::From(pending_->grads())),
        region_{pending_->data(), {pending_->numel()}, pending_->dtype(), pending_->device()},
        unit_(pending_->unit()) {}

  void Finish() {
    absl::Status status;
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      status = pending_ != nullptr
                   ? pending_->Finish()
                   : absl::FailedPreconditionError(absl::StrCat(
                         "unit ", unit_, ": the reduce-scatter was finished with finish_async"));
    }
    finished_ = true;
    Check(status);
  }

  // Hands phase two to `client` (Client::StartFinish); the views stay mapped.
  absl::StatusOr<std::unique_ptr<FinishingReduceScatter>> StartFinish(Client& client) {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = true;
    return client.StartFinish(std::move(pending_));
  }

  // The full padded gradient buffer: (capsule, dtype name, device).
  py::tuple Flat() const {
    return py::make_tuple(ToDlpack(region_, grads_.keep, device_as_host_),
                          std::string(DTypeName(region_.dtype)), region_.device);
  }

  // The same buffer as a writable 1-D memoryview (needs neither numpy nor torch).
  py::memoryview FlatMemoryview() const {
    return ToMemoryview(region_, grads_.keep, /*writable=*/true, device_as_host_);
  }

  py::list Describe() const {
    py::list out;
    for (const PyView& v : grads_.views) {
      out.append(py::make_tuple(v.fqn, v.unit, std::string(DTypeName(v.region.dtype)),
                                py::tuple(py::cast(v.region.shape)), v.region.device, true));
    }
    return out;
  }
  py::list Dlpack() const {
    py::list out;
    for (const PyView& v : grads_.views) {
      out.append(ToDlpack(v.region, grads_.keep, device_as_host_));
    }
    return out;
  }

  int32_t unit() const { return unit_; }
  int64_t numel() const { return region_.shape[0]; }
  bool finished() const { return finished_; }

 private:
  std::mutex mu_;
  std::unique_ptr<PendingReduceScatter> pending_;  // null once handed to StartFinish
  const bool device_as_host_;
  ViewSet grads_;
  const Region region_;  // the full flat buffer
  const int32_t unit_;
  bool finished_ = false;
};

class PyFinishingReduceScatter {
 public:
  explicit PyFinishingReduceScatter(std::unique_ptr<FinishingReduceScatter> f) : f_(std::move(f)) {}
  ~PyFinishingReduceScatter() {
    WithoutGil([&] { f_.reset(); });
  }
  void Wait() {
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = f_->Wait();
    }
    Check(status);
  }
  bool ready() const { return f_->ready(); }
  int32_t unit() const { return f_->unit(); }

 private:
  std::unique_ptr<FinishingReduceScatter> f_;
};

// --- shards --------------------------------------------------------------------------------

struct PyUnitShard {
  int32_t unit = -1;
  DType dtype = DType::kFloat32;
  int64_t shard_numel = 0;
  int64_t shard_offset = 0;
  int device = -1;
  void* data = nullptr;
  void* grad = nullptr;
  Keepalive keep;
  bool device_as_host = false;
  std::vector<client::StateView> states;  // optimizer state buffers (RegisterState)

  py::object Capsule(void* p) const {
    if (p == nullptr && shard_numel > 0) return py::none();
    return ToDlpack(Region{p, {shard_numel}, dtype, device}, keep, device_as_host);
  }
  const client::StateView& State(const std::string& name) const {
    for (const client::StateView& v : states) {
      if (v.name == name) return v;
    }
    throw StatusError(
        absl::NotFoundError(absl::StrCat("unit ", unit, " has no optimizer state \"", name, "\"")));
  }
  std::vector<std::string> StateNames() const {
    std::vector<std::string> out;
    for (const client::StateView& v : states) out.push_back(v.name);
    return out;
  }
};

// A state spec as Python passes and gets it: (name, dtype name, "shard" | "scalar").
using PyStateSpec = std::tuple<std::string, std::string, std::string>;

std::vector<PyStateSpec> ToPySpecs(const std::vector<client::StateSpec>& specs) {
  std::vector<PyStateSpec> out;
  for (const client::StateSpec& s : specs) {
    out.emplace_back(s.name, std::string(DTypeName(s.dtype)),
                     s.shape == client::StateShape::kShard ? "shard" : "scalar");
  }
  return out;
}

std::vector<PyUnitShard> ToPyShards(const ShardViews& views, bool device_as_host) {
  const Keepalive keep = ShareMappings(views.mappings());
  std::vector<PyUnitShard> out;
  for (const UnitShardView& v : views) {
    out.push_back({v.unit, v.dtype, v.shard_numel, v.shard_offset, v.device, v.data, v.grad, keep,
                   device_as_host, v.states});
  }
  return out;
}

// --- registration --------------------------------------------------------------------------

struct PyRegistered {
  std::string module;
  std::string plan_json;
  std::vector<PyUnitShard> shards;
  std::shared_ptr<PySummoned> init_summon;  // nullptr for zeros
  uint64_t generation = 0;                  // the committed generation the shards hold
  std::vector<PyStateSpec> state_specs;     // the module's optimizer state spec, if any
};

// GetShardViews' answer: this rank's shards and the committed generation they hold.
struct PyShardViews {
  std::vector<PyUnitShard> shards;
  uint64_t generation = 0;
  std::vector<PyStateSpec> state_specs;  // the module's optimizer state spec, if any
};

// --- the client ----------------------------------------------------------------------------

// A Client held for one call. After a concurrent close() this may be the last reference:
// then the Client (whose destructor closes the lease stream) is destroyed without the GIL.
class ClientRef {
 public:
  explicit ClientRef(std::shared_ptr<Client> client) : client_(std::move(client)) {}
  ClientRef(const ClientRef&) = delete;
  ClientRef& operator=(const ClientRef&) = delete;
  ~ClientRef() {
    if (client_ != nullptr && client_.use_count() == 1) WithoutGil([&] { client_.reset(); });
  }
  Client* operator->() const { return client_.get(); }

 private:
  std::shared_ptr<Client> client_;
};

class PyClient {
 public:
  PyClient(std::string address, double call_timeout, double join_timeout, int max_attempts,
           double initial_backoff, double max_backoff, std::string tls_ca_file,
           std::string tls_cert_file, std::string tls_key_file, uintptr_t cuda_stream,
           bool simulated_gpus) {
    ClientOptions options;
    options.address = std::move(address);
    options.call_timeout = Seconds(call_timeout, "call_timeout");
    options.join_timeout = Seconds(join_timeout, "join_timeout");
    options.max_attempts = max_attempts;
    options.initial_backoff = Seconds(initial_backoff, "initial_backoff");
    options.max_backoff = Seconds(max_backoff, "max_backoff");
    options.tls_ca_file = std::move(tls_ca_file);
    options.tls_cert_file = std::move(tls_cert_file);
    options.tls_key_file = std::move(tls_key_file);
    options.cuda_stream = reinterpret_cast<void*>(cuda_stream);
    device_as_host_ = simulated_gpus;
    absl::StatusOr<std::unique_ptr<Client>> client;
    {
      py::gil_scoped_release release;
      if (simulated_gpus) {
        client::internal::GpuApis apis;
        apis.opener = std::make_unique<testing::SimulatedOpener>();
        apis.events = std::make_unique<testing::SimulatedEvents>();
        client = client::internal::ConnectWithGpuApis(std::move(options), std::move(apis));
      } else {
        client = Client::Connect(std::move(options));
      }
    }
    client_ = std::shared_ptr<Client>(Unwrap(std::move(client)).release());
  }

  // Destroying the C++ Client closes its lease stream: not with the GIL held.
  ~PyClient() {
    WithoutGil([&] { client_.reset(); });
  }

  void Join(std::string group, int world_size, int rank, std::string token,
            std::string coordinator) {
    const ClientRef c = Get("join");
    absl::Status status;
    {
      py::gil_scoped_release release;
      status =
          c->Join(std::move(group), world_size, rank, std::move(token), std::move(coordinator));
    }
    Check(status);
  }

  std::shared_ptr<PyRegistered> Register(std::string module, std::string manifest_json,
                                         std::string policy_json, const std::string& init) {
    InitMode mode;
    if (init == "zeros") {
      mode = InitMode::kZeros;
    } else if (init == "from_every_rank") {
      mode = InitMode::kFromEveryRank;
    } else if (init == "from_rank0") {
      mode = InitMode::kFromRank0;
    } else {
      throw StatusError(absl::InvalidArgumentError(absl::StrCat(
          "register: init must be \"zeros\", \"from_every_rank\" or \"from_rank0\", got \"", init,
          "\"")));
    }
    const ClientRef c = Get("register");
    absl::StatusOr<RegisteredModule> reg;
    {
      py::gil_scoped_release release;
      reg = c->Register(std::move(module), manifest_json, policy_json, mode);
    }
    RegisteredModule r = Unwrap(std::move(reg));
    auto out = std::make_shared<PyRegistered>();
    // First, so that an error below ends the init summon without the GIL (~PySummoned).
    if (r.init_summon != nullptr) {
      out->init_summon =
          std::make_shared<PySummoned>(std::move(r.init_summon), r.plan, device_as_host_);
    }
    out->module = r.module;
    out->plan_json = PlanToJsonText(*r.plan);
    out->shards = ToPyShards(r.shards, device_as_host_);
    out->generation = r.generation;
    out->state_specs = ToPySpecs(r.shards.state_specs());
    {
      std::lock_guard<std::mutex> lock(mu_);
      plans_[r.module] = r.plan;
    }
    return out;
  }

  // `end_first`: ended by the same RPC (Client::Summon's end_first).
  std::shared_ptr<PySummoned> Summon(const std::string& module, const std::string& path,
                                     bool recurse, bool writeback, bool rank0_only,
                                     bool offload_to_cpu, bool with_grads,
                                     const std::vector<std::shared_ptr<PySummoned>>& end_first,
                                     bool compute_precision) {
    const ClientRef c = Get("summon");
    const SummonOptions options{recurse,        writeback,  rank0_only,
                                offload_to_cpu, with_grads, compute_precision};
    std::shared_ptr<const Plan> plan = FindPlan(module);  // nullptr: Summon fails NOT_FOUND
    client::SummonedList previous = Release(end_first);
    absl::StatusOr<std::unique_ptr<SummonedParams>> summoned;
    std::shared_ptr<PySummoned> out;
    {
      py::gil_scoped_release release;
      summoned = c->Summon(module, path, options, std::move(previous));
      if (summoned.ok()) {
        out = std::make_shared<PySummoned>(*std::move(summoned), std::move(plan), device_as_host_);
      }
    }
    if (out == nullptr) throw StatusError(summoned.status());
    return out;
  }

  // Client::StartSummon: errors known before any RPC raise here, the rest at wait().
  std::shared_ptr<PyPendingSummon> StartSummon(
      const std::string& module, const std::string& path, bool recurse, bool writeback,
      bool rank0_only, bool offload_to_cpu, bool with_grads,
      const std::vector<std::shared_ptr<PySummoned>>& end_first, bool compute_precision) {
    const ClientRef c = Get("summon_async");
    const SummonOptions options{recurse,        writeback,  rank0_only,
                                offload_to_cpu, with_grads, compute_precision};
    std::shared_ptr<const Plan> plan = FindPlan(module);
    client::SummonedList previous = Release(end_first);
    absl::StatusOr<std::unique_ptr<PendingSummon>> pending;
    {
      py::gil_scoped_release release;
      pending = c->StartSummon(module, path, options, std::move(previous));
    }
    return std::make_shared<PyPendingSummon>(Unwrap(std::move(pending)), std::move(plan),
                                             device_as_host_);
  }

  std::shared_ptr<PyPendingReduceScatter> BeginReduceScatter(const std::string& module,
                                                             int32_t unit, const std::string& op,
                                                             bool accumulate) {
    const ClientRef c = Get("begin_reduce_scatter");
    const ReduceOp reduce_op = ParseOp(op);
    absl::StatusOr<std::unique_ptr<PendingReduceScatter>> pending;
    {
      py::gil_scoped_release release;
      pending = c->BeginReduceScatter(module, unit, reduce_op, accumulate);
    }
    return std::make_shared<PyPendingReduceScatter>(Unwrap(std::move(pending)), device_as_host_);
  }

  std::shared_ptr<PyFinishingReduceScatter> FinishAsync(PyPendingReduceScatter& pending) {
    const ClientRef c = Get("finish_async");
    absl::StatusOr<std::unique_ptr<FinishingReduceScatter>> f;
    {
      py::gil_scoped_release release;
      f = pending.StartFinish(*c.operator->());
    }
    return std::make_shared<PyFinishingReduceScatter>(Unwrap(std::move(f)));
  }

  PyShardViews ShardViewsOf(const std::string& module) {
    const ClientRef c = Get("shard_views");
    absl::StatusOr<ShardViews> views;
    {
      py::gil_scoped_release release;
      views = c->GetShardViews(module);
    }
    const ShardViews v = Unwrap(std::move(views));
    return PyShardViews{ToPyShards(v, device_as_host_), v.generation(), ToPySpecs(v.state_specs())};
  }

  // Local: the optimizer state buffers of `module` (Client::RegisterState).
  PyShardViews RegisterState(const std::string& module, const std::vector<PyStateSpec>& specs) {
    std::vector<client::StateSpec> cs;
    for (size_t i = 0; i < specs.size(); ++i) {
      const auto& [name, dtype, shape] = specs[i];
      const std::optional<DType> d = ParseDType(dtype);
      if (!d) {
        throw StatusError(absl::InvalidArgumentError(
            absl::StrCat("specs[", i, "].dtype: unknown dtype \"", dtype, "\"")));
      }
      if (shape != "shard" && shape != "scalar") {
        throw StatusError(absl::InvalidArgumentError(absl::StrCat(
            "specs[", i, "].shape: \"", shape, "\", expected \"shard\" or \"scalar\"")));
      }
      cs.push_back(client::StateSpec{
          name, *d, shape == "shard" ? client::StateShape::kShard : client::StateShape::kScalar});
    }
    const ClientRef c = Get("register_state");
    absl::StatusOr<ShardViews> views;
    {
      py::gil_scoped_release release;
      views = c->RegisterState(module, cs);
    }
    const ShardViews v = Unwrap(std::move(views));
    return PyShardViews{ToPyShards(v, device_as_host_), v.generation(), ToPySpecs(v.state_specs())};
  }

  // Collective: commits the current step of `module`; returns the generation committed.
  uint64_t Commit(const std::string& module) {
    const ClientRef c = Get("commit");
    absl::StatusOr<uint64_t> generation;
    {
      py::gil_scoped_release release;
      generation = c->Commit(module);
    }
    return Unwrap(std::move(generation));
  }

  // Collective: `values` (float32 or float64 values, as bytes) reduced over the ranks by
  // `op` ("sum", "max", "min"); returns the reduction's bytes.
  py::bytes AllReduce(const std::string& values, bool float64, const std::string& op) {
    client::ValuesReduceOp o;
    if (op == "sum") {
      o = client::ValuesReduceOp::kSum;
    } else if (op == "max") {
      o = client::ValuesReduceOp::kMax;
    } else if (op == "min") {
      o = client::ValuesReduceOp::kMin;
    } else {
      throw StatusError(absl::InvalidArgumentError(
          absl::StrCat("all_reduce: op \"", op, "\", expected \"sum\", \"max\" or \"min\"")));
    }
    const size_t item = float64 ? sizeof(double) : sizeof(float);
    if (values.size() % item != 0) {
      throw StatusError(absl::InvalidArgumentError(
          absl::StrCat("all_reduce: ", values.size(), " bytes are not whole values")));
    }
    std::string out = values;
    const ClientRef c = Get("all_reduce");
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = float64 ? c->AllReduce(reinterpret_cast<double*>(out.data()), out.size() / item, o)
                       : c->AllReduce(reinterpret_cast<float*>(out.data()), out.size() / item, o);
    }
    if (!status.ok()) throw StatusError(status);
    return py::bytes(out);
  }

  // Collective: rank `root`'s `data` to every rank (each passes as many bytes).
  py::bytes Broadcast(const std::string& data, int root) {
    std::string out = data;
    const ClientRef c = Get("broadcast");
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = c->Broadcast(out.data(), out.size(), root);
    }
    if (!status.ok()) throw StatusError(status);
    return py::bytes(out);
  }

  // Collective: publishes `module`'s committed step as the next version of `name`.
  client::PublishedVersion Publish(const std::string& module, const std::string& name,
                                   const std::string& dtype, const std::vector<int64_t>& uids,
                                   const std::string& token, int device) {
    const client::PublishOptions options = MakePublishOptions(dtype, uids, token, device);
    const ClientRef c = Get("publish");
    absl::StatusOr<client::PublishedVersion> v;
    {
      py::gil_scoped_release release;
      v = c->Publish(module, name, options);
    }
    return Unwrap(std::move(v));
  }

  // Checkpoints (not collective; one rank asks its daemon). kind: "save", "load", "import".
  // Returns a dict: generation, bytes, files, ranks, unused_tensors, path, and
  // progress_error: the exception `progress` raised (None if it did not). `progress` (None or
  // a callable) gets (done_bytes, total_bytes) on this thread each time the daemon reports;
  // after it raised it is not called again and the operation runs to its end (the daemon does
  // not cut a checkpoint short), so the caller learns the outcome before the exception.
  py::dict Checkpoint(const std::string& kind, const std::string& module, const std::string& path,
                      const py::object& progress) {
    const ClientRef c = Get(kind == "save" ? "save_checkpoint" : "load_checkpoint");
    absl::StatusOr<flatshard::client::Client::CheckpointInfo> info;
    std::optional<py::error_already_set> raised;  // touched with the GIL held only
    flatshard::client::Client::CheckpointProgressFn report;
    if (!progress.is_none()) {
      report = [&progress, &raised](int64_t done, int64_t total) {
        py::gil_scoped_acquire gil;
        if (raised) return;
        try {
          progress(done, total);
        } catch (py::error_already_set& e) {
          raised.emplace(std::move(e));
        }
      };
    }
    {
      py::gil_scoped_release release;
      if (kind == "save") {
        info = c->SaveCheckpoint(module, path, report);
      } else if (kind == "load") {
        info = c->LoadCheckpoint(module, path, report);
      } else {
        info = c->ImportSafetensors(module, path, report);
      }
    }
    const flatshard::client::Client::CheckpointInfo i = Unwrap(std::move(info));
    py::dict out;
    out["generation"] = i.generation;
    out["bytes"] = i.bytes;
    out["files"] = i.files;
    out["ranks"] = i.ranks;
    out["unused_tensors"] = i.unused_tensors;
    out["path"] = i.path;
    out["progress_error"] = raised ? raised->value() : py::none();
    return out;
  }

  void Leave() {
    const ClientRef c = Get("leave");
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = c->Leave();
    }
    Check(status);
  }

  // Destroys the C++ Client (its lease ends) once no call in flight uses it.
  void Close() {
    std::shared_ptr<Client> c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      c = std::move(client_);
    }
    py::gil_scoped_release release;
    c.reset();
  }

  bool closed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return client_ == nullptr;
  }
  std::vector<std::string> registered_modules() const {
    return Get("registered_modules")->registered_modules();
  }
  bool joined() const {
    std::shared_ptr<Client> p = Peek();
    if (p == nullptr) return false;
    const ClientRef c(std::move(p));
    return c->joined();
  }
  // None while the lease is open (or before Join); (code name, message) once it ended.
  py::object lease_status() const {
    const absl::Status s = Get("lease_status")->lease_status();
    if (s.ok()) return py::none();
    return py::make_tuple(absl::StatusCodeToString(s.code()), std::string(s.message()));
  }
  int64_t segment_map_calls() const { return Get("segment_map_calls")->segment_map_calls(); }
  int64_t ipc_open_calls() const { return Get("ipc_open_calls")->ipc_open_calls(); }
  std::string address() const { return Get("address")->options().address; }
  bool simulated_gpus() const { return device_as_host_; }

 private:
  static ReduceOp ParseOp(const std::string& op) {
    if (op == "avg") return ReduceOp::kAvg;
    if (op == "sum") return ReduceOp::kSum;
    throw StatusError(absl::InvalidArgumentError(
        absl::StrCat("reduce-scatter: op must be \"avg\" or \"sum\", got \"", op, "\"")));
  }

  std::shared_ptr<Client> Peek() const {
    std::lock_guard<std::mutex> lock(mu_);
    return client_;
  }
  ClientRef Get(const char* what) const {
    std::shared_ptr<Client> c = Peek();
    if (c == nullptr) {
      throw StatusError(
          absl::FailedPreconditionError(absl::StrCat(what, ": the Client was closed")));
    }
    return ClientRef(std::move(c));
  }

  std::shared_ptr<const Plan> FindPlan(const std::string& module) const {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = plans_.find(module);
    return it == plans_.end() ? nullptr : it->second;
  }

  mutable std::mutex mu_;  // never held across a call into the Client
  std::shared_ptr<Client> client_;
  std::map<std::string, std::shared_ptr<const Plan>> plans_;
  bool device_as_host_ = false;
};

}  // namespace
}  // namespace flatshard::python

PYBIND11_MODULE(_C, m) {
  using namespace flatshard;          // NOLINT: DType and its helpers
  using namespace flatshard::python;  // NOLINT: the binding's own classes
  m.doc() = "flatshard's binding of the C++ client library (use the flatshard package)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object exc = py::module_::import("flatshard.errors")
                           .attr("_from_status")(absl::StatusCodeToString(e.status().code()),
                                                 std::string(e.status().message()));
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });
  DefineHostBuffer(m);
  DefineWeights(m);

  py::class_<PyClient, std::shared_ptr<PyClient>>(m, "Client")
      .def(py::init<std::string, double, double, int, double, double, std::string, std::string,
                    std::string, uintptr_t, bool>(),
           py::arg("address"), py::arg("call_timeout"), py::arg("join_timeout"),
           py::arg("max_attempts"), py::arg("initial_backoff"), py::arg("max_backoff"),
           py::arg("tls_ca_file"), py::arg("tls_cert_file"), py::arg("tls_key_file"),
           py::arg("cuda_stream"), py::arg("simulated_gpus"))
      .def("join", &PyClient::Join)
      .def("register", &PyClient::Register)
      .def("summon", &PyClient::Summon)
      .def("summon_async", &PyClient::StartSummon)
      .def("begin_reduce_scatter", &PyClient::BeginReduceScatter)
      .def("finish_async", &PyClient::FinishAsync)
      .def("shard_views", &PyClient::ShardViewsOf)
      .def("commit", &PyClient::Commit)
      .def("all_reduce", &PyClient::AllReduce, py::arg("values"), py::arg("float64"), py::arg("op"))
      .def("broadcast", &PyClient::Broadcast, py::arg("data"), py::arg("root"))
      .def("register_state", &PyClient::RegisterState)
      .def("checkpoint", &PyClient::Checkpoint, py::arg("kind"), py::arg("module"), py::arg("path"),
           py::arg("progress") = py::none())
      .def("publish", &PyClient::Publish, py::arg("module"), py::arg("name"), py::arg("dtype"),
           py::arg("reader_uids"), py::arg("reader_token"), py::arg("device") = -1)
      .def("leave", &PyClient::Leave)
      .def("close", &PyClient::Close)
      .def_property_readonly("closed", &PyClient::closed)
      .def_property_readonly("registered_modules", &PyClient::registered_modules)
      .def_property_readonly("joined", &PyClient::joined)
      .def_property_readonly("lease_status", &PyClient::lease_status)
      .def_property_readonly("segment_map_calls", &PyClient::segment_map_calls)
      .def_property_readonly("ipc_open_calls", &PyClient::ipc_open_calls)
      .def_property_readonly("address", &PyClient::address)
      .def_property_readonly("simulated_gpus", &PyClient::simulated_gpus);

  py::class_<PySummoned, std::shared_ptr<PySummoned>>(m, "Summoned")
      .def("end", &PySummoned::End)
      .def("describe", &PySummoned::Describe, py::arg("grads") = false)
      .def("dlpack", &PySummoned::Dlpack, py::arg("grads") = false, py::arg("raw") = false)
      .def("numpy", &PySummoned::Numpy, py::arg("grads") = false)
      .def("memoryviews", &PySummoned::Memoryviews, py::arg("grads") = false)
      .def("flat", &PySummoned::Flat, py::arg("unit"), py::arg("grads") = false)
      .def_property_readonly("ended", &PySummoned::ended)
      .def_property_readonly("generation", &PySummoned::generation)
      .def_property_readonly("has_views", &PySummoned::has_views)
      .def_property_readonly("units", &PySummoned::units)
      .def_property_readonly("note", &PySummoned::note)
      .def_property_readonly("id", &PySummoned::id)
      .def_property_readonly("module", &PySummoned::module);

  py::class_<PyPendingSummon, std::shared_ptr<PyPendingSummon>>(m, "PendingSummon")
      .def("wait", &PyPendingSummon::Wait)
      .def_property_readonly("ready", &PyPendingSummon::ready);

  py::class_<PyFinishingReduceScatter, std::shared_ptr<PyFinishingReduceScatter>>(
      m, "FinishingReduceScatter")
      .def("wait", &PyFinishingReduceScatter::Wait)
      .def_property_readonly("ready", &PyFinishingReduceScatter::ready)
      .def_property_readonly("unit", &PyFinishingReduceScatter::unit);

  py::class_<PyPendingReduceScatter, std::shared_ptr<PyPendingReduceScatter>>(
      m, "PendingReduceScatter")
      .def("finish", &PyPendingReduceScatter::Finish)
      .def("flat", &PyPendingReduceScatter::Flat)
      .def("flat_memoryview", &PyPendingReduceScatter::FlatMemoryview)
      .def("describe", &PyPendingReduceScatter::Describe)
      .def("dlpack", &PyPendingReduceScatter::Dlpack)
      .def_property_readonly("unit", &PyPendingReduceScatter::unit)
      .def_property_readonly("numel", &PyPendingReduceScatter::numel)
      .def_property_readonly("finished", &PyPendingReduceScatter::finished);

  py::class_<PyUnitShard>(m, "UnitShard")
      .def_readonly("unit", &PyUnitShard::unit)
      .def_property_readonly("dtype_name",
                             [](const PyUnitShard& s) { return std::string(DTypeName(s.dtype)); })
      .def_readonly("shard_numel", &PyUnitShard::shard_numel)
      .def_readonly("shard_offset", &PyUnitShard::shard_offset)
      .def_readonly("device", &PyUnitShard::device)
      .def_property_readonly("has_grad", [](const PyUnitShard& s) { return s.grad != nullptr; })
      .def("shard_dlpack", [](const PyUnitShard& s) { return s.Capsule(s.data); })
      .def("grad_dlpack",
           [](const PyUnitShard& s) -> py::object {
             if (s.grad == nullptr) return py::none();
             return s.Capsule(s.grad);
           })
      .def("shard_numpy",
           [](const PyUnitShard& s) {
             return ToNumpy(Region{s.data, {s.shard_numel}, s.dtype, s.device}, s.keep, true,
                            s.device_as_host);
           })
      .def("grad_numpy",
           [](const PyUnitShard& s) -> py::object {
             if (s.grad == nullptr) return py::none();
             return ToNumpy(Region{s.grad, {s.shard_numel}, s.dtype, s.device}, s.keep, true,
                            s.device_as_host);
           })
      .def("shard_memoryview",
           [](const PyUnitShard& s) {
             return ToMemoryview(Region{s.data, {s.shard_numel}, s.dtype, s.device}, s.keep, true,
                                 s.device_as_host);
           })
      .def("grad_memoryview",
           [](const PyUnitShard& s) -> py::object {
             if (s.grad == nullptr) return py::none();
             return ToMemoryview(Region{s.grad, {s.shard_numel}, s.dtype, s.device}, s.keep, true,
                                 s.device_as_host);
           })
      .def_property_readonly("state_names", &PyUnitShard::StateNames)
      .def("state_dtype_name",
           [](const PyUnitShard& s, const std::string& name) {
             return std::string(DTypeName(s.State(name).dtype));
           })
      // `raw`: a device buffer's capsule as a real GPU client gets it, also on a client of
      // simulated GPUs (tests of the device path).
      .def(
          "state_dlpack",
          [](const PyUnitShard& s, const std::string& name, bool raw) {
            const client::StateView& v = s.State(name);
            return ToDlpack(Region{v.data, {v.numel}, v.dtype, v.device}, s.keep,
                            s.device_as_host && !raw);
          },
          py::arg("name"), py::arg("raw") = false)
      .def("state_numpy", [](const PyUnitShard& s, const std::string& name) {
        const client::StateView& v = s.State(name);
        return ToNumpy(Region{v.data, {v.numel}, v.dtype, v.device}, s.keep, true,
                       s.device_as_host);
      });

  py::class_<PyRegistered, std::shared_ptr<PyRegistered>>(m, "Registered")
      .def_readonly("module", &PyRegistered::module)
      .def_readonly("plan_json", &PyRegistered::plan_json)
      .def_readonly("shards", &PyRegistered::shards)
      .def_readonly("init_summon", &PyRegistered::init_summon)
      .def_readonly("generation", &PyRegistered::generation)
      .def_readonly("state_specs", &PyRegistered::state_specs);

  py::class_<PyShardViews>(m, "ShardViews")
      .def_readonly("shards", &PyShardViews::shards)
      .def_readonly("generation", &PyShardViews::generation)
      .def_readonly("state_specs", &PyShardViews::state_specs);

  m.def("describe_dlpack", &DescribeDlpack, py::arg("capsule"),
        "Describes an unconsumed DLPack capsule (tests of the device path).");
  m.def("numpy_dtype_name", [](const std::string& name) {
    const std::optional<DType> d = ParseDType(name);
    if (!d) throw std::invalid_argument("unknown dtype " + name);
    return NumpyDTypeName(*d);
  });
}
