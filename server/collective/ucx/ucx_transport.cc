#include "server/collective/ucx/ucx_transport.h"

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace flatshard::collective::ucx {

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

Request* UcxTransport::NewRequest(bool recv, int src, int dst, MessageTag tag, void* data,
                                  size_t bytes) {
  auto* req = new Request;
  req->worker = worker_.get();
  req->transport = shared_from_this();
  req->peer = peers_[recv ? src : dst];
  req->recv = recv;
  req->data = data;
  req->bytes = bytes;
  req->src = src;
  req->dst = dst;
  req->tag = tag;
  return req;
}

void UcxTransport::Remote(bool recv, int src, int dst, MessageTag tag, void* data, size_t bytes,
                          DoneCallback done) {
  Request* req = NewRequest(recv, src, dst, tag, data, bytes);
  req->done = std::move(done);
  absl::AnyInvocable<void()> fn = [req] { req->transport->Start(req); };
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

void UcxTransport::Start(Request* req) {
  if (!sticky_.ok() || req->peer->ep == nullptr) {
    req->status = UCS_ERR_CANCELED;
    worker_->Submit(req, UCS_STATUS_PTR(UCS_ERR_CANCELED));
    return;
  }
  if (!req->recv && UseCopy(*req)) return SendByCopy(req);
  void* data = req->data;
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  p.memory_type = UCS_MEMORY_TYPE_HOST;  // skips UCX's memory-type detection per call
  p.user_data = req;
  const uint64_t wire = MakeTag(hash_, req->src, req->dst, req->tag, req->control);
  ucs_status_ptr_t r;
  if (req->recv) {
    // UCX 1.13 leaves recv_info unset on immediate completion, and the length is needed to
    // catch size mismatches: always complete through the callback.
    p.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv = &Worker::RecvCallback;
    size_t count = req->bytes;
    if (!req->control && MayGetHeader(*req)) {
      // A CopyHeader may come instead of the bytes: its place is req->head, never the
      // caller's buffer, which other local ranks may be reading (a shared all-gather output).
      req->split = true;
      req->iov[0] = {req->head, sizeof(CopyHeader)};
      req->iov[1] = {static_cast<char*>(data) + sizeof(CopyHeader),
                     req->bytes - sizeof(CopyHeader)};
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
      p.datatype = ucp_dt_make_iov();
      data = req->iov;
      count = 2;
    }
    r = ucp_tag_recv_nbx(worker_->ucp(), data, count, wire, kFullMask, &p);
  } else {
    p.cb.send = &Worker::SendCallback;
    r = ucp_tag_send_nbx(req->peer->ep, data, req->bytes, wire, &p);
  }
  worker_->Submit(req, r);
}

absl::Status UcxTransport::PeerStatus(const Peer& peer, ucs_status_t request_status) const {
  std::vector<int> ranks;
  for (int r = 0; r < world_; ++r) {
    if (peers_[r].get() == &peer) ranks.push_back(r);
  }
  const ucs_status_t why = peer.failure != UCS_OK ? peer.failure : request_status;
  return absl::UnavailableError(
      absl::StrCat("UCX peer of ", FormatRanks(ranks),
                   " failed: ", why == UCS_OK ? "endpoint closed" : ucs_status_string(why)));
}

namespace {
// A request's status that says its endpoint's peer is gone (the endpoint's error callback,
// which names the peer, may run after the request completes).
bool IsPeerGone(ucs_status_t s) {
  return s == UCS_ERR_ENDPOINT_TIMEOUT || s == UCS_ERR_CONNECTION_RESET || s == UCS_ERR_UNREACHABLE;
}
}  // namespace

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
  if (req.peer->failure != UCS_OK || IsPeerGone(req.status)) {
    return PeerStatus(*req.peer, req.status);
  }
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
  worker_->StopCopiesOf(this, reason);
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

}  // namespace flatshard::collective::ucx
