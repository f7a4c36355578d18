#include "server/collective/ucx/ucx_address.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace flatshard::collective::ucx {
namespace {

constexpr absl::string_view kPrefix = "fsucx1 ";

std::string NamespaceInode(const char* ns) {
  struct stat st {};
  if (stat(absl::StrCat("/proc/self/ns/", ns).c_str(), &st) != 0) return "?";
  return absl::StrCat(st.st_dev, ":", st.st_ino);
}

}  // namespace

std::string LocalHostIdentity() {
  std::string boot_id;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot_id);
  // Without a boot id nothing proves that a peer shares this kernel: a unique identity keeps
  // every peer remote (peer error handling), which is always safe.
  if (boot_id.empty())
    boot_id = absl::StrCat("unknown-", getpid(), "-", absl::ToUnixNanos(absl::Now()));
  return absl::StrCat(boot_id, " net=", NamespaceInode("net"), " ipc=", NamespaceInode("ipc"),
                      " mnt=", NamespaceInode("mnt"));
}

std::string EncodeUcxAddress(absl::string_view host, absl::string_view worker) {
  return absl::StrCat(kPrefix, host, "\n", worker);
}

absl::StatusOr<UcxPeerAddress> DecodeUcxAddress(absl::string_view address) {
  UcxPeerAddress out;
  if (!absl::ConsumePrefix(&address, kPrefix)) {
    out.worker = std::string(address);
    return out;
  }
  const size_t nl = address.find('\n');
  if (nl == absl::string_view::npos || nl + 1 == address.size()) {
    return absl::InvalidArgumentError(
        "UCX address: the host identity line or the worker address is missing");
  }
  out.host = std::string(address.substr(0, nl));
  out.worker = std::string(address.substr(nl + 1));
  return out;
}

}  // namespace flatshard::collective::ucx
