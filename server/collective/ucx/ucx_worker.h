#pragma once
// The UCX context, worker and progress thread of one UCX backend (Worker), and what it keeps
// per endpoint, request and group. Internal to the UCX backend (ucx_backend.cc, ucx_worker.cc,
// ucx_transport.cc).

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
#include "server/collective/ucx/same_host_copy.h"
#include "server/collective/ucx/ucx_address.h"
#include "server/collective/ucx/ucx_backend.h"
#include "server/collective/ucx/ucx_endpoint.h"
#include "server/collective/ucx/ucx_tag.h"

namespace flatshard::collective::ucx {

class UcxTransport;
class Worker;

// One endpoint to a remote worker, shared by every group that has ranks there.
struct Peer {
  Worker* worker = nullptr;
  std::string address;
  ucp_ep_h ep = nullptr;
  // UCP_ERR_HANDLING_MODE_PEER: UCX reports the peer's death. Without it (a peer on this host,
  // reached over shared memory), the heartbeats do, and an abort abandons stuck transfers.
  bool error_handling = true;
  // On this host (same host identity): large messages go by same-host copy, until the peer
  // answers that it may not read this process (`copy_denied`, then UCX as usual).
  bool same_host = false;
  bool copy_denied = false;
  bool copy_denied_logged = false;  // this side may not read the peer: logged once
  ucs_status_t failure = UCS_OK;    // set once the endpoint failed; ep is then closed
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
  void* data = nullptr;
  bool recv = false;
  bool control = false;  // a same-host copy's ack (control bit of the wire tag)
  bool plain = false;    // never by same-host copy (a fallback)
  // A receive that may get a CopyHeader: its first bytes land in `head` (iov[0]), the rest
  // in place (iov[1]); Worker::Complete moves them into `data` unless they are a header.
  bool split = false;
  uint8_t head[sizeof(CopyHeader)];
  ucp_dt_iov_t iov[2];
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

// A receive whose sender sent a CopyHeader: its bytes are being read (Worker::StepCopies).
struct ActiveCopy {
  Request* req;
  ProcessCopy copy;
};

struct GroupEntry {
  std::string group_id;
  uint64_t epoch = 0;
  const UcxTransport* id = nullptr;  // null once the transport is destroyed
  std::weak_ptr<UcxTransport> transport;
  bool draining = false;
  absl::Time drain_until = absl::InfiniteFuture();
};

inline std::string GroupName(absl::string_view id, uint64_t epoch) {
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
  // Same-host copies: started by the transport, a chunk each per loop turn, stopped (with
  // `reason`) when their transport aborts.
  void AddCopy(std::unique_ptr<ActiveCopy> copy);
  void StopCopiesOf(const UcxTransport* t, const absl::Status& reason);
  struct CopyCounts {
    size_t ok = 0, denied = 0, failed = 0;
  };
  CopyCounts& copy_counts() { return copy_counts_; }
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
  bool StepCopies();
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
  std::vector<std::unique_ptr<ActiveCopy>> copies_;
  CopyCounts copy_counts_;
};

}  // namespace flatshard::collective::ucx
