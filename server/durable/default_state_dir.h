#pragma once
// Where the daemon keeps its records when --state_dir is not given (README "Restarts"):
// persistence is on by default, as in etcd, containerd and Redis; --ephemeral turns it off.
//   $STATE_DIRECTORY (systemd's StateDirectory=; the first entry when it lists several),
//   else /var/lib/flatshard/state for root,
//   else $XDG_STATE_HOME/flatshard/state, or $HOME/.local/state/flatshard/state.
//
// Thread-safe: a pure function of its arguments.

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"

namespace flatshard::server::state {

struct StateDirChoice {
  std::string path;  // empty: ephemeral, nothing recorded
  std::string why;   // for the log: "--state_dir", "$STATE_DIRECTORY", ...
};

// `flag`: --state_dir ("" when not given); `ephemeral`: --ephemeral. `getenv` returns an
// environment variable ("" when unset); `uid`: the effective uid. INVALID_ARGUMENT naming
// both flags when both are given, or naming the variables when no directory can be chosen
// (no $HOME).
absl::StatusOr<StateDirChoice> ChooseStateDir(const std::string& flag, bool ephemeral,
                                              const std::function<std::string(const char*)>& getenv,
                                              uint32_t uid);

}  // namespace flatshard::server::state
