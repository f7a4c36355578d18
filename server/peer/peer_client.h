#pragma once
// The daemon side of the peer control plane (proto/flatshard/v1/peer_service.proto): a
// daemon hosting ranks of a multi-daemon group meets the group's coordinator (another
// daemon's PeerService, or its own) to learn the peer table, keeps a Watch stream with
// heartbeats (and Pings beside it, pinger.h) to every coordinator it uses, reports its groups'
// failures and hears of the others' (DESIGN.md "Lifecycles", "Collective order and failure").
//
// Thread safety: thread-safe. Callbacks and PeerEvents run on the client's own threads (gRPC
// callback threads or its heartbeat thread), never under its locks, and may call back into
// the PeerClient.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace grpc {
class ChannelCredentials;
}

namespace flatshard::server::peer {

// Who a daemon is (DaemonInfo in the proto).
struct DaemonIdentity {
  std::string node;             // --node_name
  std::string daemon_id;        // unique per process: node, pid, start time
  std::string peer_address;     // host:port its PeerService listens on
  std::string backend_address;  // CollectiveBackend::LocalAddress (UCX worker address bytes)
  bool nccl = false;            // hosts GPU ranks and can run NCCL communicators
  // CollectiveBackend::GroupSettings of its remote backend: equal on every daemon of a group
  // (CheckDaemonsAgree).
  std::string collective_settings{};

  friend bool operator==(const DaemonIdentity&, const DaemonIdentity&) = default;
};

// A complete group: the daemon of every rank.
struct PeerTable {
  std::string group;
  uint64_t epoch = 0;
  std::vector<DaemonIdentity> rank_daemons;  // index: rank
  // GPU groups (proto PeerTable): each rank's GPU uuid, "nccl" or "host" (how device memory
  // moves between the daemons, decided by the coordinator), and NCCL's unique id.
  std::vector<std::string> rank_devices{};
  std::string device_transport{};
  std::string nccl_unique_id{};
  // Per rank: the modules its daemon held for the group at its rendezvous of the round that
  // made this table (RendezvousArgs::registered_modules); nullopt for a rank that was not
  // part of that round. Empty when no rank reported any.
  std::vector<std::optional<std::vector<std::string>>> rank_modules{};
};

struct PeerOptions {
  // Heartbeats on every Watch stream, both ways.
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  // No message on a Watch stream and no answered Ping (pinger.h) for this long: the other
  // side is dead. Together with the interval this bounds failure detection well inside
  // DESIGN's 5 s.
  absl::Duration peer_timeout = absl::Seconds(3);
  // Credentials of every channel to a coordinator; null: insecure (loopback / trusted net).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
};

// What the daemon (its GroupManager) hears from coordinators.
class PeerEvents {
 public:
  virtual ~PeerEvents() = default;
  // `coordinator` re-formed `table.group` at a newer epoch than the one this daemon last got
  // (e.g. a rank on another daemon rejoined after a failure, or a daemon restarted).
  virtual void OnTable(const std::string& coordinator, const PeerTable& table) = 0;
  // `group` failed at `epoch` elsewhere: another daemon reported a failure, or a daemon
  // hosting some of its ranks died or became unreachable.
  virtual void OnGroupFailed(const std::string& coordinator, const std::string& group,
                             uint64_t epoch, const absl::Status& status) = 0;
  // The Watch stream to `coordinator` broke or its heartbeats stopped: every group it
  // coordinates has lost its control plane.
  virtual void OnCoordinatorLost(const std::string& coordinator, const absl::Status& status) = 0;
};

class PeerClient {
 public:
  // `events` must outlive the client.
  PeerClient(DaemonIdentity self, PeerOptions options, PeerEvents* events);
  // Closes every Watch stream; pending Rendezvous calls fail with UNAVAILABLE.
  ~PeerClient();
  PeerClient(const PeerClient&) = delete;
  PeerClient& operator=(const PeerClient&) = delete;

  const DaemonIdentity& self() const { return self_; }

  // Rank `rank` of `group` arrives at `coordinator` (host:port). Opens a Watch stream to the
  // coordinator first if none is open. `done` gets the table once every rank arrived, or the
  // coordinator's error (DEADLINE_EXCEEDED naming missing ranks, PERMISSION_DENIED for a
  // wrong token, INVALID_ARGUMENT for a world_size that differs), or UNAVAILABLE naming the
  // coordinator when it cannot be reached. `failed_epoch`: the epoch at which this daemon's
  // copy of the group failed (0: none), so the coordinator re-forms the group even when the
  // failure report is still on its way. GPU daemons: `device_uuid` is the rank's GPU, and
  // rank 0's daemon sends a fresh `nccl_unique_id` (RendezvousRequest).
  void Rendezvous(const std::string& coordinator, const std::string& group,
                  const std::string& token, int world_size, int rank, absl::Time deadline,
                  absl::AnyInvocable<void(absl::StatusOr<PeerTable>)> done,
                  uint64_t failed_epoch = 0, const std::string& device_uuid = "",
                  const std::string& nccl_unique_id = "",
                  const std::vector<std::string>& registered_modules = {});

  // Best effort, asynchronous: the rank's session ended here.
  void Depart(const std::string& coordinator, const std::string& group, const std::string& token,
              int rank);

  // Best effort, asynchronous: `group` failed here at `epoch` with `status`.
  void ReportFailure(const std::string& coordinator, const std::string& group,
                     const std::string& token, uint64_t epoch, const absl::Status& status);

  // No group of this daemon uses `coordinator` any more: close its Watch stream quietly (no
  // OnCoordinatorLost). Does nothing while a Rendezvous with it is pending.
  void Unwatch(const std::string& coordinator);

 private:
  class Impl;
  const DaemonIdentity self_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flatshard::server::peer
