#include "server/service/admin_service_impl.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/alarm.h>
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "server/collective/backend_registry.h"
#include "server/gpu/device_pool.h"
#include "server/group/group.h"
#include "server/metrics/daemon_metrics.h"

namespace flatshard::server {
namespace {

grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// A Drain refused before it starts.
class RefusedDrain final : public grpc::ServerWriteReactor<v1::DrainProgress> {
 public:
  explicit RefusedDrain(const absl::Status& status) { Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

// OK when the caller may change the daemon (AdminServiceOptions::access).
absl::Status CheckOperator(const access::AccessControl* access, grpc::CallbackServerContext* ctx,
                           absl::string_view what) {
  if (access == nullptr) return absl::OkStatus();
  absl::StatusOr<int64_t> uid = access->CallerUid(ctx->peer());
  if (!uid.ok()) return uid.status();
  if (*uid == access::kRemoteUid || *uid == 0 || *uid == static_cast<int64_t>(::geteuid())) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "uid ", *uid, " may not ", what, " (only root and the daemon's uid ", ::geteuid(), " may)"));
}

std::string StatusText(const absl::Status& status) {
  return status.ok() ? std::string("OK") : status.ToString();
}

// A group's sticky status as `groups` and `pending` show it: a failure whose only cause is a
// rank that called Leave is no error of the group (it waits for the rank to join again), so
// it reads LEFT rather than UNAVAILABLE; a lost lease stays UNAVAILABLE.
std::string GroupStatusText(const absl::Status& status) {
  if (absl::IsUnavailable(status) &&
      absl::StrContains(status.message(),
                        absl::StrCat(internal::kSessionEndedMarker, internal::kLeftTheGroup))) {
    return absl::StrCat("LEFT: ", status.message());
  }
  return StatusText(status);
}

struct LogLevel {
  LogSeverity severity = LogSeverity::kInfo;
  int verbosity = 0;
};

// In SetLogLevel's words: "error", "warning", "info", "debug" or "vN".
std::string LogLevelName(LogLevel level) {
  switch (level.severity) {
    case LogSeverity::kFatal:
      return "fatal";
    case LogSeverity::kError:
      return "error";
    case LogSeverity::kWarning:
      return "warning";
    case LogSeverity::kInfo:
      break;
  }
  if (level.verbosity <= 0) return "info";
  if (level.verbosity == 1) return "debug";
  return absl::StrCat("v", level.verbosity);
}

// Severity names as common/logging.h parses them; "debug" and "vN" also raise the verbosity.
absl::StatusOr<LogLevel> ParseLogLevel(const std::string& given) {
  const std::string name = absl::AsciiStrToLower(given);
  if (name == "debug") return LogLevel{LogSeverity::kInfo, 1};
  if (name.size() == 2 && name[0] == 'v' && absl::ascii_isdigit(name[1])) {
    return LogLevel{LogSeverity::kInfo, name[1] - '0'};
  }
  absl::StatusOr<LogSeverity> severity = ParseLogSeverity(name);
  if (!severity.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("log level must be error, warning, info, debug or v0..v9, got '", given, "'"));
  }
  return LogLevel{*severity, 0};
}

// Streams the work in flight every poll until none is left or the deadline passes. One
// operation (a write or an alarm) is outstanding at a time; Finish ends it.
class DrainReactor final : public grpc::ServerWriteReactor<v1::DrainProgress> {
 public:
  DrainReactor(GroupManager* groups, absl::Duration timeout, absl::Duration poll)
      : groups_(groups), start_(absl::Now()), deadline_(start_ + timeout), poll_(poll) {
    Next();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
      return;
    }
    if (finishing_) {
      Finish(grpc::Status::OK);
      return;
    }
    Wait();
  }
  void OnCancel() override { cancelled_ = true; }
  void OnDone() override { delete this; }

 private:
  // The next look after `poll_`; a fresh alarm each time (the fired one may still be running
  // its callback, which holds its own reference).
  void Wait() {
    alarm_ = std::make_unique<grpc::Alarm>();
    alarm_->Set(absl::ToChronoTime(absl::Now() + poll_), [this](bool) { Next(); });
  }

  void Next() {
    if (cancelled_) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "drain cancelled by the client"));
      return;
    }
    const GroupManager::Stats stats = groups_->GetStats();
    if (stats.shutting_down) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "flatshardd is shutting down"));
      return;
    }
    const absl::Time now = absl::Now();
    const bool done =
        stats.open_summons == 0 && stats.pending_collectives == 0 && stats.pending_joins == 0;
    const bool timed_out = !done && now >= deadline_;
    const bool changed = !written_ || stats.open_summons != progress_.open_summons() ||
                         stats.pending_collectives != progress_.pending_collectives() ||
                         stats.pending_joins != progress_.pending_joins();
    progress_.set_open_summons(stats.open_summons);
    progress_.set_pending_collectives(stats.pending_collectives);
    progress_.set_pending_joins(stats.pending_joins);
    progress_.set_elapsed_seconds(absl::ToDoubleSeconds(now - start_));
    progress_.set_done(done);
    progress_.set_timed_out(timed_out);
    finishing_ = done || timed_out;
    // A message when something changed, at the end, and at least every second otherwise.
    if (finishing_ || changed || now - last_write_ >= absl::Seconds(1)) {
      written_ = true;
      last_write_ = now;
      StartWrite(&progress_);
      return;
    }
    Wait();
  }

  GroupManager* const groups_;
  const absl::Time start_;
  const absl::Time deadline_;
  const absl::Duration poll_;
  std::atomic<bool> cancelled_{false};
  // Touched by one callback at a time (the single outstanding operation orders them).
  v1::DrainProgress progress_;
  bool written_ = false;
  bool finishing_ = false;
  absl::Time last_write_ = absl::InfinitePast();
  std::unique_ptr<grpc::Alarm> alarm_;
};

// Runs a checkpoint save or load on a thread of its own and streams its progress: a message
// every 200 ms while it runs and when its phase changes, the result last, within a tick (10 ms)
// of the work's end: a result waiting for the next 200 ms message would add 100 ms on average
// to every call (a fifth of a 1 GiB load). One operation (a write or an alarm) is outstanding
// at a time.
class CheckpointReactor final : public grpc::ServerWriteReactor<v1::CheckpointProgress> {
 public:
  using Work = std::function<absl::StatusOr<GroupManager::CheckpointResult>(
      GroupManager::CheckpointProgress*)>;
  // `kind` ("save", "load", "import") labels the checkpoint metrics.
  CheckpointReactor(Work work, std::string dir, absl::string_view kind)
      : start_(absl::Now()), dir_(std::move(dir)) {
    state_ = std::make_shared<Shared>();
    thread_ = std::thread([state = state_, work = std::move(work), kind, start = start_] {
      absl::StatusOr<GroupManager::CheckpointResult> r = work(&state->progress);
      // The bytes the caller's report shows (CheckpointInfo::bytes): the stream's total.
      metrics::RecordCheckpoint(kind, r.status().code(), absl::Now() - start,
                                state->progress.total_bytes.load());
      absl::MutexLock lock(&state->mu);
      state->result = std::move(r);
      state->finished = true;
    });
    Next();
  }
  ~CheckpointReactor() override {
    if (thread_.joinable()) thread_.join();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      // The client went away; the work finishes on its own (it cannot be cut short safely).
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
      return;
    }
    if (finishing_) {
      Finish(grpc::Status::OK);
      return;
    }
    Wait();
  }
  void OnDone() override { delete this; }

 private:
  struct Shared {
    GroupManager::CheckpointProgress progress;
    absl::Mutex mu;
    bool finished = false;
    absl::StatusOr<GroupManager::CheckpointResult> result;
  };
  static const char* PhaseName(int phase) {
    switch (phase) {
      case GroupManager::CheckpointProgress::kWaiting:
        return "waiting";
      case GroupManager::CheckpointProgress::kVerifying:
        return "verifying";
      case GroupManager::CheckpointProgress::kWriting:
        return "writing";
      case GroupManager::CheckpointProgress::kLoading:
        return "loading";
      default:
        return "done";
    }
  }
  // The next tick (replacing the alarm inside its own callback is safe: gRPC keeps the alarm's
  // state alive until its callback returns).
  void Wait() {
    alarm_ = std::make_unique<grpc::Alarm>();
    alarm_->Set(absl::ToChronoTime(absl::Now() + absl::Milliseconds(10)), [this](bool) { Tick(); });
  }
  void Tick() {
    bool finished;
    {
      absl::MutexLock lock(&state_->mu);
      finished = state_->finished;
    }
    if (finished || state_->progress.phase.load() != last_phase_ ||
        absl::Now() - last_write_ >= absl::Milliseconds(200)) {
      Next();
    } else {
      Wait();
    }
  }
  void Next() {
    last_write_ = absl::Now();
    last_phase_ = state_->progress.phase.load();
    bool finished;
    absl::StatusOr<GroupManager::CheckpointResult> result;
    {
      absl::MutexLock lock(&state_->mu);
      finished = state_->finished;
      if (finished) result = state_->result;
    }
    msg_.Clear();
    msg_.set_phase(PhaseName(last_phase_));
    msg_.set_done_bytes(state_->progress.done_bytes.load());
    msg_.set_total_bytes(state_->progress.total_bytes.load());
    msg_.set_elapsed_seconds(absl::ToDoubleSeconds(absl::Now() - start_));
    if (finished) {
      if (!result.ok()) {
        Finish(ToGrpcStatus(result.status()));
        return;
      }
      msg_.set_phase("done");
      msg_.set_done(true);
      msg_.set_generation(result->generation);
      msg_.set_files(result->files);
      msg_.set_dir(dir_);
      msg_.set_ranks(result->ranks);
      msg_.set_unused_tensors(result->unused_tensors);
      finishing_ = true;
    }
    StartWrite(&msg_);
  }

  const absl::Time start_;
  const std::string dir_;
  std::shared_ptr<Shared> state_;
  std::thread thread_;
  v1::CheckpointProgress msg_;
  bool finishing_ = false;
  std::unique_ptr<grpc::Alarm> alarm_;
  absl::Time last_write_;  // of the last progress message
  int last_phase_ = -1;    // the phase it reported
};

class RefusedCheckpoint final : public grpc::ServerWriteReactor<v1::CheckpointProgress> {
 public:
  RefusedCheckpoint(const absl::Status& status, absl::string_view kind) {
    metrics::RecordCheckpoint(kind, status.code(), absl::ZeroDuration(), 0);
    Finish(ToGrpcStatus(status));
  }
  void OnDone() override { delete this; }
};

}  // namespace

AdminServiceImpl::AdminServiceImpl(GroupManager* groups, AdminServiceOptions options)
    : groups_(groups), options_(std::move(options)) {
  collective::BackendRegistry registry;
  if (collective::RegisterBuiltinBackends(registry).ok()) backends_ = registry.Names();
  node_ = options_.node;
  if (node_.empty()) {
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    node_ = host;
  }
}

grpc::ServerUnaryReactor* AdminServiceImpl::ListPendingCollectives(
    grpc::CallbackServerContext* ctx, const v1::ListPendingCollectivesRequest* request,
    v1::ListPendingCollectivesResponse* response) {
  std::vector<GroupManager::GroupCollectives> groups = groups_->ListCollectives(request->group());
  if (!request->group().empty() && groups.empty()) {
    return Answer(
        ctx, absl::NotFoundError(absl::StrCat("this daemon hosts no group ", request->group())));
  }
  for (const GroupManager::GroupCollectives& g : groups) {
    v1::GroupCollectives* out = response->add_groups();
    out->set_group(g.group);
    out->set_world_size(g.world_size);
    out->set_epoch(g.epoch);
    for (int32_t r : g.local_ranks) out->add_local_ranks(r);
    out->set_status(GroupStatusText(g.status));
    for (const collective::PendingOpInfo& op : g.pending) {
      v1::PendingCollective* p = out->add_pending();
      p->set_op_seq(op.op_seq);
      p->set_kind(std::string(collective::CollectiveKindName(op.kind)));
      p->set_unit(op.unit);
      p->set_bytes(op.bytes);
      p->set_name(op.name);
      for (int r : op.arrived_ranks) p->add_arrived_ranks(r);
      for (int r : op.missing_ranks) p->add_missing_ranks(r);
      p->set_age_seconds(absl::ToDoubleSeconds(op.age));
      p->set_running(op.running);
    }
  }
  return Answer(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::GetStatus(grpc::CallbackServerContext* ctx,
                                                      const v1::GetStatusRequest* /*request*/,
                                                      v1::GetStatusResponse* response) {
  response->set_version(FS_VERSION_STRING);
  response->set_uptime_seconds(absl::ToDoubleSeconds(absl::Now() - options_.start_time));
  for (const std::string& b : backends_) response->add_backends(b);
  response->set_peer_address(options_.peer_address);
  response->set_node(node_);
  response->set_state_dir(options_.state_dir);
  response->set_pid(::getpid());
  MemoryUsage usage;
  usage.limit_bytes = std::numeric_limits<int64_t>::max();
  if (options_.store != nullptr) usage = options_.store->Usage();
  for (int k = 0; k < kNumBufferKinds; ++k) {
    v1::MemoryKindUsage* m = response->add_memory();
    m->set_kind(std::string(BufferKindName(static_cast<BufferKind>(k))));
    m->set_bytes(usage.bytes_by_kind[k]);
  }
  response->set_memory_total_bytes(usage.total_bytes);
  response->set_memory_limit_bytes(
      usage.limit_bytes == std::numeric_limits<int64_t>::max() ? -1 : usage.limit_bytes);
  response->set_buffers(usage.buffers);
  if (options_.store != nullptr) {
    for (const std::shared_ptr<gpu::DevicePool>& pool : options_.store->options().device_pools) {
      if (pool == nullptr) continue;
      const gpu::DevicePoolUsage u = pool->Usage();
      v1::GpuMemory* g = response->add_gpus();
      g->set_device(pool->device());
      g->set_uuid(pool->device_uuid());
      g->set_reserved_bytes(u.reserved_bytes);
      g->set_in_use_bytes(u.in_use_bytes);
      g->set_limit_bytes(u.limit_bytes == std::numeric_limits<int64_t>::max() ? -1 : u.limit_bytes);
      g->set_slabs(u.slabs);
      g->set_buffers(u.blocks);
    }
  }
  const GroupManager::Stats stats = groups_->GetStats();
  response->set_groups(stats.groups);
  response->set_clients(stats.sessions);
  response->set_draining(stats.draining);
  return Answer(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::ListGroups(grpc::CallbackServerContext* ctx,
                                                       const v1::ListGroupsRequest* /*request*/,
                                                       v1::ListGroupsResponse* response) {
  for (const GroupManager::GroupInfo& g : groups_->ListGroups()) {
    v1::GroupInfo* out = response->add_groups();
    out->set_group(g.group);
    out->set_world_size(g.world_size);
    out->set_epoch(g.epoch);
    out->set_coordinator(g.coordinator);
    for (int32_t r : g.local_ranks) out->add_local_ranks(r);
    for (int32_t r : g.joined_ranks) out->add_joined_ranks(r);
    for (const std::string& m : g.registered_modules) out->add_registered_modules(m);
    out->set_status(GroupStatusText(g.status));
    for (const auto& [rank, state] : g.rank_states) {
      v1::RankState* r = out->add_ranks();
      r->set_rank(rank);
      r->set_state(state);
    }
  }
  return Answer(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::ListUnits(grpc::CallbackServerContext* ctx,
                                                      const v1::ListUnitsRequest* request,
                                                      v1::ListUnitsResponse* response) {
  if (request->group().empty()) {
    return Answer(ctx, absl::InvalidArgumentError("ListUnits needs a group"));
  }
  absl::StatusOr<std::vector<GroupManager::ModuleUnits>> modules = groups_->ListUnits(
      request->group(),
      request->has_module() ? std::optional<std::string>(request->module()) : std::nullopt);
  if (!modules.ok()) return Answer(ctx, modules.status());
  const absl::Time now = absl::Now();
  response->set_group(request->group());
  for (const GroupManager::ModuleUnits& m : *modules) {
    v1::ModuleUnits* out = response->add_modules();
    out->set_module(m.module);
    out->set_initialized(m.initialized);
    out->set_generation(m.generation);
    for (const GroupManager::UnitInfo& u : m.units) {
      v1::UnitStatus* unit = out->add_units();
      unit->set_unit(u.unit);
      unit->set_module(u.module);
      for (const GroupManager::UnitRankInfo& r : u.ranks) {
        v1::UnitRank* rank = unit->add_ranks();
        rank->set_rank(r.rank);
        rank->set_state(r.summoned ? "SUMMONED" : "IDLE");
        rank->set_shard_bytes(r.shard_bytes);
        rank->set_grad_bytes(r.grad_bytes);
        rank->set_unsharded_bytes(r.unsharded_bytes);
        rank->set_state_bytes(r.state_bytes);
      }
      if (!u.last_op.op.empty()) {
        unit->set_last_op(u.last_op.op);
        unit->set_last_op_rank(u.last_op.rank);
        unit->set_last_op_age_seconds(absl::ToDoubleSeconds(now - u.last_op.at));
        unit->set_last_op_ok(u.last_op.ok);
      }
    }
  }
  return Answer(ctx, absl::OkStatus());
}

grpc::ServerWriteReactor<v1::DrainProgress>* AdminServiceImpl::Drain(
    grpc::CallbackServerContext* ctx, const v1::DrainRequest* request) {
  if (absl::Status s = CheckOperator(options_.access, ctx, "drain flatshardd"); !s.ok()) {
    return new RefusedDrain(s);
  }
  {
    absl::MutexLock lock(&drain_mu_);
    groups_->StartDrain();
    if (options_.on_drain) options_.on_drain(true);
  }
  const absl::Duration timeout = absl::Milliseconds(std::max<int64_t>(0, request->timeout_ms()));
  return new DrainReactor(groups_, timeout, options_.drain_poll);
}

grpc::ServerUnaryReactor* AdminServiceImpl::Undrain(grpc::CallbackServerContext* ctx,
                                                    const v1::UndrainRequest* /*request*/,
                                                    v1::UndrainResponse* response) {
  if (absl::Status s = CheckOperator(options_.access, ctx, "undrain flatshardd"); !s.ok()) {
    return Answer(ctx, s);
  }
  if (groups_->GetStats().shutting_down) {
    return Answer(ctx, absl::FailedPreconditionError(
                           "flatshardd is shutting down; a daemon that stops cannot be undrained"));
  }
  absl::MutexLock lock(&drain_mu_);
  response->set_was_draining(groups_->StopDrain());
  if (response->was_draining() && options_.on_drain) options_.on_drain(false);
  return Answer(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminServiceImpl::SetLogLevel(grpc::CallbackServerContext* ctx,
                                                        const v1::SetLogLevelRequest* request,
                                                        v1::SetLogLevelResponse* response) {
  const std::string previous = LogLevelName({MinLogSeverity(), Verbosity()});
  response->set_previous(previous);
  response->set_level(previous);
  if (request->level().empty()) return Answer(ctx, absl::OkStatus());
  if (absl::Status s = CheckOperator(options_.access, ctx, "change the log level"); !s.ok()) {
    return Answer(ctx, s);
  }
  absl::StatusOr<LogLevel> level = ParseLogLevel(request->level());
  if (!level.ok()) return Answer(ctx, level.status());
  response->set_level(LogLevelName(*level));
  // The change is logged under whichever of the two levels shows it.
  const bool shown_before = MinLogSeverity() <= LogSeverity::kInfo;
  if (shown_before) FS_LOG(INFO) << "log level " << previous << " -> " << response->level();
  SetMinLogSeverity(level->severity);
  SetVerbosity(level->verbosity);
  if (!shown_before) FS_LOG(INFO) << "log level " << previous << " -> " << response->level();
  return Answer(ctx, absl::OkStatus());
}

// Who asks an admin call that acts on a group: the kernel's uid over the Unix socket, remote
// (-1) over TCP; root and the daemon's uid are privileged (may act on any group). Without
// access control every caller is privileged.
struct AdminCaller {
  int64_t uid = access::kRemoteUid;
  bool privileged = false;
};
static absl::StatusOr<AdminCaller> AdminCallerOf(const access::AccessControl* access,
                                                 grpc::CallbackServerContext* ctx) {
  AdminCaller caller;
  caller.privileged = access == nullptr;
  if (access != nullptr) {
    absl::StatusOr<int64_t> uid = access->CallerUid(ctx->peer());
    if (!uid.ok()) return uid.status();
    caller.uid = *uid;
    caller.privileged = *uid == 0 || *uid == static_cast<int64_t>(::geteuid());
  }
  return caller;
}

grpc::ServerUnaryReactor* AdminServiceImpl::DeleteGroup(grpc::CallbackServerContext* ctx,
                                                        const v1::DeleteGroupRequest* request,
                                                        v1::DeleteGroupResponse* response) {
  if (request->group().empty()) {
    return Answer(ctx, absl::InvalidArgumentError("DeleteGroup needs a group"));
  }
  // Root and the daemon's uid may delete any group; others only their own (GroupManager checks).
  absl::StatusOr<AdminCaller> caller = AdminCallerOf(options_.access, ctx);
  if (!caller.ok()) return Answer(ctx, caller.status());
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto body = [this, reactor, request, response, caller = *caller] {
    absl::StatusOr<GroupManager::DeletedGroup> deleted =
        groups_->DeleteGroup(request->group(), caller.uid, caller.privileged);
    if (deleted.ok()) {
      response->set_group(deleted->group);
      for (const std::string& m : deleted->modules) response->add_modules(m);
      response->set_freed_bytes(deleted->freed_bytes);
      response->set_freed_buffers(deleted->freed_buffers);
    }
    reactor->Finish(ToGrpcStatus(deleted.status()));
  };
  // Posted: the group's segments are unmapped and unlinked (0.5 s a GiB), its records removed.
  options_.workers->Post("DeleteGroup", std::move(body));
  return reactor;
}

static absl::Status CheckpointCaller(const access::AccessControl* access,
                                     grpc::CallbackServerContext* ctx,
                                     GroupManager::CheckpointArgs* args) {
  absl::StatusOr<AdminCaller> caller = AdminCallerOf(access, ctx);
  if (!caller.ok()) return caller.status();
  args->uid = caller->uid;
  args->privileged = caller->privileged;
  return absl::OkStatus();
}

grpc::ServerWriteReactor<v1::CheckpointProgress>* AdminServiceImpl::SaveCheckpoint(
    grpc::CallbackServerContext* ctx, const v1::SaveCheckpointRequest* request) {
  GroupManager::CheckpointArgs args;
  args.group = request->group();
  args.module = request->module();
  args.dir = request->dir();
  if (request->timeout_ms() > 0) args.wait = absl::Milliseconds(request->timeout_ms());
  if (args.group.empty()) {
    return new RefusedCheckpoint(absl::InvalidArgumentError("SaveCheckpoint needs a group"),
                                 "save");
  }
  if (absl::Status s = CheckpointCaller(options_.access, ctx, &args); !s.ok()) {
    return new RefusedCheckpoint(s, "save");
  }
  return new CheckpointReactor(
      [groups = groups_, args](GroupManager::CheckpointProgress* p) {
        return groups->SaveCheckpoint(args, p);
      },
      args.dir, "save");
}

grpc::ServerWriteReactor<v1::CheckpointProgress>* AdminServiceImpl::LoadCheckpoint(
    grpc::CallbackServerContext* ctx, const v1::LoadCheckpointRequest* request) {
  GroupManager::CheckpointArgs args;
  args.group = request->group();
  args.module = request->module();
  args.dir = request->dir();
  args.safetensors = request->safetensors();
  if (request->timeout_ms() > 0) args.wait = absl::Milliseconds(request->timeout_ms());
  if (args.group.empty()) {
    return new RefusedCheckpoint(absl::InvalidArgumentError("LoadCheckpoint needs a group"),
                                 request->safetensors().empty() ? "load" : "import");
  }
  if (absl::Status s = CheckpointCaller(options_.access, ctx, &args); !s.ok()) {
    return new RefusedCheckpoint(s, args.safetensors.empty() ? "load" : "import");
  }
  const std::string from = args.dir.empty() ? args.safetensors : args.dir;
  return new CheckpointReactor(
      [groups = groups_, args](GroupManager::CheckpointProgress* p) {
        return groups->LoadCheckpoint(args, p);
      },
      from, args.safetensors.empty() ? "load" : "import");
}

}  // namespace flatshard::server
