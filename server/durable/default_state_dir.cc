#include "server/durable/default_state_dir.h"

#include "absl/strings/str_cat.h"

namespace flatshard::server::state {

absl::StatusOr<StateDirChoice> ChooseStateDir(const std::string& flag, bool ephemeral,
                                              const std::function<std::string(const char*)>& getenv,
                                              uint32_t uid) {
  if (ephemeral && !flag.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--ephemeral and --state_dir ", flag,
        " contradict each other: --ephemeral keeps no records, --state_dir keeps them there"));
  }
  if (ephemeral) return StateDirChoice{"", "--ephemeral"};
  if (!flag.empty()) return StateDirChoice{flag, "--state_dir"};
  // systemd's StateDirectory= sets it (colon-separated when it names several).
  if (std::string s = getenv("STATE_DIRECTORY"); !s.empty()) {
    return StateDirChoice{s.substr(0, s.find(':')), "$STATE_DIRECTORY"};
  }
  if (uid == 0) return StateDirChoice{"/var/lib/flatshard/state", "the default for root"};
  // XDG: a relative value is invalid and ignored.
  if (std::string xdg = getenv("XDG_STATE_HOME"); !xdg.empty() && xdg[0] == '/') {
    return StateDirChoice{absl::StrCat(xdg, "/flatshard/state"), "$XDG_STATE_HOME"};
  }
  if (std::string home = getenv("HOME"); !home.empty() && home[0] == '/') {
    return StateDirChoice{absl::StrCat(home, "/.local/state/flatshard/state"), "$HOME"};
  }
  return absl::InvalidArgumentError(
      "no state directory: --state_dir is not given and neither $STATE_DIRECTORY, "
      "$XDG_STATE_HOME nor $HOME names an absolute directory; pass --state_dir DIR, or "
      "--ephemeral to keep nothing across restarts");
}

}  // namespace flatshard::server::state
