#pragma once
// Endpoint selection of the UCX backend (UcxBackendOptions::error_handling): which endpoints
// get UCX peer error handling, the transports that choice allows, and the parameters of one
// endpoint. Pure functions; thread-safe.

#include <ucp/api/ucp.h>

#include <map>
#include <string>

#include "absl/strings/string_view.h"
#include "server/collective/ucx/ucx_address.h"
#include "server/collective/ucx/ucx_backend.h"

namespace flatshard::collective::ucx {

// Whether the endpoint to `peer` gets UCP_ERR_HANDLING_MODE_PEER: every one with kPeer, none
// with kNone; with kAuto those to other hosts than `local_host`, and those to this host too
// unless `same_host_shared_memory`. The collective backend passes false (issue 27): a daemon
// killed while it writes into a peer's UCX shared-memory receive queue (UCX 1.13's mm FIFO:
// a slot claimed, never published) wedges that queue for good, for every sender, so the peer
// never receives anything again; over TCP loopback a killed sender only closes its connection.
bool WantsPeerErrorHandling(UcxBackendOptions::ErrorHandling mode, const UcxPeerAddress& peer,
                            absl::string_view local_host, bool same_host_shared_memory = true);

// `settings` (UCX keys without the prefix) with CMA left out where endpoints without peer
// error handling may exist and neither `settings` nor the environment picks the transports:
// UCX aborts the process when a CMA read finds such an endpoint's peer gone (process_vm_readv:
// ESRCH is fatal there), i.e. when a same-host daemon dies mid-transfer.
std::map<std::string, std::string> WithEndpointTransports(
    UcxBackendOptions::ErrorHandling mode, std::map<std::string, std::string> settings);

// The parameters of an endpoint to `peer` (which must outlive their use): with peer error
// handling, `on_error(arg, ...)` reports the peer's failure.
ucp_ep_params_t EndpointParams(const UcxPeerAddress& peer, bool error_handling,
                               ucp_err_handler_cb_t on_error, void* arg);

}  // namespace flatshard::collective::ucx
