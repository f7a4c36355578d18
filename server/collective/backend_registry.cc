#include "server/collective/backend_registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/config.h"
#include "common/status_macros.h"
#include "server/collective/inproc/inproc_backend.h"
#if FS_HAVE_NCCL
#include "server/collective/nccl/nccl_backend.h"
#endif
#if FS_HAVE_UCX
#include "server/collective/ucx/ucx_backend.h"
#endif

namespace flatshard::collective {
namespace {

absl::StatusOr<int64_t> ParseInt(absl::string_view backend, absl::string_view key,
                                 absl::string_view value, int64_t min) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(value, &v) || v < min) {
    return absl::InvalidArgumentError(absl::StrCat(backend, " backend: ", key, " must be an ",
                                                   "integer >= ", min, ", got '", value, "'"));
  }
  return v;
}

absl::StatusOr<std::unique_ptr<CollectiveBackend>> MakeInproc(const BackendParams& params) {
  InprocBackendOptions options;
  for (const auto& [key, value] : params) {
    if (key == "copy_threads") {
      FS_ASSIGN_OR_RETURN(int64_t v, ParseInt("inproc", key, value, -1));
      options.copy_threads = static_cast<int>(std::min<int64_t>(v, 256));
    } else if (key == "parallel_min_bytes") {
      FS_ASSIGN_OR_RETURN(int64_t v, ParseInt("inproc", key, value, 0));
      options.parallel_min_bytes = static_cast<size_t>(v);
    } else if (key == "piece_bytes") {
      FS_ASSIGN_OR_RETURN(int64_t v, ParseInt("inproc", key, value, 4096));
      options.piece_bytes = static_cast<size_t>(v);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("inproc backend: unknown parameter '", key,
                       "' (known: copy_threads, parallel_min_bytes, piece_bytes)"));
    }
  }
  return CreateInprocBackend(options);
}

#if FS_HAVE_UCX
// Keys: tls, net_devices (UCX_TLS / UCX_NET_DEVICES, overriding the environment),
// poll_before_sleep_us, drain_for_ms, broadcast_chunk_bytes, error_handling,
// hierarchical (on|off), same_host_copy (on|off), same_host_copy_min_bytes,
// same_host_copy_chunk_bytes; see UcxBackendOptions.
absl::StatusOr<std::unique_ptr<CollectiveBackend>> MakeUcx(const BackendParams& params) {
  UcxBackendOptions options;
  for (const auto& [key, value] : params) {
    if (key == "tls") {
      options.ucx_config["TLS"] = value;
    } else if (key == "net_devices") {
      options.ucx_config["NET_DEVICES"] = value;
    } else if (key == "poll_before_sleep_us") {
      FS_ASSIGN_OR_RETURN(int64_t v, ParseInt("ucx", key, value, 0));
      options.poll_before_sleep = absl::Microseconds(v);
    } else if (key == "drain_for_ms") {
      FS_ASSIGN_OR_RETURN(int64_t v, ParseInt("ucx", key, value, 0));
      options.drain_for = absl::Milliseconds(v);
    } else if (key == "broadcast_chunk_bytes") {
      FS_ASSIGN_OR_RETURN(int64_t v, ParseInt("ucx", key, value, 4096));
      options.broadcast_chunk_bytes = static_cast<size_t>(v);
    } else if (key == "error_handling") {
      using Mode = UcxBackendOptions::ErrorHandling;
      if (value == "auto") {
        options.error_handling = Mode::kAuto;
      } else if (value == "peer") {
        options.error_handling = Mode::kPeer;
      } else if (value == "none") {
        options.error_handling = Mode::kNone;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "ucx backend: error_handling must be 'auto', 'peer' or 'none', got '", value, "'"));
      }
    } else if (key == "hierarchical") {
      if (value != "on" && value != "off") {
        return absl::InvalidArgumentError(
            absl::StrCat("ucx backend: hierarchical must be 'on' or 'off', got '", value, "'"));
      }
      options.hierarchical = value == "on";
    } else if (key == "same_host_copy") {
      if (value != "on" && value != "off") {
        return absl::InvalidArgumentError(
            absl::StrCat("ucx backend: same_host_copy must be 'on' or 'off', got '", value, "'"));
      }
      if (value == "off") options.same_host_copy_min_bytes = 0;
    } else if (key == "same_host_copy_min_bytes") {
      FS_ASSIGN_OR_RETURN(int64_t v, ParseInt("ucx", key, value, 0));
      options.same_host_copy_min_bytes = static_cast<size_t>(v);
    } else if (key == "same_host_copy_chunk_bytes") {
      FS_ASSIGN_OR_RETURN(int64_t v, ParseInt("ucx", key, value, 4096));
      options.same_host_copy_chunk_bytes = static_cast<size_t>(v);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("ucx backend: unknown parameter '", key,
                       "' (known: tls, net_devices, poll_before_sleep_us, drain_for_ms, "
                       "broadcast_chunk_bytes, error_handling, hierarchical, same_host_copy, "
                       "same_host_copy_min_bytes, same_host_copy_chunk_bytes)"));
    }
  }
  return CreateUcxBackend(options);
}
#endif

#if FS_HAVE_NCCL
// Keys: init_timeout_ms, finalize_timeout_ms, poll_interval_us, fingerprint (on|off); see
// NcclBackendOptions.
absl::StatusOr<std::unique_ptr<CollectiveBackend>> MakeNccl(const BackendParams& params) {
  NcclBackendOptions options;
  for (const auto& [key, value] : params) {
    if (key == "init_timeout_ms") {
      FS_ASSIGN_OR_RETURN(int64_t v, ParseInt("nccl", key, value, 1));
      options.init_timeout = absl::Milliseconds(v);
    } else if (key == "finalize_timeout_ms") {
      FS_ASSIGN_OR_RETURN(int64_t v, ParseInt("nccl", key, value, 0));
      options.finalize_timeout = absl::Milliseconds(v);
    } else if (key == "poll_interval_us") {
      FS_ASSIGN_OR_RETURN(int64_t v, ParseInt("nccl", key, value, 0));
      options.poll_interval = absl::Microseconds(v);
    } else if (key == "fingerprint") {
      if (value != "on" && value != "off") {
        return absl::InvalidArgumentError(
            absl::StrCat("nccl backend: fingerprint must be 'on' or 'off', got '", value, "'"));
      }
      options.fingerprint = value == "on";
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "nccl backend: unknown parameter '", key,
          "' (known: init_timeout_ms, finalize_timeout_ms, poll_interval_us, fingerprint)"));
    }
  }
  return CreateNcclBackend(options);
}
#endif

}  // namespace

absl::Status BackendRegistry::Register(std::string name, BackendFactory factory) {
  if (name.empty() || factory == nullptr) {
    return absl::InvalidArgumentError("backend registration needs a name and a factory");
  }
  if (factories_.count(name) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("backend ", name, " is already registered"));
  }
  factories_.emplace(std::move(name), std::move(factory));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CollectiveBackend>> BackendRegistry::Create(
    absl::string_view name, const BackendParams& params) const {
  auto it = factories_.find(name);
  if (it == factories_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown collective backend '", name,
                                            "' (registered: ", absl::StrJoin(Names(), ", "), ")"));
  }
  return it->second(params);
}

bool BackendRegistry::Has(absl::string_view name) const {
  return factories_.find(name) != factories_.end();
}

std::vector<std::string> BackendRegistry::Names() const {
  std::vector<std::string> names;
  for (const auto& [name, f] : factories_) names.push_back(name);
  return names;
}

absl::Status RegisterBuiltinBackends(BackendRegistry& registry) {
  FS_RETURN_IF_ERROR(registry.Register("inproc", MakeInproc));
#if FS_HAVE_UCX
  FS_RETURN_IF_ERROR(registry.Register("ucx", MakeUcx));
#endif
#if FS_HAVE_NCCL
  FS_RETURN_IF_ERROR(registry.Register("nccl", MakeNccl));
#endif
  return absl::OkStatus();
}

}  // namespace flatshard::collective
