#pragma once
// The address a UCX backend publishes at rendezvous: its UCX worker address plus the identity
// of the host (kernel and namespaces) it runs on, so that a backend can tell peers on its own
// host (shared memory and CMA reach them) from remote ones (TCP, RDMA).
//
// Wire form: "fsucx1 " <host identity> "\n" <UCX worker address, binary>. An address without
// the prefix (a daemon that predates it) is taken as a bare worker address on another host.

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard::collective::ucx {

// This process's host identity: the kernel's boot id and the inodes of its network, IPC and
// mount namespaces. Two daemons with equal identities share a kernel, /dev/shm and the same
// network view (daemons in separate network namespaces, e.g. emulated nodes joined by veth
// pairs, are different hosts here, so their bytes cross the emulated link).
std::string LocalHostIdentity();

struct UcxPeerAddress {
  std::string host;    // empty: unknown (an address without the prefix)
  std::string worker;  // the UCX worker address
};

std::string EncodeUcxAddress(absl::string_view host, absl::string_view worker);
// INVALID_ARGUMENT for a prefixed address without the line end or without a worker address.
absl::StatusOr<UcxPeerAddress> DecodeUcxAddress(absl::string_view address);

}  // namespace flatshard::collective::ucx
