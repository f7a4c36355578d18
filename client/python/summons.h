#pragma once
// The binding's summons: PySummoned (a SummonedParams handed to Python, ended once, its views'
// descriptions kept so arrays outlive the End) and PyPendingSummon (Client::StartSummon's).

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/python/binding_util.h"
#include "client/python/dlpack_export.h"
#include "client/python/memoryview_export.h"
#include "common/plan.h"
#include "flatshard/client.h"

namespace flatshard::python {

namespace py = pybind11;

class PySummoned {
 public:
  PySummoned(std::unique_ptr<client::SummonedParams> summoned, std::shared_ptr<const Plan> plan,
             bool device_as_host)
      : summoned_(std::move(summoned)),
        plan_(std::move(plan)),
        device_as_host_(device_as_host),
        params_(ViewSet::From(summoned_->params())),
        grads_(ViewSet::From(summoned_->grads())),
        units_(summoned_->units()),
        note_(summoned_->note()),
        id_(summoned_->id()),
        module_(summoned_->registered_module()) {}

  // Ends an unended summon (an RPC) without holding the GIL.
  ~PySummoned() {
    if (summoned_ == nullptr || ended_) return;
    WithoutGil([&] { summoned_.reset(); });
  }

  // client::SummonedParams::generation(): None until an End succeeded.
  std::optional<uint64_t> generation() const {
    return summoned_ == nullptr ? std::nullopt : summoned_->generation();
  }

  // Ends the summon (idempotent: later calls raise the first call's error again, or return).
  void End() {
    absl::Status status;
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      if (summoned_ != nullptr) status = summoned_->End();  // null: Release() took it
    }
    ended_ = true;
    Check(status);
  }

  // Hands the summon to a Summon that ends it in its own RPC (end_first); this object is
  // ended from now on. nullptr when it already was. Called with the GIL held.
  std::unique_ptr<client::SummonedParams> Release() {
    std::unique_ptr<client::SummonedParams> out;
    {
      py::gil_scoped_release release;  // an End in flight holds mu_ without the GIL
      std::lock_guard<std::mutex> lock(mu_);
      if (!ended_) out = std::move(summoned_);
    }
    ended_ = true;
    return out;
  }

  bool ended() const { return ended_; }
  bool has_views() const { return !ended_ && !params_.views.empty(); }

  // (fqn, unit, dtype name, shape, device, writable) per view; `grads`: the gradient views.
  py::list Describe(bool grads) const {
    py::list out;
    if (ended_) return out;
    for (const PyView& v : (grads ? grads_ : params_).views) {
      out.append(py::make_tuple(v.fqn, v.unit, std::string(DTypeName(v.region.dtype)),
                                py::tuple(py::cast(v.region.shape)), v.region.device, v.writable));
    }
    return out;
  }

  // A DLPack capsule per view, in Describe's order. `raw`: device memory as CUDA even for
  // simulated GPUs (what a real GPU client hands torch; tests describe it).
  py::list Dlpack(bool grads, bool raw) const {
    py::list out;
    if (ended_) return out;
    const ViewSet& set = grads ? grads_ : params_;
    for (const PyView& v : set.views) {
      out.append(ToDlpack(v.region, set.keep, device_as_host_ && !raw));
    }
    return out;
  }

  py::list Numpy(bool grads) const {
    py::list out;
    if (ended_) return out;
    const ViewSet& set = grads ? grads_ : params_;
    for (const PyView& v : set.views)
      out.append(ToNumpy(v.region, set.keep, v.writable, device_as_host_));
    return out;
  }

  // A memoryview per view, in Describe's order (no numpy or torch needed).
  py::list Memoryviews(bool grads) const {
    py::list out;
    if (ended_) return out;
    const ViewSet& set = grads ? grads_ : params_;
    for (const PyView& v : set.views)
      out.append(ToMemoryview(v.region, set.keep, v.writable, device_as_host_));
    return out;
  }

  // The whole padded flat buffer of `unit` (params, or grads) as a 1-D DLPack capsule.
  py::tuple Flat(int32_t unit, bool grads) const {
    if (ended_) {
      throw StatusError(absl::FailedPreconditionError(
          absl::StrCat("summon ", id_, " of module \"", module_, "\" has ended")));
    }
    const ViewSet& set = grads ? grads_ : params_;
    const PlanUnit* pu = nullptr;
    if (plan_ != nullptr) {
      for (const PlanUnit& u : plan_->units) {
        if (u.index == unit) pu = &u;
      }
    }
    const PyView* first = nullptr;
    for (const PyView& v : set.views) {
      if (v.unit == unit && pu != nullptr && !pu->params.empty() &&
          v.fqn == pu->params.front().fqn) {
        first = &v;
        break;
      }
    }
    if (first == nullptr) {
      throw StatusError(absl::NotFoundError(absl::StrCat(
          "summon ", id_, " of module \"", module_, "\" has no ", grads ? "gradient " : "",
          "view of unit ", unit, pu == nullptr ? " (the plan has no such unit)" : "")));
    }
    Region region = first->region;
    const int64_t item = ItemSize(region.dtype);
    region.data = first->region.data == nullptr
                      ? nullptr
                      : static_cast<char*>(first->region.data) - pu->params.front().offset * item;
    region.shape = {pu->padded_numel};
    return py::make_tuple(ToDlpack(region, set.keep, device_as_host_),
                          std::string(DTypeName(region.dtype)), region.device, first->writable);
  }

  py::list units() const { return py::cast(units_); }
  const std::string& note() const { return note_; }
  uint64_t id() const { return id_; }
  const std::string& module() const { return module_; }

 private:
  std::mutex mu_;  // End() needs exclusive access to summoned_
  std::unique_ptr<client::SummonedParams> summoned_;
  std::shared_ptr<const Plan> plan_;
  const bool device_as_host_;
  ViewSet params_;
  ViewSet grads_;
  std::vector<int32_t> units_;
  std::string note_;
  uint64_t id_;
  std::string module_;
  bool ended_ = false;  // read and written with the GIL held
};

// The summons behind `summons` for Client::Summon's end_first (each released: ended here).
inline client::SummonedList Release(const std::vector<std::shared_ptr<PySummoned>>& summons) {
  client::SummonedList out;
  for (const std::shared_ptr<PySummoned>& s : summons) {
    if (s != nullptr) out.push_back(s->Release());
  }
  return out;
}

// --- started summons (Client::StartSummon) ---------------------------------------------------

class PyPendingSummon {
 public:
  PyPendingSummon(std::unique_ptr<client::PendingSummon> pending, std::shared_ptr<const Plan> plan,
                  bool device_as_host)
      : pending_(std::move(pending)), plan_(std::move(plan)), device_as_host_(device_as_host) {}
  // Waits for (and ends, if never taken) the summon without holding the GIL.
  ~PyPendingSummon() {
    WithoutGil([&] { pending_.reset(); });
  }

  std::shared_ptr<PySummoned> Wait() {
    absl::StatusOr<std::unique_ptr<client::SummonedParams>> summoned;
    std::shared_ptr<PySummoned> out;
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      summoned = pending_->Wait();
      if (summoned.ok()) {
        out = std::make_shared<PySummoned>(*std::move(summoned), plan_, device_as_host_);
      }
    }
    if (out == nullptr) throw StatusError(summoned.status());
    return out;
  }
  bool ready() const { return pending_->ready(); }

 private:
  std::mutex mu_;
  std::unique_ptr<client::PendingSummon> pending_;
  const std::shared_ptr<const Plan> plan_;
  const bool device_as_host_;
};

}  // namespace flatshard::python
