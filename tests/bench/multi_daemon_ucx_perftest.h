#pragma once
// The ucx_perftest baseline of flatshard_multi_daemon_benchmark's transfer rows, and the UCX
// endpoint configurations reported for it and for the daemons.

#include <cstdint>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace flatshard::bench::md {

// The distinct UCX endpoint configurations in `log` ("tag(sysv/memory cma/memory)"), from the
// ep_cfg lines UCX prints at UCX_LOG_LEVEL=info.
std::set<std::string> UcxEndpointConfigs(absl::string_view log);
// `s` joined by ", ", or "(none reported)".
std::string JoinOrNone(const std::set<std::string>& s);

struct UcxPerfResult {
  double time_us = 0;  // per message, averaged over the measured iterations
  std::set<std::string> server_cfg, client_cfg;
};

// `bin` -t tag_bw -s `size` between a server and a client process on 127.0.0.1.
// `error_handling`: endpoints with peer error handling (-e), as the daemons create theirs; UCX
// then selects from the transports that support it (UCX 1.13 on one host: tcp, not shm/cma).
absl::StatusOr<UcxPerfResult> RunUcxPerftest(const std::string& bin, int64_t size, int iters,
                                             int warmup, bool error_handling,
                                             const std::vector<std::string>& env,
                                             const std::filesystem::path& dir,
                                             absl::Duration timeout);

}  // namespace flatshard::bench::md
