#pragma once
// The UCX backend: collectives between ranks hosted by different daemons, over UCX's tag API.
//
// One backend per daemon owns one UCX context, one worker and one progress thread. Its
// LocalAddress() (the worker address, binary) is published at rendezvous; every daemon then
// connects a group with GroupSpec::rank_addresses[r] = the LocalAddress of the backend hosting
// rank r. Connect returns the ring algorithms (ring_algorithms.h) over a per-group Transport:
// messages between two local ranks are copied with memcpy (InprocTransport); messages to or
// from remote ranks go straight from and into the caller's buffers with ucp_tag_send_nbx /
// ucp_tag_recv_nbx (eager for small messages, UCX rendezvous for large ones; no staging),
// except large messages between daemons of one host: those are read once by the receiver
// with process_vm_readv (same_host_copy.h, UcxBackendOptions::same_host_copy_min_bytes).
// Groups whose daemons host several ranks each run all-gather and reduce-scatter hierarchically
// (UcxBackendOptions::hierarchical).
//
// UCX configuration comes from the environment as UCX itself reads it (UCX_TLS,
// UCX_NET_DEVICES, ...); UcxBackendOptions::ucx_config overrides single keys. The default
// works between processes of one host (TCP over loopback; shared memory with kNone).
//
// LocalAddress() is the worker address prefixed with this host's identity (ucx_address.h).
// Endpoints: one per remote worker address, created on first use and shared by every group.
// By default every endpoint has peer error handling: when a peer fails (its daemon died, the
// connection reset), every group using that endpoint is aborted with UNAVAILABLE "UCX peer of
// ranks 2, 3 failed: ...". Daemons on this host then talk over TCP loopback, never UCX shared
// memory (UcxBackendOptions::error_handling, kNone to have it).
//
// Wire tags (64 bits, see ucx_tag.h): 16 bits hash(group_id, epoch) | 10 bits src rank |
// 10 bits dst rank | 1 control bit | 15 bits op_seq | 12 bits sub. Groups (or epochs of one group)
// whose hash collides with a live group on this backend are refused, so live groups never see each
// other's messages.
//
// Thread safety: thread-safe. All UCX calls and all transport state changes happen on the
// progress thread; public methods post work to it. Transfer callbacks (and so op callbacks)
// run on the progress thread or on a local rank's calling thread. The backend must not be
// destroyed from one of its own callbacks. Communicators may outlive the backend: their ops
// then fail with UNAVAILABLE.

#include <cstddef>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/collective/backend.h"

namespace flatshard::collective {

struct UcxBackendOptions {
  // UCX settings applied over the environment's, without the UCX_ prefix, e.g.
  // {"TLS", "tcp"} or {"NET_DEVICES", "lo"}. Empty: the environment alone decides.
  std::map<std::string, std::string> ucx_config;
  // While transfers are in flight the progress thread polls the worker; after this long
  // without progress it sleeps on the worker's event fd (woken by arrivals) instead.
  absl::Duration poll_before_sleep = absl::Microseconds(200);
  // How long messages of an aborted or closed group are still received and dropped, so that
  // peers blocked in a rendezvous send to it complete instead of hanging.
  absl::Duration drain_for = absl::Seconds(30);
  // Broadcast pipeline piece (RingOptions::chunk_bytes).
  size_t broadcast_chunk_bytes = size_t{1} << 20;
  // The reduce-scatter's and hierarchical collectives' pipeline chunk
  // (RingOptions::pipeline_chunk_bytes). Message tags depend on it: the same on every daemon
  // of a group (no daemon flag sets it; tests do).
  size_t pipeline_chunk_bytes = size_t{4} << 20;
  // Which endpoints get UCP_ERR_HANDLING_MODE_PEER (UCX itself reports a dead peer and fails
  // the transfers to it). UCX 1.13's shared-memory transports cannot do that: with it, daemons
  // on one host talk over TCP loopback. kAuto (the default) and kPeer: every endpoint has it.
  // kAuto gave same-host peers (same boot id and namespaces, ucx_address.h) endpoints without
  // it, over shared memory (sysv, posix), until issue 27: a daemon killed between claiming a
  // slot of a peer's shared-memory receive FIFO and publishing it (UCX's mm transport) leaves
  // that FIFO stuck at the slot for good, so the peer receives nothing more from anyone, epoch
  // after epoch; a killed TCP sender only closes its connection. Large same-host messages keep
  // a single copy (same_host_copy_min_bytes). kNone: no endpoint has it, so same-host peers use
  // shared memory (with that risk); a dead same-host peer is then found by the daemons'
  // heartbeats (the coordinator aborts the group), and the abort finishes its transfers
  // (abort_grace). Except with kPeer, CMA is left out (UCX_TLS=^cma) unless UCX_TLS or
  // ucx_config["TLS"] picks the transports: UCX 1.13 aborts the whole process when a CMA read
  // finds the peer of an endpoint without peer error handling dead. Both ends of an endpoint
  // must agree (UCX refuses "asymmetric endpoint configuration"): every daemon of a host needs
  // the same mode.
  enum class ErrorHandling { kAuto, kPeer, kNone };
  ErrorHandling error_handling = ErrorHandling::kAuto;
  // Abort finishes every transfer of the group: receives not yet moving data are cancelled
  // at once; a transfer UCX cannot cancel (a send, a receive already moving data) that is
  // still in flight this long after the abort goes to a peer that does not answer (a dead
  // same-host peer, or a frozen daemon: its connections stay open, so UCX never reports it).
  // An endpoint with peer error handling is then force-closed, which completes every transfer
  // on it with an error; on one without it the transfers are abandoned to UCX and complete at
  // once with the abort's status. Transfers to a peer that answers finish well within it: the
  // peer drains what an aborted group sends.
  absl::Duration abort_grace = absl::Seconds(1);
  // Groups whose daemons each host the same number (>= 2) of ranks run all-gather and
  // reduce-scatter hierarchically (hierarchical_algorithms.h: copies within a daemon, each
  // daemon's bytes over the network once); false: the flat ring of every rank. Every daemon of
  // a group must agree (a daemon flag, --ucx_hierarchical): the backend publishes it
  // (GroupSettings) and a group whose daemons differ does not form
  // (server/group/daemon_agreement.h).
  bool hierarchical = true;
  // Messages of at least this many bytes to a daemon on this host (same host identity,
  // ucx_address.h) skip UCX (TCP loopback, or two shared-memory copies with kNone): the
  // receiver reads them straight out of the sender's buffer with process_vm_readv
  // (same_host_copy.h), in chunks of
  // `same_host_copy_chunk_bytes` so that an abort stops it. A dead peer fails that op with a
  // named error, never the process. 0: off (a daemon flag, --ucx_same_host_copy=false);
  // values below 64 KiB act as 64 KiB (kMinCopyBytes).
  // Daemons need not agree: a receiver takes either form.
  size_t same_host_copy_min_bytes = size_t{256} << 10;
  size_t same_host_copy_chunk_bytes = size_t{4} << 20;
  // Tests only: this backend's receives answer every header kDenied, as if ptrace rules
  // forbade the read (root can read any process, so tests cannot provoke EPERM).
  bool testing_deny_same_host_copy = false;
};

// Counters for diagnostics and tests; a snapshot taken on the progress thread.
struct UcxBackendStats {
  size_t endpoints = 0;              // live endpoints to remote workers
  size_t same_host_endpoints = 0;    // of those, endpoints without peer error handling
  size_t live_groups = 0;            // transports alive (connected and not destroyed)
  size_t draining_groups = 0;        // aborted or closed groups whose stray messages are dropped
  size_t inflight_requests = 0;      // UCX sends and receives not completed yet
  size_t dropped_messages = 0;       // stray messages drained so far
  size_t same_host_copies = 0;       // messages received with one process_vm_readv copy
  size_t same_host_copy_denied = 0;  // headers answered kDenied (then sent over UCX)
  size_t same_host_copy_failed = 0;  // copies that failed (dead peer, aborted sender)
};

// The concrete backend, for callers that want its stats. Name() is "ucx".
class UcxBackend : public CollectiveBackend {
 public:
  // UNAVAILABLE once the backend is shutting down.
  virtual absl::StatusOr<UcxBackendStats> Stats() const = 0;
};

// Creates the UCX context, worker and progress thread. UNAVAILABLE when UCX cannot be
// initialised (no usable transport, bad UCX_* settings); INVALID_ARGUMENT for a bad
// `ucx_config` key or value. The result is a UcxBackend.
absl::StatusOr<std::unique_ptr<CollectiveBackend>> CreateUcxBackend(
    const UcxBackendOptions& options = {});

}  // namespace flatshard::collective
