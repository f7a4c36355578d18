// UcxTransport's same-host copies (same_host_copy.h): the sending side (a CopyHeader, then
// the receiver's CopyAck) and the receiving side (the copy's end: ack, complete). Progress
// thread only.

#include <unistd.h>

#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "server/collective/ucx/ucx_transport.h"

namespace flatshard::collective::ucx {
namespace {

// One send by same-host copy: the caller's callback and what must outlive the header send
// and the ack receive (shared by their callbacks).
struct CopySend {
  DoneCallback done;
  TokenSlot slot;
  CopyHeader header;
  CopyAck ack;
  Request* ack_req = nullptr;  // while the ack receive is in flight
  bool finished = false;

  void Finish(absl::Status status) {
    if (finished) return;
    finished = true;
    slot.Release();  // before the buffer goes back: a receiver still reading discards it
    std::move(done)(std::move(status));
  }
};

}  // namespace

std::string UcxTransport::Describe(const Request& req) const {
  return absl::StrCat(group_, " rank ", req.src, " -> ", req.dst, " (op_seq ", req.tag.op_seq,
                      ", sub ", req.tag.sub, ", ", req.bytes, " bytes)");
}

bool UcxTransport::MayGetHeader(const Request& req) const {
  return req.bytes >= kMinCopyBytes && req.peer->same_host;
}

bool UcxTransport::UseCopy(const Request& req) const {
  const size_t min = worker_->options().same_host_copy_min_bytes;
  return !req.control && !req.plain && min > 0 && req.bytes >= min && MayGetHeader(req) &&
         !req.peer->copy_denied;
}

void UcxTransport::SendByCopy(Request* req) {
  auto op = std::make_shared<CopySend>();
  op->done = std::move(req->done);
  op->header.pid = static_cast<uint64_t>(getpid());
  op->header.pid_namespace = PidNamespace();
  op->header.address = reinterpret_cast<uint64_t>(req->data);
  op->header.bytes = req->bytes;
  op->header.token_address = op->slot.address();
  op->header.token = op->slot.token();

  // The ack first, so that it never arrives unexpected.
  Request* ack = NewRequest(true, req->dst, req->src, req->tag, &op->ack, sizeof(CopyAck));
  ack->control = true;
  ack->done = [self = shared_from_this(), op, src = req->src, dst = req->dst, tag = req->tag,
               data = req->data, bytes = req->bytes](absl::Status s) {
    op->ack_req = nullptr;
    if (op->finished) return;
    const auto code = static_cast<AckCode>(op->ack.code);
    if (s.ok() && code == AckCode::kDenied) {
      // The receiver may not read this process: this message and every later one to that
      // peer go over UCX (the receiver takes either form).
      Peer& peer = *self->peers_[dst];
      if (!peer.copy_denied) {
        peer.copy_denied = true;
        FS_LOG(WARNING) << "UCX: " << self->group_ << ": rank " << dst
                        << " may not read this daemon's memory (process_vm_readv: "
                        << std::strerror(op->ack.error)
                        << "); messages to its daemon go over UCX instead";
      }
      op->finished = true;
      op->slot.Release();
      Request* r = self->NewRequest(false, src, dst, tag, data, bytes);
      r->plain = true;
      r->done = std::move(op->done);
      self->Start(r);
      return;
    }
    if (s.ok() && code != AckCode::kOk) {
      const std::string where = absl::StrCat(self->group_, " rank ", src, " -> ", dst, " (op_seq ",
                                             tag.op_seq, ", sub ", tag.sub, ")");
      if (code == AckCode::kMismatch) {
        s = absl::InvalidArgumentError(absl::StrCat(
            "message size mismatch at op_seq ", tag.op_seq, " (sub ", tag.sub, "): rank ", src,
            " sent ", bytes, " bytes but rank ", dst, " expected ", op->ack.copied));
      } else if (code == AckCode::kFailed) {
        s = absl::UnavailableError(
            absl::StrCat("same-host copy of ", where, " failed at the receiver after ",
                         op->ack.copied, " of ", bytes, " bytes: ", std::strerror(op->ack.error)));
      } else {
        s = absl::AbortedError(
            absl::StrCat("same-host copy of ", where, ": ", AckCodeName(code), " at rank ", dst));
      }
    }
    op->Finish(std::move(s));
  };
  op->ack_req = ack;
  Start(ack);

  Request* header =
      NewRequest(false, req->src, req->dst, req->tag, &op->header, sizeof(CopyHeader));
  header->plain = true;
  header->done = [worker = worker_.get(), op](absl::Status s) {
    if (s.ok() || op->finished) return;
    // Nobody will answer: the ack receive goes too (its callback then finds op finished).
    if (op->ack_req != nullptr && op->ack_req->ucx != nullptr) {
      ucp_request_cancel(worker->ucp(), op->ack_req->ucx);
    }
    op->Finish(std::move(s));
  };
  Start(header);
  delete req;  // its fields live on in `op` and the two requests
}

void UcxTransport::SendAck(const Request& recv, const CopyAck& ack) {
  auto buf = std::make_unique<CopyAck>(ack);
  Request* r = NewRequest(false, recv.dst, recv.src, recv.tag, buf.get(), sizeof(CopyAck));
  r->control = true;
  // A lost ack (the peer died) leaves the sender to its heartbeat; nothing to report here.
  r->done = [buf = std::move(buf)](absl::Status) {};
  Start(r);
}

bool UcxTransport::TakeCopyHeader(Request* req) {
  CopyHeader h;
  std::memcpy(&h, req->head, sizeof(h));
  if (h.magic != kCopyHeaderMagic) return false;  // a 48-byte message: a size mismatch
  // Tests: a header from another pid namespace is denied before anything is read.
  if (worker_->options().testing_deny_same_host_copy) h.pid_namespace = ~PidNamespace();
  if (h.bytes != req->bytes) {
    CopyAck ack;
    ack.code = static_cast<uint32_t>(AckCode::kMismatch);
    ack.copied = req->bytes;
    SendAck(*req, ack);
    req->info.length = h.bytes;  // Outcome names both sizes
    return false;
  }
  auto copy = std::make_unique<ActiveCopy>(
      ActiveCopy{req, ProcessCopy(h, req->data, worker_->options().same_host_copy_chunk_bytes,
                                  absl::StrCat("rank ", req->src, " (daemon pid ", h.pid, ")"))});
  if (!sticky_.ok()) {
    FinishCopy(req, copy->copy, sticky_);
  } else if (copy->copy.state() != ProcessCopy::State::kCopying) {
    FinishCopy(req, copy->copy, absl::OkStatus());
  } else {
    worker_->AddCopy(std::move(copy));
  }
  return true;
}

void UcxTransport::FinishCopy(Request* req, const ProcessCopy& copy, const absl::Status& stopped) {
  Worker::CopyCounts& counts = worker_->copy_counts();
  CopyAck ack = copy.Ack();
  if (!stopped.ok()) ack.code = static_cast<uint32_t>(AckCode::kAborted);
  absl::Status status;
  switch (static_cast<AckCode>(ack.code)) {
    case AckCode::kOk:
      ++counts.ok;
      CountSameHostCopy("ok", copy.copied());
      break;
    case AckCode::kDenied: {
      ++counts.denied;
      CountSameHostCopy("denied", 0);
      if (!req->peer->copy_denied_logged) {
        req->peer->copy_denied_logged = true;
        FS_LOG(WARNING) << "UCX: " << group_ << ": may not read the memory of rank " << req->src
                        << "'s daemon (process_vm_readv: " << std::strerror(copy.Ack().error)
                        << "); its messages come over UCX instead";
      }
      // The sender answers the ack with the bytes over UCX: the same receive again (Start
      // may complete it at once, so the ack goes first; UCX keeps what arrives early).
      SendAck(*req, ack);
      req->status = UCS_OK;
      req->info = {};
      req->plain = true;
      Start(req);
      return;
    }
    default:
      ++counts.failed;
      CountSameHostCopy("failed", copy.copied());
      status = !stopped.ok()
                   ? stopped
                   : absl::Status(copy.status().code(),
                                  absl::StrCat(Describe(*req), ": ", copy.status().message()));
      break;
  }
  SendAck(*req, ack);
  DoneCallback done = std::move(req->done);
  delete req;
  std::move(done)(std::move(status));
}

}  // namespace flatshard::collective::ucx
