#pragma once
// The NCCL backend: collectives on CUDA device memory, natively in NCCL (no Transport, no ring
// algorithms of ours).
//
// One Communicator per group holds one NCCL communicator per local rank (GroupSpec::local_ranks
// with their devices in GroupSpec::local_devices; one rank per GPU), one non-blocking CUDA
// stream per local rank, and one thread that makes every CUDA and NCCL call of the group
// (STYLE §4: state changes on the progress thread; public methods post work):
// - Connect validates the spec and starts the thread; the thread initialises the NCCL
//   communicators with ncclCommInitRankConfig (config.blocking = 0, all local ranks inside
//   one ncclGroupStart/End) and polls ncclCommGetAsyncError until init completes. Connect
//   does not wait for remote ranks: ops issued meanwhile queue. An init that fails or takes
//   longer than NcclBackendOptions::init_timeout becomes the sticky error.
// - Ops of all local ranks at one op_seq are launched together in one ncclGroupStart/End (one
//   thread driving several GPUs deadlocks otherwise), in op_seq order. With fingerprints on,
//   each op is preceded by an ncclAllGather of the 32-byte WireDescriptor of every rank
//   (op_descriptor.h); a mismatch fails every rank of every daemon with the same ABORTED
//   "collective mismatch at op_seq N: ..." message. Completion is a recorded CUDA event per
//   stream, polled together with ncclCommGetAsyncError; `done` runs on the group's thread
//   once the bytes are in place.
// - The local ranks' calls meet in a LocalRendezvous (local_rendezvous.h: argument and op_seq
//   checks, deadlines of waiting calls, sticky status, pending listing, shared with inproc);
//   the thread takes each op whose local ranks all arrived from it, in op_seq order.
// - Deadlines (OpOptions::deadline, init_timeout), Abort(), an async NCCL error (a peer died:
//   UNAVAILABLE with ncclGetLastError's text) or a bad argument make the group's status
//   sticky: every local NCCL communicator is aborted with ncclCommAbort (never
//   ncclCommDestroy after an error) and every pending and later op fails with that status,
//   including an op whose data NCCL was already moving (unlike the host backends, its
//   output is then undefined).
// - Destruction without an error finalizes the NCCL communicators (ncclCommFinalize, polled
//   for at most NcclBackendOptions::finalize_timeout) and destroys them; otherwise, or on
//   timeout, it aborts them. Pending ops fail with ABORTED "NCCL communicator destroyed".
//
// Zero-byte ops launch no data transfer: they synchronise through the fingerprint exchange
// (with fingerprints off they complete once every local rank has issued them).
// Buffers must be device memory (MemoryKind::kCuda) on the issuing rank's GPU; two local ranks
// never share an output (they are on different GPUs). PendingOps() names the local ranks that
// arrived and those missing; remote ranks are not tracked.
//
// Thread safety: the backend and its Communicators are thread-safe. Callbacks run on the
// group's thread, on the backend's deadline thread (calls still waiting for local ranks when
// their deadline passes), or on the calling thread (calls that fail at once, and waiting calls
// failed by Abort); a Communicator may be destroyed from its own callback (the group's thread
// then finishes on its own).

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/collective/backend.h"

namespace flatshard::collective {

struct NcclBackendOptions {
  // How long a group's NCCL init (all ranks of all daemons joining) may take before the group
  // fails with DEADLINE_EXCEEDED.
  absl::Duration init_timeout = absl::Seconds(120);
  // How long a clean destruction waits for ncclCommFinalize before aborting instead.
  absl::Duration finalize_timeout = absl::Seconds(10);
  // Exchange and compare op descriptors before every op (one 32-byte ncclAllGather per rank).
  // Off: mismatches between daemons are not detected (they corrupt data or hang until the
  // deadline); mismatches between local ranks still are.
  bool fingerprint = true;
  // Sleep between two polls of CUDA events and NCCL async errors while GPU work is in flight.
  absl::Duration poll_interval = absl::Microseconds(20);
};

// Creates the backend. Needs no GPU: IsViable() says whether one is usable, and Connect fails
// with FAILED_PRECONDITION when none is. Needs libnccl (loaded at run time, nccl_library.h):
// FAILED_PRECONDITION naming it and where it was looked for when it cannot be loaded.
// INVALID_ARGUMENT for non-positive timeouts.
// Name() "nccl"; Supports(kCuda) only.
absl::StatusOr<std::unique_ptr<CollectiveBackend>> CreateNcclBackend(
    NcclBackendOptions options = {});

// A fresh ncclUniqueId as NCCL_UNIQUE_ID_BYTES (128) bytes, for GroupSpec::nccl_unique_id: rank
// 0's daemon makes one per group epoch and the rendezvous hands it to every daemon. Needs no
// GPU (NCCL only picks a bootstrap network interface). UNAVAILABLE when NCCL finds no usable
// interface; FAILED_PRECONDITION when libnccl cannot be loaded; INTERNAL for other NCCL errors.
absl::StatusOr<std::string> MakeNcclUniqueId();

// `result` (an ncclResult_t) as a status: OK for ncclSuccess and ncclInProgress (non-blocking
// calls report progress that way); UNAVAILABLE for ncclRemoteError and ncclSystemError (a peer
// or the network failed); INVALID_ARGUMENT for ncclInvalidArgument and ncclInvalidUsage;
// INTERNAL otherwise. The message is "<what>: <ncclGetErrorString>[: <last_error>]", where
// `last_error` is ncclGetLastError's text (omitted when empty).
absl::Status NcclStatus(int result, absl::string_view what, absl::string_view last_error = "");

}  // namespace flatshard::collective
