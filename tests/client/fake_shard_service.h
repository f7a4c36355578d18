#pragma once
// An in-process stand-in for the daemon's ShardService, for client tests that need no
// flatshardd: it plans with the real planner, keeps every buffer in real shared-memory
// segments (ShmSegment::Create) and answers with MemoryHandles into them, as the daemon does.
// Single rank per Client; collectives complete at once. Tests steer it through the public
// fields under `mu` (scripted failures, lease behaviour) and read what it recorded.
//
//   FakeShardServer server;             // listens on a fresh unix socket
//   ClientOptions o; o.address = server.address();
//
// Buffer layout: all units' unsharded buffers share one segment, unit i at a 64-byte
// aligned offset that starts at kFirstOffset (so offsets are never 0); element k of unit i's
// buffer is summoned as (i + 1) * 1000 + k (float32 plans only). Shards, gradient shards and
// full gradients get one segment per unit, created at registration and reused, so a client
// in steady state needs no new mapping.
//
// Device mode (`device_memory`): every MemoryHandle also carries `cuda` (a FakeIpcHandle of
// its segment on GPU "GPU-fake-0", slab id "slab:<name>"), and Summon and the second phase of
// ReduceScatterGrads answer with a `ready` event (kReadyEventId), as the GPU backend does;
// a client opens them with FakeDeviceMemoryOpener and FakeCudaEventApi.
//
// Thread safety: the service is thread-safe (gRPC calls it from its own threads).

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/grpc_status.h"
#include "common/plan.h"
#include "common/planner.h"
#include "common/proto_convert.h"
#include "common/shm_segment.h"
#include "flatshard/v1/shard_service.grpc.pb.h"
#include "tests/client/fake_gpu.h"

namespace flatshard::client::testing {

class FakeShardService final
    : public v1::ShardService::WithCallbackMethod_Lease<v1::ShardService::Service> {
 public:
  static constexpr uint64_t kSession = 42;
  static constexpr uint64_t kFirstOffset = 128;
  static constexpr uint64_t kReadyEventId = 100;
  class LeaseReactor;

  struct Unit {
    PlanUnit plan;
    uint64_t offset = 0;  // in the unsharded (and summoned grad) segment
    ShmSegment shard;
    ShmSegment grad_shard;
    ShmSegment full_grad;
  };
  struct Module {
    Plan plan;
    std::vector<Unit> units;
    ShmSegment unsharded;
    ShmSegment grads;
  };

  absl::Mutex mu;
  // Scripted behaviour.
  int fail_join_unavailable ABSL_GUARDED_BY(mu) = 0;  // next N JoinGroup calls: UNAVAILABLE
  absl::Status join_error ABSL_GUARDED_BY(mu);        // then this, when not OK
  absl::Status summon_error ABSL_GUARDED_BY(mu);
  bool device_memory ABSL_GUARDED_BY(mu) = false;  // see "Device mode" above
  bool ack_lease ABSL_GUARDED_BY(mu) = false;      // send one LeaseResponse after the caller
  absl::Status refuse_lease ABSL_GUARDED_BY(mu);   // not OK: end new leases with it at once
  absl::Status break_lease ABSL_GUARDED_BY(mu);    // not OK: end open leases with it
  // Recorded.
  int join_calls ABSL_GUARDED_BY(mu) = 0;
  int leave_calls ABSL_GUARDED_BY(mu) = 0;
  int open_leases ABSL_GUARDED_BY(mu) = 0;
  int closed_leases ABSL_GUARDED_BY(mu) = 0;
  v1::Caller lease_caller ABSL_GUARDED_BY(mu);
  std::vector<uint64_t> ended_summons ABSL_GUARDED_BY(mu);
  std::vector<v1::SummonRequest> summons ABSL_GUARDED_BY(mu);
  std::vector<v1::EndSummonRequest> end_summons ABSL_GUARDED_BY(mu);
  std::vector<v1::ReduceScatterGradsRequest> reduce_scatters ABSL_GUARDED_BY(mu);
  float first_full_grad_at_finish ABSL_GUARDED_BY(mu) = 0;
  v1::InitMode last_init ABSL_GUARDED_BY(mu) = v1::INIT_MODE_UNSPECIFIED;
  int world_size ABSL_GUARDED_BY(mu) = 1;
  int rank ABSL_GUARDED_BY(mu) = 0;
  std::map<std::string, Module> modules ABSL_GUARDED_BY(mu);

  grpc::Status JoinGroup(grpc::ServerContext*, const v1::JoinGroupRequest* request,
                         v1::JoinGroupResponse* response) override {
    absl::MutexLock lock(&mu);
    ++join_calls;
    if (fail_join_unavailable > 0) {
      --fail_join_unavailable;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake: not ready");
    }
    if (!join_error.ok()) return ToGrpcStatus(join_error);
    world_size = request->world_size();
    rank = request->rank();
    response->set_session(kSession);
    for (const auto& [name, module] : modules) response->add_registered_modules(name);
    return grpc::Status::OK;
  }

  // The lease, as the daemon's: a callback stream (so that a half-close is seen), held until
  // the client half-closes or cancels it, or the test breaks it.
  grpc::ServerBidiReactor<v1::LeaseRequest, v1::LeaseResponse>* Lease(
      grpc::CallbackServerContext*) override;

  grpc::Status RegisterModule(grpc::ServerContext*, const v1::RegisterModuleRequest* request,
                              v1::RegisterModuleResponse* response) override {
    absl::MutexLock lock(&mu);
    if (grpc::Status s = CheckCaller(request->caller()); !s.ok()) return s;
    absl::StatusOr<Manifest> manifest = FromProto(request->manifest());
    if (!manifest.ok()) return ToGrpcStatus(manifest.status());
    absl::StatusOr<Policy> policy = FromProto(request->policy());
    if (!policy.ok()) return ToGrpcStatus(policy.status());
    PlanOptions options;
    options.world_size = world_size;
    absl::StatusOr<Plan> plan = BuildPlan(*manifest, *policy, options);
    if (!plan.ok()) return ToGrpcStatus(plan.status());
    if (modules.count(request->module()) > 0) {
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS, "fake: already registered");
    }
    Module& m = modules[request->module()];
    m.plan = *plan;
    uint64_t end = kFirstOffset;
    for (const PlanUnit& pu : m.plan.units) {
      Unit u;
      u.plan = pu;
      u.offset = end;
      const uint64_t item = ItemSize(pu.dtype);
      end = (end + pu.padded_numel * item + 63) / 64 * 64 + 64;
      if (absl::Status s = Create(u.shard, pu.shard_numel * item); !s.ok()) return ToGrpcStatus(s);
      if (absl::Status s = Create(u.grad_shard, pu.shard_numel * item); !s.ok()) {
        return ToGrpcStatus(s);
      }
      if (absl::Status s = Create(u.full_grad, pu.padded_numel * item); !s.ok()) {
        return ToGrpcStatus(s);
      }
      m.units.push_back(std::move(u));
    }
    if (absl::Status s = Create(m.unsharded, end); !s.ok()) return ToGrpcStatus(s);
    if (absl::Status s = Create(m.grads, end); !s.ok()) return ToGrpcStatus(s);
    *response->mutable_plan() = ToProto(m.plan);
    for (const Unit& u : m.units) AddShard(u, /*with_grad=*/false, response->add_shards());
    last_init = request->init();
    if (request->init() == v1::INIT_MODE_FROM_EVERY_RANK ||
        request->init() == v1::INIT_MODE_FROM_RANK0) {
      v1::SummonResponse* init = response->mutable_init_summon();
      init->set_summon(next_summon_++);
      const bool views = request->init() == v1::INIT_MODE_FROM_EVERY_RANK || rank == 0;
      for (const Unit& u : m.units) {
        init->add_unit_indices(u.plan.index);
        if (views) AddUnitView(m, u, /*with_grads=*/false, init->add_units());
      }
      if (device_memory) DeviceSummon(init);
    }
    if (device_memory) {
      for (v1::UnitShard& shard : *response->mutable_shards()) DeviceShard(&shard);
    }
    return grpc::Status::OK;
  }

  grpc::Status Summon(grpc::ServerContext*, const v1::SummonRequest* request,
                      v1::SummonResponse* response) override {
    absl::MutexLock lock(&mu);
    if (grpc::Status s = CheckCaller(request->caller()); !s.ok()) return s;
    summons.push_back(*request);
    if (!summon_error.ok()) return ToGrpcStatus(summon_error);
    auto it = modules.find(request->registered_module());
    if (it == modules.end()) return grpc::Status(grpc::StatusCode::NOT_FOUND, "fake: module");
    Module& m = it->second;
    response->set_summon(next_summon_++);
    const std::string& path = request->path();
    const bool views = !request->options().rank0_only() || rank == 0;
    for (const Unit& u : m.units) {
      const std::string& mod = u.plan.module;
      const bool selected = request->options().recurse()
                                ? path.empty() || mod == path || mod.rfind(path + ".", 0) == 0
                                : mod == path;
      if (!selected) continue;
      response->add_unit_indices(u.plan.index);
      if (!views) continue;
      FillUnsharded(m, u);
      AddUnitView(m, u, request->options().with_grads(), response->add_units());
    }
    if (response->unit_indices().empty()) response->set_note("fake: nothing unsharded");
    if (device_memory) DeviceSummon(response);
    return grpc::Status::OK;
  }

  grpc::Status EndSummon(grpc::ServerContext*, const v1::EndSummonRequest* request,
                         v1::EndSummonResponse*) override {
    absl::MutexLock lock(&mu);
    if (grpc::Status s = CheckCaller(request->caller()); !s.ok()) return s;
    ended_summons.push_back(request->summon());
    end_summons.push_back(*request);
    return grpc::Status::OK;
  }

  grpc::Status ReduceScatterGrads(grpc::ServerContext*,
                                  const v1::ReduceScatterGradsRequest* request,
                                  v1::ReduceScatterGradsResponse* response) override {
    absl::MutexLock lock(&mu);
    if (grpc::Status s = CheckCaller(request->caller()); !s.ok()) return s;
    reduce_scatters.push_back(*request);
    auto it = modules.find(request->registered_module());
    if (it == modules.end()) return grpc::Status(grpc::StatusCode::NOT_FOUND, "fake: module");
    for (const Unit& u : it->second.units) {
      if (u.plan.index != request->unit()) continue;
      if (request->begin()) {
        SetHandle(u.full_grad, 0, u.full_grad.size(), response->mutable_full_grad());
        if (device_memory) DeviceHandle(response->mutable_full_grad());
      } else {
        std::memcpy(&first_full_grad_at_finish, u.full_grad.data(), sizeof(float));
        if (device_memory) ReadyEvent(response->mutable_ready());
      }
      return grpc::Status::OK;
    }
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "fake: unit");
  }

  grpc::Status GetShardViews(grpc::ServerContext*, const v1::GetShardViewsRequest* request,
                             v1::GetShardViewsResponse* response) override {
    absl::MutexLock lock(&mu);
    if (grpc::Status s = CheckCaller(request->caller()); !s.ok()) return s;
    auto it = modules.find(request->registered_module());
    if (it == modules.end()) return grpc::Status(grpc::StatusCode::NOT_FOUND, "fake: module");
    for (const Unit& u : it->second.units) {
      AddShard(u, /*with_grad=*/true, response->add_shards());
      if (device_memory) DeviceShard(&response->mutable_shards()->at(response->shards_size() - 1));
    }
    return grpc::Status::OK;
  }

  grpc::Status Leave(grpc::ServerContext*, const v1::LeaveRequest* request,
                     v1::LeaveResponse*) override {
    absl::MutexLock lock(&mu);
    ++leave_calls;
    return CheckCaller(request->caller());
  }

 private:
  grpc::Status CheckCaller(const v1::Caller& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (c.session() != kSession || c.token() != "secret" || c.group() != "g") {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          absl::StrCat("fake: bad caller ", c.ShortDebugString()));
    }
    return grpc::Status::OK;
  }

  absl::Status Create(ShmSegment& segment, uint64_t bytes) {
    absl::StatusOr<ShmSegment> s = ShmSegment::Create(MakeSegmentName("fsclienttest"), bytes);
    if (!s.ok()) return s.status();
    segment = *std::move(s);
    return absl::OkStatus();
  }

  static void SetHandle(const ShmSegment& s, uint64_t offset, uint64_t bytes, v1::MemoryHandle* h) {
    h->set_segment(s.name());
    h->set_segment_bytes(s.size());
    h->set_offset(offset);
    h->set_bytes(bytes);
  }

  static void DeviceHandle(v1::MemoryHandle* h) {
    h->mutable_cuda()->set_ipc_handle(FakeIpcHandle(h->segment(), h->segment_bytes()));
    h->mutable_cuda()->set_device_uuid("GPU-fake-0");
    h->set_segment("slab:" + h->segment());  // a slab id, not an shm name
  }
  static void DeviceShard(v1::UnitShard* s) {
    if (s->has_shard()) DeviceHandle(s->mutable_shard());
    if (s->has_grad()) DeviceHandle(s->mutable_grad());
  }
  static void ReadyEvent(v1::CudaEvent* e) {
    e->set_id(kReadyEventId);
    e->set_ipc_handle(FakeCudaEventApi::Handle("daemon-ready"));
    e->set_device_uuid("GPU-fake-0");
  }
  static void DeviceSummon(v1::SummonResponse* r) {
    for (v1::UnitView& u : *r->mutable_units()) {
      if (u.has_params()) DeviceHandle(u.mutable_params());
      if (u.has_grads()) DeviceHandle(u.mutable_grads());
    }
    ReadyEvent(r->mutable_ready());
  }

  static void AddShard(const Unit& u, bool with_grad, v1::UnitShard* out) {
    out->set_unit(u.plan.index);
    SetHandle(u.shard, 0, u.shard.size(), out->mutable_shard());
    if (with_grad) {
      SetHandle(u.grad_shard, 0, u.grad_shard.size(), out->mutable_grad());
    }
  }

  static void AddUnitView(const Module& m, const Unit& u, bool with_grads, v1::UnitView* out) {
    const uint64_t bytes = u.plan.padded_numel * ItemSize(u.plan.dtype);
    out->set_unit(u.plan.index);
    SetHandle(m.unsharded, u.offset, bytes, out->mutable_params());
    if (with_grads) {
      SetHandle(m.grads, u.offset, bytes, out->mutable_grads());
    }
  }

  static void FillUnsharded(const Module& m, const Unit& u) {
    if (u.plan.dtype != DType::kFloat32) return;
    float* p = reinterpret_cast<float*>(static_cast<char*>(m.unsharded.data()) + u.offset);
    for (int64_t k = 0; k < u.plan.padded_numel; ++k) {
      p[k] = static_cast<float>((u.plan.index + 1) * 1000 + k);
    }
  }

  uint64_t next_summon_ ABSL_GUARDED_BY(mu) = 7;
};

// The fake service behind a gRPC server on a fresh unix socket.
// FakeShardService::Lease's stream. Ends once: by the client (half-close: OK, as the daemon
// after it ended the session; cancel), by a refused caller, or by `break_lease`, which a
// watcher thread waits for.
// FakeShardService::Lease's stream. Ends once: by the client (half-close: OK, as the daemon
// after it ended the session; cancel), by a refused caller, or by `break_lease`, which a
// watcher thread waits for. Finish runs outside the fake's lock, and after the ack's write.
class FakeShardService::LeaseReactor final
    : public grpc::ServerBidiReactor<v1::LeaseRequest, v1::LeaseResponse> {
 public:
  explicit LeaseReactor(FakeShardService* fake) : fake_(fake) { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      FinishOnce(opened_ ? grpc::Status::OK
                         : grpc::Status(grpc::StatusCode::CANCELLED, "no caller"));
      return;
    }
    if (!opened_) {
      bool ack = false;
      std::optional<grpc::Status> refused;
      {
        absl::MutexLock lock(&fake_->mu);
        if (request_.caller().session() != kSession) {
          refused = grpc::Status(grpc::StatusCode::NOT_FOUND, "fake: unknown session");
        } else if (!fake_->refuse_lease.ok()) {
          refused = ToGrpcStatus(fake_->refuse_lease);
        } else {
          fake_->lease_caller = request_.caller();
          ++fake_->open_leases;
          opened_ = true;
          ack = fake_->ack_lease;
          writing_ = ack;
        }
      }
      if (refused.has_value()) {
        FinishOnce(*refused);
        return;
      }
      watcher_ = std::thread([this] { WatchForBreak(); });
      if (ack) StartWrite(&ack_);
    }
    StartRead(&request_);
  }
  void OnWriteDone(bool) override {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&fake_->mu);
      writing_ = false;
      finish.swap(finish_after_write_);
    }
    if (finish.has_value()) Finish(*finish);
  }
  void OnCancel() override { FinishOnce(grpc::Status::CANCELLED); }
  void OnDone() override {
    {
      absl::MutexLock lock(&fake_->mu);
      finished_ = true;  // also ends the watcher when nothing finished the stream through us
      if (opened_) {
        --fake_->open_leases;
        ++fake_->closed_leases;
      }
    }
    if (watcher_.joinable()) watcher_.join();
    delete this;
  }

 private:
  void WatchForBreak() {
    grpc::Status broken;
    {
      absl::MutexLock lock(&fake_->mu);
      fake_->mu.Await(absl::Condition(
          +[](LeaseReactor* r) { return r->finished_ || !r->fake_->break_lease.ok(); }, this));
      if (finished_) return;
      broken = ToGrpcStatus(fake_->break_lease);
    }
    FinishOnce(broken);
  }
  void FinishOnce(const grpc::Status& status) {
    {
      absl::MutexLock lock(&fake_->mu);
      if (finished_) return;
      finished_ = true;
      if (writing_) {
        finish_after_write_ = status;  // OnWriteDone finishes
        return;
      }
    }
    Finish(status);
  }

  FakeShardService* const fake_;
  v1::LeaseRequest request_;
  v1::LeaseResponse ack_;
  bool opened_ = false;  // the reactor's serialized read callbacks, then OnDone
  // Under fake_->mu:
  bool writing_ = false;
  bool finished_ = false;
  std::optional<grpc::Status> finish_after_write_;
  std::thread watcher_;
};

inline grpc::ServerBidiReactor<v1::LeaseRequest, v1::LeaseResponse>* FakeShardService::Lease(
    grpc::CallbackServerContext*) {
  return new LeaseReactor(this);
}

class FakeShardServer {
 public:
  FakeShardServer() : FakeShardServer(std::string()) {}
  // Listens on unix socket `path` ("": a fresh one), e.g. that of a server destroyed before:
  // a daemon restarting at the same address.
  explicit FakeShardServer(std::string path) {
    static std::atomic<int> counter{0};
    path_ = !path.empty()
                ? std::move(path)
                : absl::StrCat("/tmp/fs_client_test.", ::getpid(), ".", counter++, ".sock");
    ::unlink(path_.c_str());
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + path_, grpc::InsecureServerCredentials());
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~FakeShardServer() {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server_->Wait();
    ::unlink(path_.c_str());
  }
  bool ok() const { return server_ != nullptr; }
  std::string address() const { return "unix:" + path_; }
  const std::string& path() const { return path_; }
  FakeShardService& service() { return service_; }

 private:
  std::string path_;
  FakeShardService service_;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace flatshard::client::testing
