#include "server/collective/ucx/ucx_endpoint.h"

#include <cstdlib>
#include <utility>

namespace flatshard::collective::ucx {

bool WantsPeerErrorHandling(UcxBackendOptions::ErrorHandling mode, const UcxPeerAddress& peer,
                            absl::string_view local_host, bool same_host_shared_memory) {
  using Mode = UcxBackendOptions::ErrorHandling;
  const bool same_host = !peer.host.empty() && peer.host == local_host;
  return mode == Mode::kPeer || (mode == Mode::kAuto && (!same_host || !same_host_shared_memory));
}

std::map<std::string, std::string> WithEndpointTransports(
    UcxBackendOptions::ErrorHandling mode, std::map<std::string, std::string> settings) {
  if (mode != UcxBackendOptions::ErrorHandling::kPeer && !settings.contains("TLS") &&
      std::getenv("UCX_TLS") == nullptr) {
    settings["TLS"] = "^cma";
  }
  return settings;
}

ucp_ep_params_t EndpointParams(const UcxPeerAddress& peer, bool error_handling,
                               ucp_err_handler_cb_t on_error, void* arg) {
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.address = reinterpret_cast<const ucp_address_t*>(peer.worker.data());
  p.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  if (error_handling) {
    p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = on_error;
    p.err_handler.arg = arg;
  }
  return p;
}

}  // namespace flatshard::collective::ucx
