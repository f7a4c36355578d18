#include "server/collective/ucx/ucx_backend.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/collective/hierarchical_algorithms.h"
#include "server/collective/op_descriptor.h"
#include "server/collective/ring_algorithms.h"
#include "server/collective/ucx/ucx_address.h"
#include "server/collective/ucx/ucx_tag.h"
#include "server/collective/ucx/ucx_transport.h"
#include "server/collective/ucx/ucx_worker.h"

namespace flatshard::collective {
namespace ucx {
namespace {

// --- Backend --------------------------------------------------------------------------------

class UcxBackendImpl final : public UcxBackend {
 public:
  explicit UcxBackendImpl(std::shared_ptr<Worker> worker) : worker_(std::move(worker)) {}
  ~UcxBackendImpl() override { worker_->Shutdown(); }

  absl::string_view Name() const override { return "ucx"; }
  bool IsViable() const override { return true; }
  bool Supports(MemoryKind kind) const override { return kind != MemoryKind::kCuda; }
  std::string LocalAddress() const override { return worker_->address(); }
  // Daemons that differ would run different algorithms for one op (CheckDaemonsAgree).
  std::string GroupSettings() const override {
    return worker_->options().hierarchical ? "hierarchical=on" : "hierarchical=off";
  }
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
  options.pipeline_chunk_bytes = worker_->options().pipeline_chunk_bytes;
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
