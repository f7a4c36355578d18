#include "server/peer/peer_client.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <map>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "flatshard/v1/peer_service.grpc.pb.h"
#include "server/peer/peer_proto.h"
#include "server/peer/pinger.h"

namespace flatshard::server::peer {
namespace {

// Depart and ReportFailure are best effort; they should not linger.
constexpr absl::Duration kBestEffortTimeout = absl::Seconds(10);
// The destructor waits at most this long for gRPC to hand back cancelled calls and streams,
// and for events already running.
constexpr absl::Duration kShutdownWait = absl::Seconds(5);

absl::Status Unreachable(const std::string& coordinator, absl::string_view why) {
  return absl::UnavailableError(absl::StrCat("coordinator ", coordinator, " unreachable: ", why));
}

class WatchStream;

// The client whose event or `done` callback this thread is running, if any: its destructor,
// called from such a callback, must not wait for that callback to return.
thread_local const void* tls_in_callback = nullptr;

// Marks the current thread as inside a callback of `state` for its lifetime.
class CallbackScope {
 public:
  explicit CallbackScope(const void* state) : saved_(tls_in_callback) { tls_in_callback = state; }
  ~CallbackScope() { tls_in_callback = saved_; }

 private:
  const void* saved_;
};

// A unary call in flight: gRPC needs its context and messages until the callback runs.
struct UnaryCall {
  std::string rendezvous_with;  // the coordinator of a pending Rendezvous; "" for other calls
  grpc::ClientContext ctx;
  v1::RendezvousRequest rendezvous_request;
  v1::RendezvousResponse rendezvous_response;
  v1::DepartRequest depart_request;
  v1::DepartResponse depart_response;
  v1::ReportFailureRequest report_request;
  v1::ReportFailureResponse report_response;
  absl::AnyInvocable<void(absl::StatusOr<PeerTable>)> done;
};

}  // namespace

// What the client's callbacks share with it. Held by shared_ptr so that a gRPC callback that
// outlives a bounded destructor wait still finds valid memory.
struct ClientState {
  ClientState(DaemonIdentity self, PeerOptions options, PeerEvents* events)
      : self(std::move(self)), options(std::move(options)), events(events) {}

  // Runs `f` unless the client is closing; the destructor waits for running ones.
  template <typename F>
  void Emit(F&& f) {
    {
      absl::MutexLock lock(&mu);
      if (closed) return;
      ++active_events;
    }
    {
      CallbackScope scope(this);
      f(events);
    }
    absl::MutexLock lock(&mu);
    --active_events;
  }

  // The stub of `address`. `fresh_if_failing`: a channel in TRANSIENT_FAILURE (the
  // coordinator was down, e.g. restarted on the same port; gRPC then waits out a reconnect
  // backoff before trying again, and fails calls at once meanwhile) is replaced by a new one,
  // which connects at once: a rejoin reaches a coordinator that is back without delay.
  v1::PeerService::Stub* StubLocked(const std::string& address, bool fresh_if_failing = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_ptr<v1::PeerService::Stub>& stub = stubs[address];
    std::shared_ptr<grpc::Channel>& channel = channels[address];
    if (stub != nullptr && fresh_if_failing && channel != nullptr &&
        channel->GetState(/*try_to_connect=*/false) == GRPC_CHANNEL_TRANSIENT_FAILURE) {
      // Calls in flight on the old channel keep it; the stub stays alive for them.
      retired_stubs.push_back(std::move(stub));
      stub = nullptr;
    }
    if (stub == nullptr) {
      std::shared_ptr<grpc::ChannelCredentials> creds =
          options.credentials ? options.credentials : grpc::InsecureChannelCredentials();
      grpc::ChannelArguments args;
      // Bounded reconnect backoff (gRPC's default grows to 120 s): a coordinator that comes
      // back is found within a second by the streams and calls that wait for it.
      // (Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC also takes it as the time a connection
      // attempt may take, and a loaded host needs more than a fraction of a second.)
      args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
      args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
      channel = grpc::CreateCustomChannel(address, creds, args);
      stub = v1::PeerService::NewStub(channel);
    }
    return stub.get();
  }

  void RemoveWatch(const std::string& coordinator, const WatchStream* stream);

  const DaemonIdentity self;
  const PeerOptions options;
  PeerEvents* const events;

  absl::Mutex mu;
  bool closed ABSL_GUARDED_BY(mu) = false;
  int active_events ABSL_GUARDED_BY(mu) = 0;
  int live_streams ABSL_GUARDED_BY(mu) = 0;  // streams gRPC has not called OnDone for
  bool heartbeat_thread_done ABSL_GUARDED_BY(mu) = false;
  std::map<std::string, std::unique_ptr<v1::PeerService::Stub>> stubs ABSL_GUARDED_BY(mu);
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels ABSL_GUARDED_BY(mu);
  // Stubs replaced by StubLocked(fresh_if_failing); kept while calls may use them.
  std::vector<std::unique_ptr<v1::PeerService::Stub>> retired_stubs ABSL_GUARDED_BY(mu);
  // Departs in flight per (coordinator, group, rank), and the rendezvous of that rank that
  // wait for them: a rank that leaves and joins again must reach the coordinator in that
  // order (two asynchronous calls, possibly on different channels; a Depart processed after
  // the rejoin's Rendezvous would abort it, "departed").
  using RankKey = std::tuple<std::string, std::string, int>;
  std::map<RankKey, int> departing ABSL_GUARDED_BY(mu);
  std::map<RankKey, std::vector<absl::AnyInvocable<void()>>> after_depart ABSL_GUARDED_BY(mu);
  std::map<std::string, std::shared_ptr<WatchStream>> watches ABSL_GUARDED_BY(mu);
  absl::flat_hash_set<std::shared_ptr<UnaryCall>> calls ABSL_GUARDED_BY(mu);
  // (coordinator, group) -> newest epoch this daemon has: pushes of older tables are dropped.
  std::map<std::pair<std::string, std::string>, uint64_t> known_epochs ABSL_GUARDED_BY(mu);
};

namespace {

// The Watch stream to one coordinator. Owns itself until OnDone. A hold keeps gRPC from
// finishing the stream while the heartbeat thread may still start a write; it is released once
// the read side has ended and no write is in flight.
class WatchStream final : public grpc::ClientBidiReactor<v1::WatchRequest, v1::WatchEvent> {
 public:
  WatchStream(std::shared_ptr<ClientState> state, std::string coordinator)
      : state_(std::move(state)), coordinator_(std::move(coordinator)), last_heard_(absl::Now()) {
    internal::ToProto(state_->self, hello_.mutable_daemon());
  }

  void Start(v1::PeerService::Stub* stub, std::shared_ptr<WatchStream> self) {
    self_ = std::move(self);
    stub->async()->Watch(&ctx_, this);
    AddHold();
    StartWrite(&hello_);  // `writing_` is true from construction: see there
    StartRead(&event_);
    StartCall();
  }

  // From the heartbeat thread: a heartbeat, unless a write is in flight (then one follows it).
  void SendHeartbeat() {
    {
      absl::MutexLock lock(&mu_);
      if (read_ended_) return;
      if (writing_) {
        heartbeat_pending_ = true;
        return;
      }
      writing_ = true;
    }
    StartWrite(&heartbeat_);
  }

  absl::Time last_heard() {
    absl::MutexLock lock(&mu_);
    return last_heard_;
  }

  // The coordinator answered a Ping (Pinger): it is alive, as if a message had arrived.
  void Heard() {
    absl::MutexLock lock(&mu_);
    last_heard_ = absl::Now();
  }

  // Silent too long: reports the coordinator lost (once) and cancels the stream.
  void DeclareLost(absl::string_view why) {
    {
      absl::MutexLock lock(&mu_);
      if (quiet_ || lost_) return;
      lost_ = true;
    }
    state_->RemoveWatch(coordinator_, this);
    state_->Emit(
        [&](PeerEvents* e) { e->OnCoordinatorLost(coordinator_, Unreachable(coordinator_, why)); });
    ctx_.TryCancel();
  }

  // Unwatch or destruction: ends the stream without OnCoordinatorLost.
  void CloseQuietly() {
    {
      absl::MutexLock lock(&mu_);
      quiet_ = true;
    }
    ctx_.TryCancel();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      bool release;
      {
        absl::MutexLock lock(&mu_);
        read_ended_ = true;
        release = !writing_ && !hold_released_;
        if (release) hold_released_ = true;
      }
      if (release) RemoveHold();
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      last_heard_ = absl::Now();
    }
    switch (event_.event_case()) {
      case v1::WatchEvent::kTable: {
        PeerTable table = internal::FromProto(event_.table());
        bool newer;
        {
          absl::MutexLock lock(&state_->mu);
          uint64_t& known = state_->known_epochs[{coordinator_, table.group}];
          newer = table.epoch > known;
          if (newer) known = table.epoch;
        }
        if (newer) state_->Emit([&](PeerEvents* e) { e->OnTable(coordinator_, table); });
        break;
      }
      case v1::WatchEvent::kFailure: {
        const v1::GroupFailure& f = event_.failure();
        const absl::Status status = internal::StatusFromProto(f);
        const std::string group = f.group();
        const uint64_t epoch = f.epoch();
        state_->Emit([&](PeerEvents* e) { e->OnGroupFailed(coordinator_, group, epoch, status); });
        break;
      }
      default:
        break;  // heartbeat
    }
    StartRead(&event_);
  }

  void OnWriteDone(bool ok) override {
    bool again = false, release = false;
    {
      absl::MutexLock lock(&mu_);
      if (ok && heartbeat_pending_ && !read_ended_) {
        heartbeat_pending_ = false;
        again = true;
      } else {
        writing_ = false;
        release = read_ended_ && !hold_released_;
        if (release) hold_released_ = true;
      }
    }
    if (again) {
      StartWrite(&heartbeat_);
    } else if (release) {
      RemoveHold();
    }
  }

  void OnDone(const grpc::Status& status) override {
    bool report;
    {
      absl::MutexLock lock(&mu_);
      report = !quiet_ && !lost_;
      lost_ = true;
    }
    state_->RemoveWatch(coordinator_, this);
    if (report) {
      const absl::Status lost =
          Unreachable(coordinator_,
                      status.ok() ? std::string("the watch stream ended") : status.error_message());
      state_->Emit([&](PeerEvents* e) { e->OnCoordinatorLost(coordinator_, lost); });
    }
    {
      absl::MutexLock lock(&state_->mu);
      --state_->live_streams;
    }
    std::shared_ptr<WatchStream> keep = std::move(self_);  // may be the last owner
  }

 private:
  const std::shared_ptr<ClientState> state_;
  const std::string coordinator_;
  std::shared_ptr<WatchStream> self_;
  grpc::ClientContext ctx_;
  v1::WatchRequest hello_;
  const v1::WatchRequest heartbeat_;  // empty: a heartbeat
  v1::WatchEvent event_;              // touched by the serialized read reactions only

  absl::Mutex mu_;
  absl::Time last_heard_ ABSL_GUARDED_BY(mu_);
  // True from construction: the stream is in ClientState::watches (where the heartbeat thread
  // finds it) before Start runs, and the hello must be its first and only write in flight. A
  // heartbeat that comes earlier waits for the hello's OnWriteDone (heartbeat_pending_).
  bool writing_ ABSL_GUARDED_BY(mu_) = true;
  bool heartbeat_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool read_ended_ ABSL_GUARDED_BY(mu_) = false;
  bool hold_released_ ABSL_GUARDED_BY(mu_) = false;
  bool quiet_ ABSL_GUARDED_BY(mu_) = false;
  bool lost_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

void ClientState::RemoveWatch(const std::string& coordinator, const WatchStream* stream) {
  absl::MutexLock lock(&mu);
  auto it = watches.find(coordinator);
  if (it == watches.end() || it->second.get() != stream) return;
  watches.erase(it);
  // A new stream may meet a restarted coordinator whose epochs start over.
  for (auto k = known_epochs.begin(); k != known_epochs.end();) {
    k = k->first.first == coordinator ? known_epochs.erase(k) : std::next(k);
  }
}

class PeerClient::Impl {
 public:
  explicit Impl(std::shared_ptr<ClientState> state)
      : state_(std::move(state)),
        pinger_(std::make_shared<Pinger>(state_->self.daemon_id, state_->options.peer_timeout)) {
    heartbeat_ = std::thread([state = state_, pinger = pinger_] { HeartbeatLoop(state, pinger); });
  }

  ~Impl() {
    std::vector<std::shared_ptr<WatchStream>> streams;
    std::vector<std::shared_ptr<UnaryCall>> calls;
    {
      absl::MutexLock lock(&state_->mu);
      state_->closed = true;
      for (auto& [address, s] : state_->watches) streams.push_back(s);
      state_->watches.clear();
      calls.assign(state_->calls.begin(), state_->calls.end());
    }
    for (const auto& s : streams) s->CloseQuietly();
    for (const auto& c : calls) c->ctx.TryCancel();
    pinger_->Close();

    ClientState* st = state_.get();
    // Destroyed from one of our own callbacks: that callback cannot finish first.
    const int own = tls_in_callback == st ? 1 : 0;
    const bool on_heartbeat_thread = heartbeat_.get_id() == std::this_thread::get_id();
    auto settled = [st, own, on_heartbeat_thread]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st->mu) {
      return (st->heartbeat_thread_done || on_heartbeat_thread) && st->active_events <= own &&
             static_cast<int>(st->calls.size()) <= own && st->live_streams <= own;
    };
    bool ok;
    {
      absl::MutexLock lock(&st->mu);
      ok = st->mu.AwaitWithTimeout(absl::Condition(&settled), kShutdownWait);
    }
    // The heartbeat thread may be the one destroying us (from an event); it then exits on its
    // own. A thread stuck in an event is left behind rather than hanging the caller.
    if (on_heartbeat_thread || !ok) {
      if (!ok)
        FS_LOG(ERROR) << "peer client: gRPC calls or events still running after " << kShutdownWait
                      << "; not waiting for them";
      heartbeat_.detach();
    } else {
      heartbeat_.join();
    }
  }

  // Every interval: declares a stream silent for peer_timeout lost, else sends a heartbeat
  // on it and pings its coordinator (whichever answer comes first counts).
  static void HeartbeatLoop(std::shared_ptr<ClientState> state, std::shared_ptr<Pinger> pinger) {
    while (true) {
      std::vector<std::pair<std::shared_ptr<WatchStream>, v1::PeerService::Stub*>> streams;
      {
        absl::MutexLock lock(&state->mu);
        ClientState* st = state.get();
        auto closed = [st]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st->mu) { return st->closed; };
        state->mu.AwaitWithTimeout(absl::Condition(&closed), state->options.heartbeat_interval);
        if (state->closed) break;
        for (auto& [address, s] : state->watches) {
          streams.emplace_back(s, state->StubLocked(address));
        }
      }
      const absl::Time now = absl::Now();
      for (const auto& [s, stub] : streams) {
        const absl::Duration silent = now - s->last_heard();
        if (silent > state->options.peer_timeout) {
          s->DeclareLost(absl::StrCat("no message for ", absl::FormatDuration(silent)));
        } else {
          s->SendHeartbeat();
          pinger->Ping(s.get(), stub, [weak = std::weak_ptr<WatchStream>(s)] {
            if (auto alive = weak.lock()) alive->Heard();
          });
        }
      }
    }
    absl::MutexLock lock(&state->mu);
    state->heartbeat_thread_done = true;
  }

  void EnsureWatch(const std::string& coordinator) {
    std::shared_ptr<WatchStream> stream;
    v1::PeerService::Stub* stub;
    {
      absl::MutexLock lock(&state_->mu);
      if (state_->closed || state_->watches.contains(coordinator)) return;
      stub = state_->StubLocked(coordinator);
      stream = std::make_shared<WatchStream>(state_, coordinator);
      state_->watches[coordinator] = stream;
      ++state_->live_streams;
    }
    stream->Start(stub, stream);
  }

  // Registers a call so the destructor can cancel it; null once closing.
  v1::PeerService::Stub* Begin(const std::string& coordinator,
                               const std::shared_ptr<UnaryCall>& call,
                               bool fresh_if_failing = false) {
    absl::MutexLock lock(&state_->mu);
    if (state_->closed) return nullptr;
    state_->calls.insert(call);
    return state_->StubLocked(coordinator, fresh_if_failing);
  }

  static void End(const std::shared_ptr<ClientState>& state,
                  const std::shared_ptr<UnaryCall>& call) {
    absl::MutexLock lock(&state->mu);
    state->calls.erase(call);
  }

  const std::shared_ptr<ClientState> state_;
  // Shared with the heartbeat thread, which may outlive a destructor that runs on it.
  const std::shared_ptr<Pinger> pinger_;
  std::thread heartbeat_;
};

PeerClient::PeerClient(DaemonIdentity self, PeerOptions options, PeerEvents* events)
    : self_(self),
      impl_(std::make_unique<Impl>(
          std::make_shared<ClientState>(std::move(self), std::move(options), events))) {}

PeerClient::~PeerClient() = default;

void PeerClient::Rendezvous(const std::string& coordinator, const std::string& group,
                            const std::string& token, int world_size, int rank, absl::Time deadline,
                            absl::AnyInvocable<void(absl::StatusOr<PeerTable>)> done,
                            uint64_t failed_epoch, const std::string& device_uuid,
                            const std::string& nccl_unique_id,
                            const std::vector<std::string>& registered_modules) {
  auto call = std::make_shared<UnaryCall>();
  call->done = std::move(done);
  v1::RendezvousRequest& req = call->rendezvous_request;
  req.set_group(group);
  req.set_token(token);
  req.set_world_size(world_size);
  req.set_rank(rank);
  req.set_failed_epoch(failed_epoch);
  req.set_device_uuid(device_uuid);
  req.set_nccl_unique_id(nccl_unique_id);
  for (const std::string& m : registered_modules) req.add_registered_modules(m);
  internal::ToProto(self_, req.mutable_daemon());
  call->ctx.set_deadline(absl::ToChronoTime(deadline));
  call->rendezvous_with = coordinator;

  // Registered before the watch is ensured, so a concurrent Unwatch either ran before (and the
  // watch is opened again here) or sees this call and keeps the stream.
  v1::PeerService::Stub* stub = impl_->Begin(coordinator, call, /*fresh_if_failing=*/true);
  if (stub == nullptr) {
    call->done(Unreachable(coordinator, "peer client shutting down"));
    return;
  }
  impl_->EnsureWatch(coordinator);  // before the call, so the coordinator can push what follows
  std::shared_ptr<ClientState> state = impl_->state_;
  // Sends the Rendezvous (now, or once a Depart of the same rank has ended).
  auto rpc = [state, call, coordinator, stub] {
    stub->async()->Rendezvous(
        &call->ctx, &call->rendezvous_request, &call->rendezvous_response,
        [state, call, coordinator](grpc::Status s) {
          absl::StatusOr<PeerTable> result;
          if (s.ok()) {
            result = internal::FromProto(call->rendezvous_response.table());
            absl::MutexLock lock(&state->mu);
            // Overwrites, not max: the coordinator may have forgotten the group and started over.
            state->known_epochs[{coordinator, result->group}] = result->epoch;
          } else if (s.error_code() == grpc::StatusCode::CANCELLED) {
            result = Unreachable(coordinator, "peer client shutting down");
          } else if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
            result = Unreachable(coordinator, s.error_message());
          } else if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
                     s.error_message() == "Deadline Exceeded") {
            // gRPC's own deadline fired: the coordinator never answered.
            result = absl::DeadlineExceededError(
                absl::StrCat("coordinator ", coordinator, ": no answer before the deadline"));
          } else {
            result = FromGrpcStatus(s);
          }
          {
            CallbackScope scope(state.get());
            call->done(std::move(result));
          }
          Impl::End(state, call);
        });
  };
  absl::AnyInvocable<void()> start = [state, call, coordinator, rpc = std::move(rpc)]() mutable {
    bool closed;
    {
      absl::MutexLock lock(&state->mu);
      closed = state->closed;
    }
    if (closed) {
      {
        CallbackScope scope(state.get());
        call->done(Unreachable(coordinator, "peer client shutting down"));
      }
      Impl::End(state, call);
      return;
    }
    rpc();
  };
  {
    absl::MutexLock lock(&state->mu);
    const ClientState::RankKey key{coordinator, group, rank};
    if (auto d = state->departing.find(key); d != state->departing.end() && d->second > 0) {
      state->after_depart[key].push_back(std::move(start));  // runs when the Depart ends
      return;
    }
  }
  start();
}

void PeerClient::Depart(const std::string& coordinator, const std::string& group,
                        const std::string& token, int rank) {
  auto call = std::make_shared<UnaryCall>();
  v1::DepartRequest& req = call->depart_request;
  req.set_group(group);
  req.set_token(token);
  req.set_rank(rank);
  req.set_daemon_id(self_.daemon_id);
  call->ctx.set_deadline(absl::ToChronoTime(absl::Now() + kBestEffortTimeout));
  v1::PeerService::Stub* stub = impl_->Begin(coordinator, call);
  if (stub == nullptr) return;
  std::shared_ptr<ClientState> state = impl_->state_;
  const ClientState::RankKey key{coordinator, group, rank};
  {
    absl::MutexLock lock(&state->mu);
    ++state->departing[key];
  }
  stub->async()->Depart(&call->ctx, &call->depart_request, &call->depart_response,
                        [state, call, coordinator, group, rank, key](grpc::Status s) {
                          if (!s.ok() && s.error_code() != grpc::StatusCode::CANCELLED) {
                            FS_LOG(WARNING) << "group=" << group << " rank=" << rank
                                            << ": depart at coordinator " << coordinator
                                            << " failed: " << FromGrpcStatus(s);
                          }
                          std::vector<absl::AnyInvocable<void()>> waiting;
                          {
                            absl::MutexLock lock(&state->mu);
                            if (--state->departing[key] == 0) {
                              state->departing.erase(key);
                              auto w = state->after_depart.find(key);
                              if (w != state->after_depart.end()) {
                                waiting = std::move(w->second);
                                state->after_depart.erase(w);
                              }
                            }
                          }
                          for (auto& start : waiting) start();
                          Impl::End(state, call);
                        });
}

void PeerClient::ReportFailure(const std::string& coordinator, const std::string& group,
                               const std::string& token, uint64_t epoch,
                               const absl::Status& status) {
  auto call = std::make_shared<UnaryCall>();
  v1::ReportFailureRequest& req = call->report_request;
  req.set_token(token);
  req.set_daemon_id(self_.daemon_id);
  internal::ToProto(group, epoch, status, req.mutable_failure());
  call->ctx.set_deadline(absl::ToChronoTime(absl::Now() + kBestEffortTimeout));
  v1::PeerService::Stub* stub = impl_->Begin(coordinator, call);
  if (stub == nullptr) return;
  std::shared_ptr<ClientState> state = impl_->state_;
  stub->async()->ReportFailure(&call->ctx, &call->report_request, &call->report_response,
                               [state, call, coordinator, group, epoch](grpc::Status s) {
                                 if (!s.ok() && s.error_code() != grpc::StatusCode::CANCELLED) {
                                   FS_LOG(WARNING)
                                       << "group=" << group << " epoch=" << epoch
                                       << ": failure report to coordinator " << coordinator
                                       << " failed: " << FromGrpcStatus(s);
                                 }
                                 Impl::End(state, call);
                               });
}

void PeerClient::Unwatch(const std::string& coordinator) {
  std::shared_ptr<WatchStream> stream;
  {
    absl::MutexLock lock(&impl_->state_->mu);
    auto it = impl_->state_->watches.find(coordinator);
    if (it == impl_->state_->watches.end()) return;
    // A rendezvous with it is under way (a group being formed again): the stream is in use.
    for (const auto& call : impl_->state_->calls) {
      if (call->rendezvous_with == coordinator) return;
    }
    stream = it->second;
  }
  stream->CloseQuietly();
  impl_->state_->RemoveWatch(coordinator, stream.get());
}

}  // namespace flatshard::server::peer
