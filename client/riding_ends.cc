#include "client/riding_ends.h"

#include <memory>
#include <utility>

#include "common/limits.h"
#include "common/logging.h"

namespace flatshard::client::internal {

absl::Status RidingEnds::Take(SummonedList previous,
                              const std::function<bool(const SummonedParams&)>& rides,
                              const EndFn& end) {
  absl::Status first;
  for (std::unique_ptr<SummonedParams>& p : previous) {
    if (p == nullptr || p->ended_) continue;
    if (p->writeback_) {  // a collective with its own result
      first.Update(p->End());
      continue;
    }
    if (!rides(*p)) {
      // Another Client's, or an earlier session's (which its daemon ended): nothing rides.
      if (const absl::Status s = p->End(); !s.ok()) {
        FS_VLOG(1) << "end_first summon=" << p->id_ << ": " << s;
      }
      continue;
    }
    p->ended_ = true;  // its End is the Summon's (or EndEach's)
    p->params_ = ParamViews();
    p->grads_ = ParamViews();
    Riding r{p->session_, p->module_, p->id_, p->device_};
    if (riding_.size() == static_cast<size_t>(kMaxEndFirst)) {
      EndOne(r, end);
      continue;
    }
    riding_.push_back(std::move(r));
  }
  return first;
}

int RidingEnds::device() const {
  for (const Riding& r : riding_) {
    if (r.device >= 0) return r.device;
  }
  return -1;
}

void RidingEnds::AddTo(v1::SummonRequest* request) const {
  for (const Riding& r : riding_) request->add_end_first(r.id);
}

void RidingEnds::EndEach(const EndFn& end) const {
  for (const Riding& r : riding_) EndOne(r, end);
}

void RidingEnds::EndOne(const Riding& r, const EndFn& end) {
  const absl::Status s = end(r.session, r.module, r.id, r.device);
  if (!s.ok() && !absl::IsNotFound(s)) {
    FS_LOG(WARNING) << "summon=" << r.id << " module=\"" << r.module
                    << "\": ending it after the Summon it rode on failed: " << s;
  }
}

}  // namespace flatshard::client::internal
