#pragma once
// What the calls Client::StartSummon and Client::StartFinish started hand back to the
// objects that wait for them (PendingSummon, FinishingReduceScatter): the job runs on the
// client's OrderedCalls lane and fills its result once.

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "flatshard/client.h"

namespace flatshard::client::internal {

// What a started summon (Client::StartSummon) hands back to its PendingSummon.
struct SummonJob {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::StatusOr<std::unique_ptr<SummonedParams>> result ABSL_GUARDED_BY(mu);
};

// What a started reduce-scatter finish (Client::StartFinish) hands back.
struct FinishJob {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
};

}  // namespace flatshard::client::internal
