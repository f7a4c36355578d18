#include "server/collective/ucx/ucx_worker.h"

#include "server/collective/ucx/ucx_transport.h"

namespace flatshard::collective::ucx {

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
    if (!copies_.empty() && StepCopies()) busy = true;
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
  req->ucx = nullptr;
  if (req->split && req->status == UCS_OK) {
    req->split = false;
    // A same-host sender's header instead of the bytes: the transport reads them itself.
    if (req->info.length == sizeof(CopyHeader) && req->transport->TakeCopyHeader(req)) return;
    std::memcpy(req->data, req->head, std::min(sizeof(CopyHeader), req->info.length));
  }
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
  peer->error_handling = WantsPeerErrorHandling(options_.error_handling, decoded, host_,
                                                /*same_host_shared_memory=*/false);
  peer->same_host = !decoded.host.empty() && decoded.host == host_;
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

void Worker::AddCopy(std::unique_ptr<ActiveCopy> copy) { copies_.push_back(std::move(copy)); }

bool Worker::StepCopies() {
  std::vector<std::unique_ptr<ActiveCopy>> finished;
  for (auto it = copies_.begin(); it != copies_.end();) {
    if ((*it)->copy.Step() == ProcessCopy::State::kCopying) {
      ++it;
      continue;
    }
    finished.push_back(std::move(*it));
    it = copies_.erase(it);
  }
  // Callbacks may start new copies: only after the list is consistent again.
  for (auto& c : finished) c->req->transport->FinishCopy(c->req, c->copy, absl::OkStatus());
  return true;
}

void Worker::StopCopiesOf(const UcxTransport* t, const absl::Status& reason) {
  std::vector<std::unique_ptr<ActiveCopy>> stopped;
  for (auto it = copies_.begin(); it != copies_.end();) {
    if ((*it)->req->transport.get() != t) {
      ++it;
      continue;
    }
    stopped.push_back(std::move(*it));
    it = copies_.erase(it);
  }
  for (auto& c : stopped) c->req->transport->FinishCopy(c->req, c->copy, reason);
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
  while (!copies_.empty()) StopCopiesOf(copies_.front()->req->transport.get(), reason);
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
  s.same_host_copies = copy_counts_.ok;
  s.same_host_copy_denied = copy_counts_.denied;
  s.same_host_copy_failed = copy_counts_.failed;
  return s;
}

}  // namespace flatshard::collective::ucx
