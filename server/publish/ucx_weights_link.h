#pragma once
// UcxWeightsLink: the UCX worker of this daemon's copies of published weights between daemons
// (--weights_transport=ucx; README "Published weights across daemons"). A source registers a
// sealed version's segment (Expose) and hands a puller its worker address and packed rkey in
// the FetchVersion stream; the puller reads its share with one-sided gets (Get) straight into
// its destination buffer. A worker of its own, not the collective backend's: the pulling
// daemon is no member of the group, and the copies need UCX's RMA feature.
//
// Endpoints: UCX peer error handling on every one (--ucx_error_handling auto or peer; none:
// none), transports by the backend's rule (ucx_endpoint.h: CMA left out only where endpoints
// without error handling exist). A source that dies fails the get; the caller's `abandon`
// (its gRPC stream to the source ended) also force-closes the endpoint, which fails the get
// where UCX cannot tell. Every wait has a deadline.
//
// Thread-safe: UCS_THREAD_MODE_MULTI, one progress thread that sleeps on the worker's event fd
// (a source's worker must progress for gets that UCX emulates with messages, e.g. over TCP).
// Built without UCX, Create answers UNAVAILABLE.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace flatshard::server {

class UcxWeightsLink {
 public:
  // `error_handling`: "auto", "peer" or "none", as --ucx_error_handling.
  static absl::StatusOr<std::unique_ptr<UcxWeightsLink>> Create(const std::string& error_handling);
  ~UcxWeightsLink();

  // Memory registered with UCX (ucp_mem_map of the existing pages) until the last copy of
  // `mapping` is dropped (ucp_mem_unmap). A get's destination inside one skips UCX's
  // registration (cache lookup, or a bounce buffer) per get; over RDMA its gets go zero-copy.
  struct Registration {
    uint64_t base = 0;
    size_t bytes = 0;
    std::shared_ptr<void> mapping;  // the ucp_mem_h
  };
  absl::StatusOr<Registration> Register(void* data, size_t bytes);

  // A segment readable by remote gets until this is destroyed (ucp_mem_unmap).
  struct Exposure {
    std::string address;  // this worker's address (ucx_address.h form)
    std::string rkey;     // packed remote key of the segment
    uint64_t base = 0;    // the segment's first byte, as the puller addresses it
    std::shared_ptr<void> mapping;
  };
  absl::StatusOr<Exposure> Expose(const void* data, size_t bytes);

  // Reads `bytes` at `remote` of the segment that `rkey` of the worker at `address` covers into
  // `dst`: gets of kGetChunk bytes, up to kGetsInFlight at once (one large get is one request
  // that some transports, e.g. TCP's emulated gets, serve a fragment per round trip). Returns
  // once the bytes are there or a get failed; after `deadline`, or once `abandon` is
  // notified, the endpoint is force-closed and the gets fail (DEADLINE_EXCEEDED,
  // UNAVAILABLE). Never returns while UCX may still write into `dst`. `local` (optional): a
  // registration holding all of [dst, dst + bytes). `source` names the source in the log line
  // (--v=1) saying the gets are in flight.
  static constexpr size_t kGetChunk = 8 << 20;
  static constexpr int kGetsInFlight = 8;
  absl::Status Get(const std::string& address, const std::string& rkey, uint64_t remote, void* dst,
                   size_t bytes, absl::Time deadline, const absl::Notification* abandon,
                   absl::string_view source = "", const Registration* local = nullptr);

  // Tests only (--testing_weights_ucx_stall_after): the progress thread stops progressing the
  // worker for good, so gets that need this side's progress (UCX emulates them with messages,
  // e.g. over TCP) stay in flight until this process dies. Shutdown still returns.
  void StallForTesting();

  // Closes the endpoints and stops the progress thread; later calls fail UNAVAILABLE.
  // Idempotent.
  void Shutdown();

  struct Impl;

 private:
  explicit UcxWeightsLink(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The daemon's choice (--weights_transport, "ucx" or "grpc"): a link for "ucx", null for
// "grpc", when UCX cannot start here (then copies use gRPC; logged with the reason) or when
// `copies` is false (the daemon copies nothing between daemons). The choice shows as
// flatshard_weights_transport{transport} 1. INVALID_ARGUMENT naming the flag for another
// value (also without `copies`).
absl::StatusOr<std::unique_ptr<UcxWeightsLink>> OpenWeightsLink(const std::string& transport,
                                                                const std::string& error_handling,
                                                                bool copies);

}  // namespace flatshard::server
