#pragma once
// UcxTransport: the Transport of one group on one UCX backend. Internal to the UCX backend.

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/collective/inproc/inproc_transport.h"
#include "server/collective/transport.h"
#include "server/collective/ucx/ucx_worker.h"

namespace flatshard::collective::ucx {

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
  // Same-host copy (same_host_copy.h), receiving side. TakeCopyHeader: `req` got a
  // CopyHeader; true once the transport owns `req` (copying, or finished). FinishCopy: the
  // copy of `req` ended (`stopped`: the abort that stopped it); acks and completes `req`.
  bool TakeCopyHeader(Request* req);
  void FinishCopy(Request* req, const ProcessCopy& copy, const absl::Status& stopped);

 private:
  bool IsLocal(int rank) const { return peers_[rank] == nullptr; }
  absl::Status CheckRanks(int local, int other) const;
  void Remote(bool recv, int src, int dst, MessageTag tag, void* data, size_t bytes,
              DoneCallback done);
  Request* NewRequest(bool recv, int src, int dst, MessageTag tag, void* data, size_t bytes);
  void Start(Request* req);
  // Whether the peer may send `req` by same-host copy (UseCopy on its side implies it).
  bool MayGetHeader(const Request& req) const;
  bool UseCopy(const Request& req) const;
  // Sends `req` as a CopyHeader and completes it on the receiver's CopyAck.
  void SendByCopy(Request* req);
  void SendAck(const Request& recv, const CopyAck& ack);
  std::string Describe(const Request& req) const;
  // UNAVAILABLE "UCX peer of ranks 2, 3 failed: <why>"; `why`: the peer's failure, or
  // `request_status` when the endpoint's error callback has not run yet.
  absl::Status PeerStatus(const Peer& peer, ucs_status_t request_status = UCS_OK) const;

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

}  // namespace flatshard::collective::ucx
