#include "server/collective/ucx/ucx_backend.h"

#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/any_invocable.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/collective/deadline_timer.h"
#include "server/collective/hierarchical_algorithms.h"
#include "server/collective/inproc/inproc_transport.h"
#include "server/collective/op_descriptor.h"
#include "server/collective/ring_algorithms.h"
#include "server/collective/ucx/ucx_address.h"
#include "server/collective/ucx/ucx_endpoint.h"
#include "server/collective/ucx/ucx_tag.h"

namespace flatshard::collective {
namespace ucx {
namespace {

class Worker;
class UcxTransport;

// One endpoint to a remote worker, shared by every group that has ranks there.
struct Peer {
  Worker* worker = nullptr;
  std::string address;
  ucp_ep_h ep = nullptr;
  // UCP_ERR_HANDLING_MODE_PEER: UCX reports the peer's death. Without it (a peer on this host,
  // reached over shared memory), the heartbeats do, and an abort abandons stuck transfers.
  bool error_handling = true;
  ucs_status_t failure = UCS_OK;  // set once the endpoint failed; ep is then closed
  absl::flat_hash_map<const UcxTransport*, std::weak_ptr<UcxTransport>> users;
};

// One UCX send or receive. Holds its transport (and so the caller's buffer contract) until
// the UCX callback has run.
struct Request {
  Worker* worker = nullptr;
  std::shared_ptr<UcxTransport> transport;
  std::shared_ptr<Peer> peer;
  DoneCallback done;
  void* ucx = nullptr;
  bool recv = false;
  size_t bytes = 0;
  int src = 0;
  int dst = 0;
  MessageTag tag;
  ucs_status_t status = UCS_OK;
  ucp_tag_recv_info_t info{};
};

// A stray message of an aborted or closed group, received into scratch memory and dropped.
struct Drain {
  Worker* worker = nullptr;
  std::vector<uint8_t> buf;
  void* ucx = nullptr;
  bool finished = false;
};

struct GroupEntry {
  std::string group_id;
  uint64_t epoch = 0;
  const UcxTransport* id = nullptr;  // null once the transport is destroyed
  std::weak_ptr<UcxTransport> transport;
  bool draining = false;
  absl::Time drain_until = absl::InfiniteFuture();
};

std::string GroupName(absl::string_view id, uint64_t epoch) {
  return absl::StrCat("group ", id, " epoch ", epoch);
}

// The UCX context, worker and progress thread of one backend. Everything below the public
// Post/Shutdown runs on the progress thread only (STYLE §4: state changes on that thread).
class Worker {
 public:
  static absl::StatusOr<std::shared_ptr<Worker>> Create(const UcxBackendOptions& options);
  ~Worker();

  const std::string& address() const { return address_; }
  const UcxBackendOptions& options() const { return options_; }
  const std::shared_ptr<DeadlineTimer>& timer() const { return timer_; }

  // Queues `fn` for the progress thread and moves from it; false (fn untouched) once the
  // worker is shutting down.
  bool Post(absl::AnyInvocable<void()>& fn);
  // Runs `fn` on the progress thread and waits for it; false once shutting down.
  bool RunAndWait(absl::AnyInvocable<void()> fn);
  bool OnLoop() const { return std::this_thread::get_id() == thread_.get_id(); }
  // Aborts every group, closes endpoints (peers learn at once), joins the thread and frees
  // UCX. Not from the progress thread.
  void Shutdown();

  // --- progress thread only ---
  bool stopping() const { return stopping_; }
  absl::StatusOr<std::shared_ptr<Peer>> PeerFor(const std::string& address);
  absl::Status RegisterGroup(uint16_t hash, const std::string& group_id, uint64_t epoch,
                             const std::shared_ptr<UcxTransport>& transport);
  void GroupAborted(uint16_t hash, const UcxTransport* t);
  void GroupClosed(uint16_t hash, const UcxTransport* t);
  // Takes a request that ucp_*_nbx returned `r` for: completes it now or tracks it.
  void Submit(Request* req, ucs_status_ptr_t r);
  void CancelRecvsOf(const UcxTransport* t);
  // Finishes the transfers of aborted transport `t` still in flight (abort_grace after its
  // abort): their peers do not answer. See UcxBackendOptions::abort_grace.
  void FinishStuck(const UcxTransport* t, const std::string& group);
  // Marks `peer` failed with `status`, force-closes its endpoint (its transfers complete
  // with UCS_ERR_CANCELED) and aborts every group using it. Later groups get a new endpoint.
  void FailPeer(Peer* peer, ucs_status_t status);
  ucp_worker_h ucp() const { return worker_; }
  UcxBackendStats StatsOnLoop() const;

  static void SendCallback(void* request, ucs_status_t status, void* user_data);
  static void RecvCallback(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                           void* user_data);
  static void DrainCallback(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                            void* user_data);
  static void EndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);

 private:
  explicit Worker(UcxBackendOptions options) : options_(std::move(options)) {}
  absl::Status Init();
  void Loop();
  bool RunTasks();
  // Completions and endpoint failures collected during ucp_worker_progress; runs callbacks.
  bool ProcessEvents();
  void Complete(Request* req);
  void DrainStrays();
  void BeginShutdown();
  void Wake();

  const UcxBackendOptions options_;
  std::shared_ptr<DeadlineTimer> timer_ = std::make_shared<DeadlineTimer>();
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;  // EncodeUcxAddress(host_, worker address)
  std::string host_;
  int worker_fd_ = -1;
  int event_fd_ = -1;
  int epoll_fd_ = -1;
  std::thread thread_;

  absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> sleeping_{false};

  // Progress-thread state.
  bool stopping_ = false;
  bool stop_ = false;
  absl::flat_hash_map<std::string, std::shared_ptr<Peer>> peers_;
  std::vector<std::shared_ptr<Peer>> retired_;  // failed or closed; error callbacks may name them
  std::vector<std::pair<Peer*, ucs_status_t>> failed_peers_;
  absl::flat_hash_set<Request*> inflight_;
  std::vector<Request*> completed_;
  absl::flat_hash_set<Drain*> drains_;
  absl::flat_hash_map<uint16_t, GroupEntry> groups_;
  size_t dropped_ = 0;
};

// The Transport of one group on one backend: local pairs through InprocTransport, remote
// pairs through the worker. Transfer state lives on the progress thread; `first_` only makes
// every part of the transport agree on the abort reason.
class UcxTransport final : public Transport, public std::enable_shared_from_this<UcxTransport> {
 public:
  UcxTransport(std::shared_ptr<Worker> worker, const GroupSpec& spec, uint16_t hash,
               std::vector<std::shared_ptr<Peer>> peers)
      : worker_(std::move(worker)),
        group_(GroupName(spec.group_id, spec.epoch)),
        world_(spec.world_size),
        hash_(hash),
        peers_(std::move(peers)),
        inproc_(spec.world_size) {}

  ~UcxTransport() override {
    absl::AnyInvocable<void()> fn = [worker = worker_.get(), hash = hash_, id = this,
                                     peers = peers_] {
      for (const std::shared_ptr<Peer>& p : peers) {
        if (p != nullptr) p->users.erase(id);
      }
      worker->GroupClosed(hash, id);
    };
    worker_->Post(fn);  // nothing to unregister once the worker is gone
  }

  int world_size() const override { return world_; }
  void Send(int src, int dst, MessageTag tag, ConstBuffer data, DoneCallback done) override;
  void Recv(int dst, int src, MessageTag tag, MutableBuffer data, DoneCallback done) override;
  void Abort(absl::Status reason) override;

  // --- progress thread only ---
  void AbortOnLoop(const absl::Status& reason);
  void PeerFailed(const Peer& peer);
  // The status a finished UCX request reports to its caller.
  absl::Status Outcome(const Request& req) const;

 private:
  bool IsLocal(int rank) const { return peers_[rank] == nullptr; }
  absl::Status CheckRanks(int local, int other) const;
  void Remote(bool recv, int src, int dst, MessageTag tag, void* data, size_t bytes,
              DoneCallback done);
  void Start(Request* req, void* data);
  absl::Status PeerStatus(const Peer& peer) const;

  const std::shared_ptr<Worker> worker_;
  const std::string group_;
  const int world_;
  const uint16_t hash_;
  const std::vector<std::shared_ptr<Peer>> peers_;  // per rank; null for local ranks
  InprocTransport inproc_;

  absl::Mutex mu_;
  absl::Status first_ ABSL_GUARDED_BY(mu_);
  absl::Status sticky_;  // progress thread
};

// --- Worker ---------------------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<Worker>> Worker::Create(const UcxBackendOptions& options) {
  std::shared_ptr<Worker> w(new Worker(options));
  FS_RETURN_IF_ERROR(w->Init());
  w->thread_ = std::thread([raw = w.get()] { raw->Loop(); });
  return w;
}

absl::Status Worker::Init() {
  ucp_config_t* config = nullptr;
  // NULL env prefix and file: UCX reads UCX_* from the environment as it always does.
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) {
    return absl::UnavailableError(
        absl::StrCat("UCX: reading the configuration failed: ", ucs_status_string(s)));
  }
  // Same-host endpoints use shared memory (sysv, posix) without CMA (ucx_endpoint.h).
  for (const auto& [key, value] :
       WithEndpointTransports(options_.error_handling, options_.ucx_config)) {
    s = ucp_config_modify(config, key.c_str(), value.c_str());
    if (s != UCS_OK) {
      ucp_config_release(config);
      return absl::InvalidArgumentError(
          absl::StrCat("UCX: cannot set ", key, "=", value, ": ", ucs_status_string(s)));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.name = "flatshard";
  s = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (s != UCS_OK) {
    return absl::UnavailableError(absl::StrCat("UCX: ucp_init failed: ", ucs_status_string(s)));
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // Serialized, not single: the worker is created here and then used by the progress thread.
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  s = ucp_worker_create(context_, &wp, &worker_);
  if (s != UCS_OK) {
    return absl::UnavailableError(
        absl::StrCat("UCX: ucp_worker_create failed: ", ucs_status_string(s)));
  }
  ucp_address_t* addr = nullptr;
  size_t len = 0;
  s = ucp_worker_get_address(worker_, &addr, &len);
  if (s != UCS_OK) {
    return absl::UnavailableError(
        absl::StrCat("UCX: ucp_worker_get_address failed: ", ucs_status_string(s)));
  }
  host_ = LocalHostIdentity();
  address_ = EncodeUcxAddress(host_, absl::string_view(reinterpret_cast<const char*>(addr), len));
  ucp_worker_release_address(worker_, addr);
  s = ucp_worker_get_efd(worker_, &worker_fd_);
  if (s != UCS_OK) {
    return absl::UnavailableError(
        absl::StrCat("UCX: ucp_worker_get_efd failed: ", ucs_status_string(s)));
  }
  event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (event_fd_ < 0 || epoll_fd_ < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("UCX backend: ", std::strerror(errno)));
  }
  for (int fd : {worker_fd_, event_fd_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      return absl::InternalError(absl::StrCat("UCX backend: epoll_ctl: ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

Worker::~Worker() {
  // The loop frees UCX when it ends; a failed Init() leaves partial state here.
  if (thread_.joinable()) Shutdown();
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
  if (event_fd_ >= 0) close(event_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
}

void Worker::Wake() {
  uint64_t one = 1;
  ssize_t n = write(event_fd_, &one, sizeof(one));
  (void)n;  // EAGAIN means a wake-up is already pending
}

bool Worker::Post(absl::AnyInvocable<void()>& fn) {
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return false;
    tasks_.push_back(std::move(fn));
  }
  // The loop sets `sleeping_` before its last look at the queue, so this cannot miss it.
  if (sleeping_.load() && !OnLoop()) Wake();
  return true;
}

bool Worker::RunAndWait(absl::AnyInvocable<void()> fn) {
  FS_CHECK(!OnLoop()) << "RunAndWait from the UCX progress thread";
  absl::Notification done;
  absl::AnyInvocable<void()> task = [&fn, &done] {
    fn();
    done.Notify();
  };
  if (!Post(task)) return false;
  done.WaitForNotification();
  return true;
}

void Worker::Shutdown() {
  FS_CHECK(!OnLoop()) << "a UCX backend destroyed from its own callback";
  absl::AnyInvocable<void()> fn = [this] { BeginShutdown(); };
  Post(fn);
  thread_.join();
}

bool Worker::RunTasks() {
  bool any = false;
  while (true) {
    std::deque<absl::AnyInvocable<void()>> tasks;
    {
      absl::MutexLock lock(&mu_);
      tasks.swap(tasks_);
    }
    if (tasks.empty()) return any;
    any = true;
    for (auto& t : tasks) t();
  }
}

void Worker::Loop() {
  absl::Time last_progress = absl::Now();
  epoll_event events[2];
  while (!stop_) {
    bool busy = RunTasks();
    if (stop_) break;
    while (ucp_worker_progress(worker_) != 0) busy = true;
    if (ProcessEvents()) busy = true;
    if (!groups_.empty() || !drains_.empty()) DrainStrays();
    if (busy) {
      last_progress = absl::Now();
      continue;
    }
    const bool inflight = !inflight_.empty() || !drains_.empty();
    if (inflight && absl::Now() - last_progress < options_.poll_before_sleep) {
      sched_yield();  // two cores: let the rank threads run while polling
      continue;
    }
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
    sleeping_.store(true);
    {
      absl::MutexLock lock(&mu_);
      if (!tasks_.empty()) {
        sleeping_.store(false);
        continue;
      }
    }
    // With transfers in flight, wake up now and then even without events: a transport may
    // need progress calls that no fd reports. Idle, sleep until something arrives.
    epoll_wait(epoll_fd_, events, 2, inflight ? 1 : -1);
    sleeping_.store(false);
    uint64_t value;
    while (read(event_fd_, &value, sizeof(value)) > 0) {
    }
  }
  RunTasks();  // anything posted before `closed_` was set
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
  ucp_cleanup(context_);
  context_ = nullptr;
}

void Worker::SendCallback(void* /*request*/, ucs_status_t status, void* user_data) {
  auto* req = static_cast<Request*>(user_data);
  req->status = status;
  req->worker->completed_.push_back(req);
}

void Worker::RecvCallback(void* /*request*/, ucs_status_t status, const ucp_tag_recv_info_t* info,
                          void* user_data) {
  auto* req = static_cast<Request*>(user_data);
  req->status = status;
  if (info != nullptr) req->info = *info;
  req->worker->completed_.push_back(req);
}

void Worker::DrainCallback(void* /*request*/, ucs_status_t /*status*/,
                           const ucp_tag_recv_info_t* /*info*/, void* user_data) {
  static_cast<Drain*>(user_data)->finished = true;
}

void Worker::EndpointError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  // Inside ucp_worker_progress: only record; ProcessEvents acts on it.
  auto* peer = static_cast<Peer*>(arg);
  peer->worker->failed_peers_.emplace_back(peer, status);
}

void Worker::Submit(Request* req, ucs_status_ptr_t r) {
  if (UCS_PTR_IS_PTR(r)) {
    req->ucx = r;
    inflight_.insert(req);
    return;
  }
  req->status = UCS_PTR_STATUS(r);
  if (req->status == UCS_OK && !req->recv) req->info.length = req->bytes;
  Complete(req);
}

void Worker::Complete(Request* req) {
  inflight_.erase(req);
  if (req->ucx != nullptr) ucp_request_free(req->ucx);
  absl::Status status = req->transport->Outcome(*req);
  DoneCallback done = std::move(req->done);
  delete req;
  std::move(done)(std::move(status));
}

bool Worker::ProcessEvents() {
  bool any = false;
  // Endpoint failures first, so that the requests they fail report the peer, not a bare
  // UCX status.
  while (!failed_peers_.empty()) {
    any = true;
    std::vector<std::pair<Peer*, ucs_status_t>> failed;
    failed.swap(failed_peers_);
    for (auto& [peer, status] : failed) {
      FS_VLOG(1) << "UCX endpoint failed: " << ucs_status_string(status);
      FailPeer(peer, status);
    }
  }
  while (!completed_.empty()) {
    any = true;
    std::vector<Request*> done;
    done.swap(completed_);
    for (Request* req : done) Complete(req);
  }
  return any;
}

absl::StatusOr<std::shared_ptr<Peer>> Worker::PeerFor(const std::string& address) {
  auto it = peers_.find(address);
  if (it != peers_.end()) return it->second;
  FS_ASSIGN_OR_RETURN(UcxPeerAddress decoded, DecodeUcxAddress(address));
  auto peer = std::make_shared<Peer>();
  peer->worker = this;
  peer->address = address;
  peer->error_handling = WantsPeerErrorHandling(options_.error_handling, decoded, host_);
  const ucp_ep_params_t p =
      EndpointParams(decoded, peer->error_handling, &Worker::EndpointError, peer.get());
  ucs_status_t s = ucp_ep_create(worker_, &p, &peer->ep);
  if (s != UCS_OK) {
    return absl::UnavailableError(
        absl::StrCat("UCX: cannot create an endpoint to a peer: ", ucs_status_string(s)));
  }
  peers_.emplace(address, peer);
  return peer;
}

absl::Status Worker::RegisterGroup(uint16_t hash, const std::string& group_id, uint64_t epoch,
                                   const std::shared_ptr<UcxTransport>& transport) {
  auto it = groups_.find(hash);
  if (it != groups_.end() && it->second.id != nullptr) {
    const GroupEntry& g = it->second;
    if (g.group_id == group_id && g.epoch == epoch) {
      return absl::FailedPreconditionError(
          absl::StrCat(GroupName(group_id, epoch), " is already connected on this UCX backend"));
    }
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: its UCX tag hash 0x%04x collides with live %s on this backend; re-form the "
        "group with another epoch",
        GroupName(group_id, epoch), hash, GroupName(g.group_id, g.epoch)));
  }
  // A closed group that is only being drained gives way: its strays would have arrived long
  // ago, and a live group must not be refused for a dead one.
  GroupEntry& g = groups_[hash];
  g = GroupEntry{};
  g.group_id = group_id;
  g.epoch = epoch;
  g.id = transport.get();
  g.transport = transport;
  return absl::OkStatus();
}

void Worker::GroupAborted(uint16_t hash, const UcxTransport* t) {
  auto it = groups_.find(hash);
  if (it != groups_.end() && it->second.id == t) it->second.draining = true;
}

void Worker::GroupClosed(uint16_t hash, const UcxTransport* t) {
  auto it = groups_.find(hash);
  if (it == groups_.end() || it->second.id != t) return;
  it->second.id = nullptr;
  it->second.transport.reset();
  it->second.draining = true;
  it->second.drain_until = absl::Now() + options_.drain_for;
}

void Worker::FailPeer(Peer* peer, ucs_status_t status) {
  if (peer->failure != UCS_OK) return;
  peer->failure = status;
  auto it = peers_.find(peer->address);
  if (it != peers_.end() && it->second.get() == peer) {
    retired_.push_back(it->second);
    peers_.erase(it);
  }
  if (peer->ep != nullptr) {
    ucp_request_param_t p{};
    // UCX allows a forced close only with peer error handling; the others are flushed, which
    // completes at once for a dead same-host peer (nothing of it is in flight any more).
    if (peer->error_handling) {
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    }
    ucs_status_ptr_t r = ucp_ep_close_nbx(peer->ep, &p);
    if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);  // released by UCX when it completes
    peer->ep = nullptr;
  }
  std::vector<std::shared_ptr<UcxTransport>> users;
  for (auto& [id, weak] : peer->users) {
    if (auto t = weak.lock()) users.push_back(std::move(t));
  }
  for (auto& t : users) t->PeerFailed(*peer);
}

void Worker::FinishStuck(const UcxTransport* t, const std::string& group) {
  std::vector<Peer*> peers;
  std::vector<Request*> abandon;
  size_t stuck = 0;
  for (Request* req : inflight_) {
    if (req->transport.get() != t) continue;
    ++stuck;
    if (req->peer->error_handling) {
      if (std::find(peers.begin(), peers.end(), req->peer.get()) == peers.end()) {
        peers.push_back(req->peer.get());
      }
    } else {
      abandon.push_back(req);
    }
  }
  if (stuck == 0) return;
  FS_LOG(WARNING) << "UCX: " << stuck << " transfers of " << group << " still in flight "
                  << absl::FormatDuration(options_.abort_grace)
                  << " after its abort: their peers do not answer; closing " << peers.size()
                  << " endpoints, abandoning " << abandon.size()
                  << " transfers on same-host endpoints to UCX";
  for (Request* req : abandon) {
    // No callback comes for a freed request; UCX finishes (or drops) the transfer on its own.
    // A send's buffer is only read, and the shared-memory and CMA protocols of one host read
    // it from the peer's side, which fails once the peer is gone. A receive's buffer stays
    // still UCX's: a dead peer writes nothing more into it, and a rendezvous get that CMA
    // drives from this side fails once the peer is gone.
    ucp_request_free(req->ucx);
    req->ucx = nullptr;
    req->status = UCS_ERR_CANCELED;
    Complete(req);
  }
  for (Peer* peer : peers) FailPeer(peer, UCS_ERR_ENDPOINT_TIMEOUT);
}

void Worker::CancelRecvsOf(const UcxTransport* t) {
  for (Request* req : inflight_) {
    // A receive already moving data is not removed by UCX and completes normally.
    if (req->recv && req->transport.get() == t) ucp_request_cancel(worker_, req->ucx);
  }
}

void Worker::DrainStrays() {
  for (auto it = drains_.begin(); it != drains_.end();) {
    Drain* d = *it;
    if (!d->finished) {
      ++it;
      continue;
    }
    if (d->ucx != nullptr) ucp_request_free(d->ucx);
    delete d;
    drains_.erase(it++);
  }
  const absl::Time now = absl::Now();
  for (auto it = groups_.begin(); it != groups_.end();) {
    GroupEntry& g = it->second;
    if (!g.draining) {
      ++it;
      continue;
    }
    if (g.id == nullptr && now >= g.drain_until) {
      groups_.erase(it++);
      continue;
    }
    // Receiving what nobody will ask for completes the sender's request: a rendezvous send
    // to an aborted group would otherwise wait forever.
    ucp_tag_recv_info_t info;
    const uint64_t prefix = uint64_t{it->first} << 48;
    while (ucp_tag_message_h msg = ucp_tag_probe_nb(worker_, prefix, kGroupMask, 1, &info)) {
      auto* d = new Drain;
      d->worker = this;
      d->buf.resize(info.length);
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      p.cb.recv = &Worker::DrainCallback;
      p.user_data = d;
      ucs_status_ptr_t r = ucp_tag_msg_recv_nbx(worker_, d->buf.data(), info.length, msg, &p);
      ++dropped_;
      if (UCS_PTR_IS_PTR(r)) {
        d->ucx = r;
        drains_.insert(d);
      } else {
        delete d;
      }
    }
    ++it;
  }
}

void Worker::BeginShutdown() {
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  stopping_ = true;
  const absl::Status reason = absl::AbortedError("UCX backend destroyed");
  std::vector<std::shared_ptr<UcxTransport>> live;
  for (auto& [hash, g] : groups_) {
    if (auto t = g.transport.lock()) live.push_back(std::move(t));
  }
  for (auto& t : live) t->Abort(reason);
  live.clear();
  // Closing lets peers see their endpoint fail at once instead of after a keepalive timeout.
  // A flush would wait for sends a peer may never receive: those endpoints are forced.
  absl::flat_hash_set<const Peer*> sending;
  for (const Request* req : inflight_) {
    if (!req->recv) sending.insert(req->peer.get());
  }
  std::vector<void*> closing;
  for (auto& [address, peer] : peers_) {
    ucp_request_param_t p{};
    if (sending.contains(peer.get()) && peer->error_handling) {
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    }
    ucs_status_ptr_t r = ucp_ep_close_nbx(peer->ep, &p);
    if (UCS_PTR_IS_PTR(r)) closing.push_back(r);
    peer->ep = nullptr;
    peer->failure = UCS_ERR_CANCELED;
    retired_.push_back(peer);
  }
  peers_.clear();
  const absl::Time give_up = absl::Now() + absl::Seconds(2);
  auto closed = [&] {
    for (void* r : closing) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
    }
    return true;
  };
  while (absl::Now() < give_up && !(closed() && inflight_.empty())) {
    ucp_worker_progress(worker_);
    ProcessEvents();
  }
  // Messages nobody received yet (peers that ran ahead) would be reported as leaks by UCX.
  ucp_tag_recv_info_t info;
  while (ucp_tag_message_h msg = ucp_tag_probe_nb(worker_, 0, 0, 1, &info)) {
    std::vector<uint8_t> scratch(info.length);
    ucp_request_param_t p{};
    ucs_status_ptr_t r = ucp_tag_msg_recv_nbx(worker_, scratch.data(), info.length, msg, &p);
    while (UCS_PTR_IS_PTR(r) && ucp_request_check_status(r) == UCS_INPROGRESS &&
           absl::Now() < give_up) {
      ucp_worker_progress(worker_);
    }
    if (UCS_PTR_IS_PTR(r)) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS) break;  // scratch must outlive it
      ucp_request_free(r);
    }
  }
  for (void* r : closing) ucp_request_free(r);
  // What UCX still holds is abandoned with the worker; the callers hear of it now.
  std::vector<Request*> left(inflight_.begin(), inflight_.end());
  for (Request* req : left) {
    req->status = UCS_ERR_CANCELED;
    req->ucx = nullptr;
    Complete(req);
  }
  for (Drain* d : drains_) delete d;
  drains_.clear();
  groups_.clear();
  stop_ = true;
}

UcxBackendStats Worker::StatsOnLoop() const {
  UcxBackendStats s;
  s.endpoints = peers_.size();
  for (const auto& [address, peer] : peers_) {
    if (!peer->error_handling) ++s.same_host_endpoints;
  }
  for (const auto& [h, g] : groups_) {
    if (g.id != nullptr) ++s.live_groups;
    if (g.draining) ++s.draining_groups;
  }
  s.inflight_requests = inflight_.size();
  s.dropped_messages = dropped_;
  return s;
}

// --- UcxTransport ---------------------------------------------------------------------------

absl::Status UcxTransport::CheckRanks(int local, int other) const {
  if (local < 0 || local >= world_ || other < 0 || other >= world_ || local == other ||
      !IsLocal(local)) {
    return absl::InvalidArgumentError(absl::StrCat("UCX transport of ", group_, ": bad ranks ",
                                                   local, " <-> ", other, " (world_size ", world_,
                                                   ")"));
  }
  return absl::OkStatus();
}

void UcxTransport::Send(int src, int dst, MessageTag tag, ConstBuffer data, DoneCallback done) {
  if (absl::Status s = CheckRanks(src, dst); !s.ok()) return std::move(done)(s);
  if (IsLocal(dst)) return inproc_.Send(src, dst, tag, data, std::move(done));
  Remote(false, src, dst, tag, const_cast<void*>(data.data), data.bytes, std::move(done));
}

void UcxTransport::Recv(int dst, int src, MessageTag tag, MutableBuffer data, DoneCallback done) {
  if (absl::Status s = CheckRanks(dst, src); !s.ok()) return std::move(done)(s);
  if (IsLocal(src)) return inproc_.Recv(dst, src, tag, data, std::move(done));
  Remote(true, src, dst, tag, data.data, data.bytes, std::move(done));
}

void UcxTransport::Remote(bool recv, int src, int dst, MessageTag tag, void* data, size_t bytes,
                          DoneCallback done) {
  auto* req = new Request;
  req->worker = worker_.get();
  req->transport = shared_from_this();
  req->peer = peers_[recv ? src : dst];
  req->done = std::move(done);
  req->recv = recv;
  req->bytes = bytes;
  req->src = src;
  req->dst = dst;
  req->tag = tag;
  absl::AnyInvocable<void()> fn = [req, data] { req->transport->Start(req, data); };
  if (worker_->Post(fn)) return;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    status = first_.ok() ? absl::UnavailableError(absl::StrCat(group_, ": UCX backend destroyed"))
                         : first_;
  }
  DoneCallback cb = std::move(req->done);
  delete req;
  std::move(cb)(std::move(status));
}

void UcxTransport::Start(Request* req, void* data) {
  if (!sticky_.ok() || req->peer->ep == nullptr) {
    req->status = UCS_ERR_CANCELED;
    worker_->Submit(req, UCS_STATUS_PTR(UCS_ERR_CANCELED));
    return;
  }
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  p.memory_type = UCS_MEMORY_TYPE_HOST;  // skips UCX's memory-type detection per call
  p.user_data = req;
  const uint64_t wire = MakeTag(hash_, req->src, req->dst, req->tag);
  ucs_status_ptr_t r;
  if (req->recv) {
    // UCX 1.13 leaves recv_info unset on immediate completion, and the length is needed to
    // catch size mismatches: always complete through the callback.
    p.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv = &Worker::RecvCallback;
    r = ucp_tag_recv_nbx(worker_->ucp(), data, req->bytes, wire, kFullMask, &p);
  } else {
    p.cb.send = &Worker::SendCallback;
    r = ucp_tag_send_nbx(req->peer->ep, data, req->bytes, wire, &p);
  }
  worker_->Submit(req, r);
}

absl::Status UcxTransport::PeerStatus(const Peer& peer) const {
  std::vector<int> ranks;
  for (int r = 0; r < world_; ++r) {
    if (peers_[r].get() == &peer) ranks.push_back(r);
  }
  return absl::UnavailableError(absl::StrCat(
      "UCX peer of ", FormatRanks(ranks),
      " failed: ", peer.failure == UCS_OK ? "endpoint closed" : ucs_status_string(peer.failure)));
}

absl::Status UcxTransport::Outcome(const Request& req) const {
  if (req.status == UCS_OK) {
    if (req.recv && req.info.length != req.bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("message size mismatch at op_seq ", req.tag.op_seq, " (sub ", req.tag.sub,
                       "): rank ", req.src, " sent ", req.info.length, " bytes but rank ", req.dst,
                       " expected ", req.bytes));
    }
    return absl::OkStatus();
  }
  if (!sticky_.ok()) return sticky_;
  if (req.peer->failure != UCS_OK) return PeerStatus(*req.peer);
  if (req.status == UCS_ERR_MESSAGE_TRUNCATED) {
    return absl::InvalidArgumentError(absl::StrCat(
        "message size mismatch at op_seq ", req.tag.op_seq, " (sub ", req.tag.sub, "): rank ",
        req.src, " sent more than the ", req.bytes, " bytes rank ", req.dst, " expected"));
  }
  return absl::UnavailableError(absl::StrCat("UCX ", req.recv ? "receive" : "send", " of ", group_,
                                             " rank ", req.src, " -> ", req.dst,
                                             " failed: ", ucs_status_string(req.status)));
}

void UcxTransport::Abort(absl::Status reason) {
  if (reason.ok()) reason = absl::AbortedError("aborted");
  {
    absl::MutexLock lock(&mu_);
    if (first_.ok()) first_ = std::move(reason);
    reason = first_;
  }
  inproc_.Abort(reason);
  if (worker_->OnLoop()) {
    AbortOnLoop(reason);
    return;
  }
  std::weak_ptr<UcxTransport> weak = weak_from_this();
  absl::AnyInvocable<void()> fn = [weak, reason] {
    if (auto self = weak.lock()) self->AbortOnLoop(reason);
  };
  worker_->Post(fn);  // once the worker is gone nothing is in flight
}

void UcxTransport::AbortOnLoop(const absl::Status& reason) {
  if (!sticky_.ok()) return;
  sticky_ = reason;
  worker_->CancelRecvsOf(this);
  worker_->GroupAborted(hash_, this);
  // What UCX could not cancel must still finish (a frozen peer never answers): looked at
  // again after the grace, on the progress thread.
  std::weak_ptr<UcxTransport> weak = weak_from_this();
  std::weak_ptr<Worker> worker = worker_;
  worker_->timer()->Schedule(absl::Now() + worker_->options().abort_grace, [weak, worker] {
    std::shared_ptr<Worker> w = worker.lock();
    if (w == nullptr) return;
    absl::AnyInvocable<void()> fn = [weak] {
      if (auto self = weak.lock()) self->worker_->FinishStuck(self.get(), self->group_);
    };
    w->Post(fn);
  });
}

void UcxTransport::PeerFailed(const Peer& peer) {
  // Logged once per group, by the ring communicator that reports it.
  Abort(PeerStatus(peer));
}

// --- Backend --------------------------------------------------------------------------------

class UcxBackendImpl final : public UcxBackend {
 public:
  explicit UcxBackendImpl(std::shared_ptr<Worker> worker) : worker_(std::move(worker)) {}
  ~UcxBackendImpl() override { worker_->Shutdown(); }

  absl::string_view Name() const override { return "ucx"; }
  bool IsViable() const override { return true; }
  bool Supports(MemoryKind kind) const override { return kind != MemoryKind::kCuda; }
  std::string LocalAddress() const override { return worker_->address(); }
  absl::StatusOr<std::unique_ptr<Communicator>> Connect(const GroupSpec& spec) override;
  absl::StatusOr<UcxBackendStats> Stats() const override;

 private:
  std::shared_ptr<Worker> worker_;
};

absl::StatusOr<std::unique_ptr<Communicator>> UcxBackendImpl::Connect(const GroupSpec& spec) {
  FS_RETURN_IF_ERROR(CheckGroupSpec(spec));
  const std::string name = GroupName(spec.group_id, spec.epoch);
  if (spec.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": world_size ", spec.world_size,
                                                   " exceeds the UCX backend's limit of ",
                                                   kMaxWorldSize, " (10-bit ranks in tags)"));
  }
  if (static_cast<int>(spec.rank_addresses.size()) != spec.world_size) {
    return absl::FailedPreconditionError(
        absl::StrCat(name, ": the UCX backend needs one address per rank, got ",
                     spec.rank_addresses.size(), " for world_size ", spec.world_size));
  }
  std::vector<int> by_address;
  for (int r = 0; r < spec.world_size; ++r) {
    if (spec.rank_addresses[r].empty()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": rank ", r, " has no address"));
    }
    if (spec.rank_addresses[r] == worker_->address()) by_address.push_back(r);
  }
  if (by_address != spec.local_ranks || by_address.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": local_ranks [", absl::StrJoin(spec.local_ranks, ", "),
                     "] disagree with the ranks whose address is this backend's [",
                     absl::StrJoin(by_address, ", "), "]"));
  }
  const uint16_t hash = GroupTagHash(spec.group_id, spec.epoch);
  absl::StatusOr<std::shared_ptr<UcxTransport>> transport =
      absl::UnavailableError("UCX backend destroyed");
  const bool ran = worker_->RunAndWait([&] {
    if (worker_->stopping()) return;
    std::vector<std::shared_ptr<Peer>> peers(spec.world_size);
    for (int r = 0; r < spec.world_size; ++r) {
      if (spec.rank_addresses[r] == worker_->address()) continue;
      absl::StatusOr<std::shared_ptr<Peer>> p = worker_->PeerFor(spec.rank_addresses[r]);
      if (!p.ok()) {
        transport = absl::Status(p.status().code(),
                                 absl::StrCat(name, ", rank ", r, ": ", p.status().message()));
        return;
      }
      peers[r] = *std::move(p);
    }
    auto t = std::make_shared<UcxTransport>(worker_, spec, hash, peers);
    if (absl::Status s = worker_->RegisterGroup(hash, spec.group_id, spec.epoch, t); !s.ok()) {
      transport = s;
      return;
    }
    for (const std::shared_ptr<Peer>& p : peers) {
      if (p != nullptr) p->users[t.get()] = t;
    }
    transport = std::move(t);
  });
  if (!ran) return absl::UnavailableError("UCX backend destroyed");
  FS_RETURN_IF_ERROR(transport.status());
  FS_VLOG(1) << "UCX: connected " << name << " local ranks " << FormatRanks(spec.local_ranks);
  RingOptions options;
  options.timer = worker_->timer();
  options.chunk_bytes = worker_->options().broadcast_chunk_bytes;
  options.backend_name = "ucx";
  // Several ranks on some daemons: hierarchical all-gather and reduce-scatter (the layout is
  // the same on every daemon, from the group's addresses).
  if (worker_->options().hierarchical) {
    options.node_of_rank = NodesOfAddresses(spec.rank_addresses);
    if (std::optional<NodeLayout> l = HierarchicalLayout(options.node_of_rank)) {
      FS_LOG(INFO) << "UCX: " << name << ": hierarchical all-gather and reduce-scatter, "
                   << l->nodes << " daemons x " << l->per_node << " ranks";
    }
  }
  return NewRingCommunicator(spec, *std::move(transport), options);
}

absl::StatusOr<UcxBackendStats> UcxBackendImpl::Stats() const {
  UcxBackendStats stats;
  if (!worker_->RunAndWait([&] { stats = worker_->StatsOnLoop(); })) {
    return absl::UnavailableError("UCX backend destroyed");
  }
  return stats;
}

}  // namespace
}  // namespace ucx

absl::StatusOr<std::unique_ptr<CollectiveBackend>> CreateUcxBackend(
    const UcxBackendOptions& options) {
  FS_ASSIGN_OR_RETURN(std::shared_ptr<ucx::Worker> worker, ucx::Worker::Create(options));
  return std::make_unique<ucx::UcxBackendImpl>(std::move(worker));
}

}  // namespace flatshard::collective
