#pragma once
// BackendRegistry: backend name -> factory. The daemon fills one explicitly at startup with
// RegisterBuiltinBackends() (no static self-registration, no #ifdef at call sites) and creates
// the backends its config names.
//
// Thread safety: Register must not race with other calls (fill the registry before sharing
// it); Create, Has and Names are safe to call concurrently afterwards.

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/collective/backend.h"

namespace flatshard::collective {

// Backend settings from the daemon config, e.g. {"copy_threads": "4"}. Each factory documents
// its keys and refuses unknown ones with INVALID_ARGUMENT.
using BackendParams = std::map<std::string, std::string, std::less<>>;

using BackendFactory =
    std::function<absl::StatusOr<std::unique_ptr<CollectiveBackend>>(const BackendParams&)>;

class BackendRegistry {
 public:
  // ALREADY_EXISTS when `name` is taken; INVALID_ARGUMENT for an empty name or factory.
  absl::Status Register(std::string name, BackendFactory factory);
  // NOT_FOUND (listing the registered names) for an unknown name; otherwise what the factory
  // returns.
  absl::StatusOr<std::unique_ptr<CollectiveBackend>> Create(absl::string_view name,
                                                            const BackendParams& params = {}) const;
  bool Has(absl::string_view name) const;
  // Registered names, sorted.
  std::vector<std::string> Names() const;

 private:
  std::map<std::string, BackendFactory, std::less<>> factories_;
};

// Registers every backend this build has: "inproc" always (params: copy_threads,
// parallel_min_bytes, piece_bytes; see InprocBackendOptions); "ucx" when FS_HAVE_UCX (params:
// tls, net_devices, poll_before_sleep_us, drain_for_ms, broadcast_chunk_bytes, error_handling
// (auto|peer|none), hierarchical (on|off); see UcxBackendOptions); "nccl" once it exists.
// ALREADY_EXISTS if called twice on one registry.
absl::Status RegisterBuiltinBackends(BackendRegistry& registry);

}  // namespace flatshard::collective
