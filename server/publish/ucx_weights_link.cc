#include "server/publish/ucx_weights_link.h"

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/logging.h"
#include "server/metrics/registry.h"

namespace flatshard::server {

absl::StatusOr<std::unique_ptr<UcxWeightsLink>> OpenWeightsLink(const std::string& transport,
                                                                const std::string& error_handling,
                                                                bool copies) {
  if (transport != "ucx" && transport != "grpc") {
    return absl::InvalidArgumentError(
        absl::StrCat("--weights_transport must be 'ucx' or 'grpc', got '", transport, "'"));
  }
  std::unique_ptr<UcxWeightsLink> link;
  if (!copies) return link;
  if (transport == "ucx") {
    absl::StatusOr<std::unique_ptr<UcxWeightsLink>> made = UcxWeightsLink::Create(error_handling);
    if (made.ok()) {
      link = *std::move(made);
    } else if (made.status().code() == absl::StatusCode::kInvalidArgument) {
      return made.status();
    } else {
      FS_LOG(WARNING) << "published weights between daemons: gRPC, not UCX: " << made.status();
    }
  }
  const char* chosen = link != nullptr ? "ucx" : "grpc";
  FS_LOG(INFO) << "published weights between daemons move over " << chosen
               << " (--weights_transport=" << transport << ")";
  static metrics::GaugeFamily& gauge = metrics::DefaultRegistry().AddGauge(
      "flatshard_weights_transport",
      "How this daemon's copies of published weights move between daemons (1: this one)",
      {"transport"});
  gauge.WithLabels({chosen}).Set(1);
  return link;
}

}  // namespace flatshard::server

#if FS_HAVE_UCX

#include <poll.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "server/collective/ucx/ucx_address.h"
#include "server/collective/ucx/ucx_endpoint.h"

namespace flatshard::server {

using collective::ucx::DecodeUcxAddress;
using collective::ucx::EncodeUcxAddress;
using collective::ucx::EndpointParams;
using collective::ucx::LocalHostIdentity;
using collective::ucx::UcxPeerAddress;
using collective::ucx::WantsPeerErrorHandling;
using collective::ucx::WithEndpointTransports;
using Mode = collective::UcxBackendOptions::ErrorHandling;

namespace {

absl::Status UcxError(absl::StatusCode code, absl::string_view what, ucs_status_t s) {
  return absl::Status(code, absl::StrCat("UCX: ", what, ": ", ucs_status_string(s)));
}

// The gets of one Get call in flight; lives on Get's stack until UCX completed them all.
struct GetBatch {
  absl::Mutex mu;
  int in_flight = 0;             // guarded by mu (read through absl::Condition)
  ucs_status_t status = UCS_OK;  // the first failure; guarded by mu
};

void GetDone(void* /*request*/, ucs_status_t status, void* user_data) {
  auto* batch = static_cast<GetBatch*>(user_data);
  absl::MutexLock lock(&batch->mu);
  --batch->in_flight;
  if (batch->status == UCS_OK) batch->status = status;
}

}  // namespace

struct UcxWeightsLink::Impl {
  Mode mode = Mode::kAuto;
  std::string host;
  std::string address;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  int efd = -1;
  std::thread thread;
  std::atomic<bool> stop{false};
  std::atomic<bool> stalled{false};  // StallForTesting

  absl::Mutex mu;
  bool closed ABSL_GUARDED_BY(mu) = false;
  std::map<std::string, ucp_ep_h> eps ABSL_GUARDED_BY(mu);  // by encoded address
  std::vector<ucp_ep_h> failed ABSL_GUARDED_BY(mu);         // to force-close on the loop
  std::vector<void*> closing;                               // progress thread only
  std::vector<ucp_ep_h> errored;                            // progress thread only
  // Readers: gets using a cached endpoint; writer: the loop closing endpoints. Before mu.
  absl::Mutex use_mu;

  // Whether `ep` is still the cached endpoint to `encoded` (not failed, not closed).
  bool Cached(const std::string& encoded, ucp_ep_h ep) {
    absl::MutexLock lock(&mu);
    auto it = eps.find(encoded);
    return it != eps.end() && it->second == ep;
  }

  // Runs inside ucp_worker_progress on the loop (under UCX's worker lock): takes no lock of
  // ours (EndpointTo holds mu across ucp_ep_create); the loop retires the endpoint after.
  static void EndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* self = static_cast<Impl*>(arg);
    FS_LOG(WARNING) << "UCX weights link: an endpoint to a source failed: "
                    << ucs_status_string(status);
    self->errored.push_back(ep);
  }

  // Endpoints that failed: out of the cache and onto `failed` (once: Fail may have done it).
  void RetireErrored() {
    if (errored.empty()) return;
    absl::MutexLock lock(&mu);
    for (ucp_ep_h ep : errored) {
      for (auto it = eps.begin(); it != eps.end(); ++it) {
        if (it->second == ep) {
          eps.erase(it);
          failed.push_back(ep);
          break;
        }
      }
    }
    errored.clear();
  }

  // Force-closes `ep` (its requests complete with an error); the loop finishes the close.
  void CloseOnLoop(ucp_ep_h ep) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* r = ucp_ep_close_nbx(ep, &p);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing.push_back(r);
  }

  void Loop() {
    // Polls while transfers move (gets that UCX emulates with messages need this side's
    // progress for each fragment); sleeps on the event fd after kSpin without progress.
    constexpr absl::Duration kSpin = absl::Microseconds(200);
    absl::Time last_progress = absl::InfinitePast();
    while (true) {
      if (stalled.load()) {
        // Nothing progresses (not even closes) until the process dies or shuts down.
        if (stop.load()) return;
        absl::SleepFor(absl::Milliseconds(10));
        continue;
      }
      if (ucp_worker_progress(worker) != 0) {
        while (ucp_worker_progress(worker) != 0) {
        }
        last_progress = absl::Now();
      }
      RetireErrored();
      std::vector<ucp_ep_h> to_close;
      {
        absl::MutexLock lock(&mu);
        to_close.swap(failed);
      }
      if (!to_close.empty()) {
        absl::WriterMutexLock use(&use_mu);
        for (ucp_ep_h ep : to_close) CloseOnLoop(ep);
      }
      for (size_t i = 0; i < closing.size();) {
        if (ucp_request_check_status(closing[i]) != UCS_INPROGRESS) {
          ucp_request_free(closing[i]);
          closing[i] = closing.back();
          closing.pop_back();
        } else {
          ++i;
        }
      }
      if (stop.load() && closing.empty()) {
        absl::MutexLock lock(&mu);
        if (failed.empty()) return;
        continue;
      }
      if (!closing.empty() || !to_close.empty()) continue;  // keep progressing the closes
      if (absl::Now() - last_progress < kSpin) continue;
      const ucs_status_t armed = ucp_worker_arm(worker);
      if (armed == UCS_ERR_BUSY) continue;
      pollfd pfd{efd, POLLIN, 0};
      // Woken by arrivals and ucp_worker_signal; the timeout only bounds a missed wake-up.
      (void)::poll(&pfd, 1, 100);
    }
  }

  absl::StatusOr<ucp_ep_h> EndpointTo(const std::string& encoded) {
    absl::MutexLock lock(&mu);
    if (closed) return absl::UnavailableError("flatshardd is shutting down");
    if (auto it = eps.find(encoded); it != eps.end()) return it->second;
    absl::StatusOr<UcxPeerAddress> peer = DecodeUcxAddress(encoded);
    if (!peer.ok()) return peer.status();
    const ucp_ep_params_t params = EndpointParams(*peer, WantsPeerErrorHandling(mode, *peer, host),
                                                  &Impl::EndpointError, this);
    ucp_ep_h ep = nullptr;
    const ucs_status_t s = ucp_ep_create(worker, &params, &ep);
    if (s != UCS_OK) return UcxError(absl::StatusCode::kUnavailable, "ucp_ep_create", s);
    eps[encoded] = ep;
    return ep;
  }

  // Drops `ep` from the cache (if still there) and force-closes it on the loop.
  void Fail(const std::string& encoded, ucp_ep_h ep) {
    {
      absl::MutexLock lock(&mu);
      auto it = eps.find(encoded);
      if (it == eps.end() || it->second != ep) return;  // already failed
      eps.erase(it);
      failed.push_back(ep);
    }
    ucp_worker_signal(worker);
  }
};

absl::StatusOr<std::unique_ptr<UcxWeightsLink>> UcxWeightsLink::Create(
    const std::string& error_handling) {
  auto impl = std::make_unique<Impl>();
  // "auto" is "peer" here: every endpoint of these copies gets peer error handling (a source
  // on this host too), so the gets may use CMA (process_vm_readv: one copy, no bounce through
  // messages) without UCX aborting when that source dies; the backend's "auto" leaves it out
  // for its same-host endpoints without error handling (ucx_endpoint.h).
  if (error_handling == "peer" || error_handling == "auto") {
    impl->mode = Mode::kPeer;
  } else if (error_handling == "none") {
    impl->mode = Mode::kNone;
  } else if (error_handling != "auto") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--ucx_error_handling must be 'auto', 'peer' or 'none', got '", error_handling, "'"));
  }
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return UcxError(absl::StatusCode::kUnavailable, "reading the configuration", s);
  // The backend's transports: the environment's UCX_TLS, else no CMA (ucx_endpoint.h).
  for (const auto& [key, value] : WithEndpointTransports(impl->mode, {})) {
    s = ucp_config_modify(config, key.c_str(), value.c_str());
    if (s != UCS_OK) {
      ucp_config_release(config);
      return UcxError(absl::StatusCode::kInvalidArgument, absl::StrCat("setting ", key), s);
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  params.name = "flatshard-weights";
  s = ucp_init(&params, config, &impl->context);
  ucp_config_release(config);
  if (s != UCS_OK) return UcxError(absl::StatusCode::kUnavailable, "ucp_init", s);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;  // gets and registrations come from gRPC threads
  s = ucp_worker_create(impl->context, &wp, &impl->worker);
  if (s != UCS_OK) {
    ucp_cleanup(impl->context);
    return UcxError(absl::StatusCode::kUnavailable, "ucp_worker_create", s);
  }
  ucp_address_t* addr = nullptr;
  size_t len = 0;
  s = ucp_worker_get_address(impl->worker, &addr, &len);
  if (s == UCS_OK) {
    impl->host = LocalHostIdentity();
    impl->address =
        EncodeUcxAddress(impl->host, absl::string_view(reinterpret_cast<const char*>(addr), len));
    ucp_worker_release_address(impl->worker, addr);
    s = ucp_worker_get_efd(impl->worker, &impl->efd);
  }
  if (s != UCS_OK) {
    ucp_worker_destroy(impl->worker);
    ucp_cleanup(impl->context);
    return UcxError(absl::StatusCode::kUnavailable, "the worker's address or event fd", s);
  }
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<UcxWeightsLink>(new UcxWeightsLink(std::move(impl)));
}

UcxWeightsLink::UcxWeightsLink(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

UcxWeightsLink::~UcxWeightsLink() {
  Shutdown();
  if (impl_->worker != nullptr) ucp_worker_destroy(impl_->worker);
  if (impl_->context != nullptr) ucp_cleanup(impl_->context);
}

void UcxWeightsLink::Shutdown() {
  {
    absl::MutexLock lock(&impl_->mu);
    if (impl_->closed) return;
    impl_->closed = true;
    for (auto& [address, ep] : impl_->eps) impl_->failed.push_back(ep);
    impl_->eps.clear();
  }
  impl_->stop.store(true);
  ucp_worker_signal(impl_->worker);
  impl_->thread.join();
}

absl::StatusOr<UcxWeightsLink::Registration> UcxWeightsLink::Register(void* data, size_t bytes) {
  {
    absl::MutexLock lock(&impl_->mu);
    if (impl_->closed) return absl::UnavailableError("flatshardd is shutting down");
  }
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = data;
  mp.length = bytes;
  ucp_mem_h mem = nullptr;
  const ucs_status_t s = ucp_mem_map(impl_->context, &mp, &mem);
  if (s != UCS_OK) {
    return UcxError(absl::StatusCode::kUnavailable,
                    absl::StrCat("registering ", bytes, " bytes (ucp_mem_map)"), s);
  }
  ucp_context_h context = impl_->context;
  Registration out;
  out.base = reinterpret_cast<uint64_t>(data);
  out.bytes = bytes;
  out.mapping = std::shared_ptr<void>(
      mem, [context](void* m) { ucp_mem_unmap(context, static_cast<ucp_mem_h>(m)); });
  return out;
}

absl::StatusOr<UcxWeightsLink::Exposure> UcxWeightsLink::Expose(const void* data, size_t bytes) {
  absl::StatusOr<Registration> reg = Register(const_cast<void*>(data), bytes);
  if (!reg.ok()) return reg.status();
  void* packed = nullptr;
  size_t packed_len = 0;
  const ucs_status_t s = ucp_rkey_pack(impl_->context, static_cast<ucp_mem_h>(reg->mapping.get()),
                                       &packed, &packed_len);
  if (s != UCS_OK) return UcxError(absl::StatusCode::kUnavailable, "ucp_rkey_pack", s);
  Exposure out;
  out.address = impl_->address;
  out.rkey.assign(static_cast<const char*>(packed), packed_len);
  ucp_rkey_buffer_release(packed);
  out.base = reg->base;
  out.mapping = std::move(reg->mapping);
  return out;
}

void UcxWeightsLink::StallForTesting() { impl_->stalled.store(true); }

absl::Status UcxWeightsLink::Get(const std::string& address, const std::string& rkey_bytes,
                                 uint64_t remote, void* dst, size_t bytes, absl::Time deadline,
                                 const absl::Notification* abandon, absl::string_view source,
                                 const Registration* local) {
  if (bytes == 0) return absl::OkStatus();
  const uint64_t first = reinterpret_cast<uint64_t>(dst);
  if (local != nullptr && (first < local->base || first + bytes > local->base + local->bytes)) {
    return absl::InvalidArgumentError("the get's destination is outside its registration");
  }
  absl::StatusOr<ucp_ep_h> ep = impl_->EndpointTo(address);
  if (!ep.ok()) return ep.status();
  ucp_rkey_h rkey = nullptr;
  {
    absl::ReaderMutexLock use(&impl_->use_mu);
    if (!impl_->Cached(address, *ep)) {
      return absl::UnavailableError("the endpoint to the source failed (another get on it)");
    }
    const ucs_status_t s = ucp_ep_rkey_unpack(*ep, rkey_bytes.data(), &rkey);
    if (s != UCS_OK) {
      return UcxError(absl::StatusCode::kDataLoss, "the source's remote key (ucp_ep_rkey_unpack)",
                      s);
    }
  }
  GetBatch batch;
  std::vector<void*> requests;  // freed once none is in flight
  absl::Status why;             // ours: the endpoint failed, the stream ended, the deadline
  size_t issued = 0;
  // Issues the next chunk's get; false when none was issued (why set on a failure).
  auto issue = [&]() -> bool {
    const size_t n = std::min(kGetChunk, bytes - issued);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &GetDone;
    p.user_data = &batch;
    if (local != nullptr) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = static_cast<ucp_mem_h>(local->mapping.get());
    }
    {
      absl::MutexLock lock(&batch.mu);
      ++batch.in_flight;  // before the get: its callback may run at once on the loop
    }
    void* r = nullptr;
    {
      // The endpoint is used only while it is cached (the loop closes failed ones under the
      // writer lock), so another get's failure cannot free it under this one.
      absl::ReaderMutexLock use(&impl_->use_mu);
      if (!impl_->Cached(address, *ep)) {
        why = absl::UnavailableError("the endpoint to the source failed (another get on it)");
      } else {
        r = ucp_get_nbx(*ep, static_cast<char*>(dst) + issued, n, remote + issued, rkey, &p);
      }
    }
    if (!why.ok() || r == nullptr || UCS_PTR_IS_ERR(r)) {
      absl::MutexLock lock(&batch.mu);
      --batch.in_flight;  // completed at once, failed, or never issued: no callback
    }
    if (!why.ok()) return false;
    if (UCS_PTR_IS_ERR(r)) {
      why = UcxError(absl::StatusCode::kUnavailable, "ucp_get_nbx", UCS_PTR_STATUS(r));
      impl_->Fail(address, *ep);
      return false;
    }
    if (r != nullptr) requests.push_back(r);
    issued += n;
    return true;
  };
  FS_VLOG(1) << "UCX weights link: a get of " << bytes << " bytes (" << kGetChunk
             << "-byte chunks, up to " << kGetsInFlight << " in flight) from " << source
             << " is in flight";
  ucs_status_t failed = UCS_OK;
  while (true) {
    // Keeps kGetsInFlight gets in flight while chunks remain and nothing failed.
    while (issued < bytes && why.ok()) {
      {
        absl::MutexLock lock(&batch.mu);
        if (batch.in_flight >= kGetsInFlight || batch.status != UCS_OK) break;
      }
      if (!issue()) break;
    }
    ucp_worker_signal(impl_->worker);  // the loop may sleep: the gets need progress
    absl::MutexLock lock(&batch.mu);
    const bool more = issued < bytes && why.ok() && batch.status == UCS_OK;
    if (!more && batch.in_flight == 0) {
      failed = batch.status;
      break;
    }
    // Wakes for a free slot (or the last completion); the stream to the source and the
    // deadline are checked every 50 ms meanwhile.
    struct Want {
      GetBatch* b;
      bool more;
    } want{&batch, more};
    const absl::Condition ready(
        +[](Want* w) {
          return w->b->in_flight == 0 ||
                 (w->more && w->b->in_flight < kGetsInFlight && w->b->status == UCS_OK);
        },
        &want);
    if (batch.mu.AwaitWithDeadline(ready,
                                   std::min(deadline, absl::Now() + absl::Milliseconds(50)))) {
      continue;
    }
    if (abandon != nullptr && abandon->HasBeenNotified()) {
      why = absl::UnavailableError("the source's stream ended during the get");
    } else if (absl::Now() >= deadline) {
      why = absl::DeadlineExceededError("the get did not finish before its deadline");
    } else {
      continue;
    }
    // Force-closing the endpoint completes the gets with an error; until then UCX may still
    // write into dst, so wait for every one.
    batch.mu.Unlock();
    impl_->Fail(address, *ep);
    batch.mu.Lock();
    batch.mu.Await(absl::Condition(
        +[](GetBatch* b) { return b->in_flight == 0; }, &batch));
    failed = batch.status;
    break;
  }
  for (void* r : requests) ucp_request_free(r);
  ucp_rkey_destroy(rkey);
  if (!why.ok()) return why;
  if (failed != UCS_OK) {
    impl_->Fail(address, *ep);
    return UcxError(absl::StatusCode::kUnavailable, "the get failed", failed);
  }
  return absl::OkStatus();
}

}  // namespace flatshard::server

#else  // !FS_HAVE_UCX

namespace flatshard::server {

struct UcxWeightsLink::Impl {};

absl::StatusOr<std::unique_ptr<UcxWeightsLink>> UcxWeightsLink::Create(const std::string&) {
  return absl::UnavailableError("this flatshardd was built without UCX");
}
UcxWeightsLink::UcxWeightsLink(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxWeightsLink::~UcxWeightsLink() = default;
void UcxWeightsLink::Shutdown() {}
absl::StatusOr<UcxWeightsLink::Exposure> UcxWeightsLink::Expose(const void*, size_t) {
  return absl::UnavailableError("this flatshardd was built without UCX");
}
absl::StatusOr<UcxWeightsLink::Registration> UcxWeightsLink::Register(void*, size_t) {
  return absl::UnavailableError("this flatshardd was built without UCX");
}
void UcxWeightsLink::StallForTesting() {}
absl::Status UcxWeightsLink::Get(const std::string&, const std::string&, uint64_t, void*, size_t,
                                 absl::Time, const absl::Notification*, absl::string_view,
                                 const Registration*) {
  return absl::UnavailableError("this flatshardd was built without UCX");
}

}  // namespace flatshard::server

#endif  // FS_HAVE_UCX
