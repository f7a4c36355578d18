// The registration exchange: allocation of one rank's buffers and the agreement all-gathers.

#include "server/registration.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/planner.h"
#include "common/sha256.h"
#include "server/messages.h"
#include "server/module/unit_ops.h"

namespace flatshard::server {

using internal::CopyText;
using internal::Display;
using internal::TextOf;
using internal::UnitSummary;

namespace {

// What each rank puts into a registration's agreement exchange (an all-gather): enough for
// every rank to reach the same verdict, so all of them commit or none.
struct RegisterRecord {
  char fingerprint[64];
  uint32_t units;
  uint8_t planned;    // 1: the rank's manifest and policy were accepted
  uint8_t allocated;  // 1: the rank's shards (and init buffers) are allocated
  uint8_t init;
  // A refused plan's absl::StatusCode (INVALID_ARGUMENT for bad input, FAILED_PRECONDITION
  // for a group HYBRID_* cannot shard over); 0 from daemons that never set it: INVALID_ARGUMENT.
  uint8_t refused_code;
  char text[440];  // why planning or allocation failed; NUL-padded, truncated
};
static_assert(sizeof(RegisterRecord) == 512);

// Per-unit digests (16 hex digits of a SHA-256) find the first differing unit.
constexpr size_t kUnitDigestBytes = 16;
// A unit's one-line description, exchanged once the first differing unit is known.
constexpr size_t kUnitSummaryBytes = 384;

std::string UnitDigest(const PlanUnit& u) {
  std::string canon =
      absl::StrCat(u.module, "|", u.module_type, "|", DTypeName(u.dtype), "|", u.requires_grad, "|",
                   u.numel, "|", u.padded_numel, "|", u.shard_numel);
  for (const PlanParam& p : u.params) {
    absl::StrAppend(&canon, "|", p.fqn, ":", absl::StrJoin(p.shape, "x"), "@", p.offset);
  }
  for (const SharedParam& sp : u.shared) absl::StrAppend(&canon, "|", sp.fqn, "=", sp.same_as);
  return Sha256Hex(canon).substr(0, kUnitDigestBytes);
}

// One rank's agreement between its arrival and the verdict: up to three all-gathers over the
// group's collectives, each step deciding from what every rank sent whether the verdict is
// known or the next exchange is needed.
class RegistrationExchange : public std::enable_shared_from_this<RegistrationExchange> {
 public:
  RegistrationExchange(std::shared_ptr<collective::CollectiveGroup> coll,
                       RegistrationProposal proposal, absl::Time deadline, Clock* clock,
                       absl::AnyInvocable<void(absl::Status)> done)
      : coll_(std::move(coll)),
        p_(std::move(proposal)),
        deadline_(deadline),
        clock_(clock),
        done_(std::move(done)) {}

  // Step 1: every rank's record.
  void ExchangeRecords() {
    const absl::StatusOr<Plan>& plan = *p_.plan;
    std::memset(&mine_, 0, sizeof(mine_));
    mine_.planned = plan.ok() ? 1 : 0;
    mine_.allocated = p_.allocation.ok() ? 1 : 0;
    mine_.init = static_cast<uint8_t>(p_.init);
    mine_.refused_code = plan.ok() ? 0 : static_cast<uint8_t>(plan.status().code());
    if (plan.ok()) {
      std::memcpy(mine_.fingerprint, plan->fingerprint.data(),
                  std::min<size_t>(plan->fingerprint.size(), sizeof(mine_.fingerprint)));
      mine_.units = static_cast<uint32_t>(plan->units.size());
    }
    CopyText(!plan.ok() ? plan.status().message() : p_.allocation.message(), mine_.text,
             sizeof(mine_.text));
    all_.resize(p_.world_size);
    AllGather(collective::ConstBuffer{&mine_, sizeof(RegisterRecord)},
              collective::MutableBuffer{all_.data(), all_.size() * sizeof(RegisterRecord)},
              &RegistrationExchange::OnRecords);
  }

 private:
  using Step = void (RegistrationExchange::*)();

  // Runs one all-gather of the exchange for this rank; `next` runs when it succeeded, the
  // verdict is its error otherwise.
  void AllGather(collective::ConstBuffer in, collective::MutableBuffer out, Step next) {
    std::vector<collective::CollectiveOp> ops;
    ops.push_back(collective::CollectiveOp::AllGather(-1, in, out));
    ops.back().name = "register";
    coll_->SubmitAll(p_.rank, std::move(ops), deadline_ - clock_->Now(),
                     [self = shared_from_this(), next](absl::Status s) {
                       if (!s.ok()) {
                         self->Finish(std::move(s));
                         return;
                       }
                       ((*self).*next)();
                     });
  }

  void Finish(absl::Status verdict) {
    // Only the first verdict counts; the exchange ends with it.
    if (done_) std::exchange(done_, nullptr)(std::move(verdict));
  }

  std::string Where() const {
    return absl::StrCat("group ", p_.group, ": ranks registered different models for module ",
                        Display(p_.module), ": ");
  }

  // After step 1: a refused plan, a corrupt record, different plans (go on to step 2),
  // different init modes, a failed allocation; else everyone agrees.
  void OnRecords() {
    for (int32_t k = 0; k < p_.world_size; ++k) {
      if (all_[k].planned) continue;
      const absl::StatusCode code = all_[k].refused_code == 0
                                        ? absl::StatusCode::kInvalidArgument
                                        : static_cast<absl::StatusCode>(all_[k].refused_code);
      Finish(k == p_.rank
                 ? p_.plan->status()
                 : absl::Status(code, absl::StrCat("group ", p_.group, ": rank ", k,
                                                   "'s registration of module ", Display(p_.module),
                                                   " was refused: ",
                                                   TextOf(all_[k].text, sizeof(all_[k].text)))));
      return;
    }
    for (int32_t k = 0; k < p_.world_size; ++k) {
      // Units come from plans, which have at most one per module path; a larger count is a
      // corrupt record and must not size the digest exchange.
      if (all_[k].units <= PlanOptions().max_module_paths) continue;
      Finish(absl::InternalError(absl::StrCat("group ", p_.group, ": rank ", k,
                                              "'s registration record claims ", all_[k].units,
                                              " units")));
      return;
    }
    const RegisterRecord& first = all_[0];
    for (int32_t k = 1; k < p_.world_size; ++k) {
      if (std::memcmp(first.fingerprint, all_[k].fingerprint, sizeof(first.fingerprint)) != 0) {
        diff_rank_ = k;
        ExchangeDigests();
        return;
      }
      if (all_[k].init != first.init) {
        Finish(absl::InvalidArgumentError(
            absl::StrCat(Where(), "rank 0 and rank ", k, " asked for different init modes")));
        return;
      }
    }
    for (int32_t k = 0; k < p_.world_size; ++k) {
      if (all_[k].allocated) continue;
      Finish(absl::ResourceExhaustedError(absl::StrCat(
          "group ", p_.group, ": rank ", k, " could not allocate the shards of module ",
          Display(p_.module), ": ", TextOf(all_[k].text, sizeof(all_[k].text)))));
      return;
    }
    Finish(absl::OkStatus());
  }

  // Step 2: the plans differ; every rank's per-unit digests find the first differing unit.
  void ExchangeDigests() {
    max_units_ = 0;
    for (const RegisterRecord& rec : all_) max_units_ = std::max<int64_t>(max_units_, rec.units);
    my_digests_.assign(max_units_ * kUnitDigestBytes, '-');
    for (const PlanUnit& u : (*p_.plan)->units) {
      my_digests_.replace(u.index * kUnitDigestBytes, kUnitDigestBytes, UnitDigest(u));
    }
    all_digests_.assign(my_digests_.size() * p_.world_size, '\0');
    AllGather(collective::ConstBuffer{my_digests_.data(), my_digests_.size()},
              collective::MutableBuffer{all_digests_.data(), all_digests_.size()},
              &RegistrationExchange::OnDigests);
  }

  void OnDigests() {
    const uint32_t units_a = all_[0].units;
    const uint32_t units_b = all_[diff_rank_].units;
    const size_t stride = max_units_ * kUnitDigestBytes;
    const char* a = all_digests_.data();
    const char* b = a + diff_rank_ * stride;
    int64_t i = 0;
    while (i < std::min(units_a, units_b) &&
           std::memcmp(a + i * kUnitDigestBytes, b + i * kUnitDigestBytes, kUnitDigestBytes) == 0) {
      ++i;
    }
    diff_unit_ = i;
    if (i < std::min(units_a, units_b)) {
      ExchangeSummaries();
      return;
    }
    Finish(absl::InvalidArgumentError(
        units_a != units_b
            ? absl::StrCat(Where(), "rank 0 has ", units_a, " units, rank ", diff_rank_, " has ",
                           units_b, " (first difference at unit ", i, ")")
            : absl::StrCat(Where(),
                           "the plans differ outside the units (ignored "
                           "parameters or options)")));
  }

  // Step 3: every rank describes the first differing unit, so all name both sides.
  void ExchangeSummaries() {
    const Plan& plan = **p_.plan;
    const std::string summary = diff_unit_ < static_cast<int64_t>(plan.units.size())
                                    ? UnitSummary(plan.units[diff_unit_])
                                    : "";
    CopyText(summary, my_summary_.data(), my_summary_.size());
    all_summaries_.assign(kUnitSummaryBytes * p_.world_size, '\0');
    AllGather(collective::ConstBuffer{my_summary_.data(), my_summary_.size()},
              collective::MutableBuffer{all_summaries_.data(), all_summaries_.size()},
              &RegistrationExchange::OnSummaries);
  }

  void OnSummaries() {
    const char* sa = all_summaries_.data();
    const char* sb = sa + diff_rank_ * kUnitSummaryBytes;
    Finish(absl::InvalidArgumentError(absl::StrCat(Where(), "first difference at unit ", diff_unit_,
                                                   ": rank 0 has ", TextOf(sa, kUnitSummaryBytes),
                                                   ", rank ", diff_rank_, " has ",
                                                   TextOf(sb, kUnitSummaryBytes))));
  }

  const std::shared_ptr<collective::CollectiveGroup> coll_;
  const RegistrationProposal p_;
  const absl::Time deadline_;
  Clock* const clock_;
  absl::AnyInvocable<void(absl::Status)> done_;
  // The buffers of the all-gathers: alive until the exchange ends (the callbacks hold it).
  RegisterRecord mine_{};
  std::vector<RegisterRecord> all_;
  int32_t diff_rank_ = 0;  // the first rank whose plan differs from rank 0's
  int64_t max_units_ = 0;
  std::string my_digests_;
  std::string all_digests_;
  int64_t diff_unit_ = 0;
  std::array<char, kUnitSummaryBytes> my_summary_{};
  std::vector<char> all_summaries_;
};

}  // namespace

RegistrationBuffers AllocateRegistration(ShardStore& store, const Plan& plan, const Caller& caller,
                                         const std::string& module, InitMode init,
                                         Placement placement) {
  RegistrationBuffers out;
  const bool init_views =
      init == InitMode::kFromEveryRank || (init == InitMode::kFromRank0 && caller.rank == 0);
  for (const PlanUnit& u : plan.units) {
    absl::StatusOr<std::shared_ptr<Buffer>> shard =
        store.Allocate(BufferKind::kShard, u.shard_numel * ItemSize(u.dtype),
                       absl::StrCat("group=", caller.group, " module=", module, " unit=", u.index,
                                    " rank=", caller.rank),
                       caller.uid, placement);
    if (!shard.ok()) {
      out.status = shard.status();
      break;
    }
    out.shards.push_back(UnitShard{u.index, *std::move(shard), nullptr});
    // The committed copy of the shard (semantics.md §3a): what a rollback restores.
    absl::StatusOr<std::shared_ptr<Buffer>> kept =
        store.Allocate(BufferKind::kShard, u.shard_numel * ItemSize(u.dtype),
                       absl::StrCat("group=", caller.group, " module=", module, " unit=", u.index,
                                    " rank=", caller.rank, " committed"),
                       caller.uid, placement);
    if (!kept.ok()) {
      out.status = kept.status();
      break;
    }
    out.committed.push_back(*std::move(kept));
    std::shared_ptr<Buffer> view;
    if (init_views) {
      absl::StatusOr<std::shared_ptr<Buffer>> b = store.Allocate(
          BufferKind::kUnsharded, u.padded_numel * ItemSize(u.dtype),
          absl::StrCat("group=", caller.group, " unit=", u.index, " rank=", caller.rank, " init"),
          caller.uid, placement);
      if (!b.ok()) {
        out.status = b.status();
        break;
      }
      view = *std::move(b);
    }
    out.init_buffers.push_back(std::move(view));
  }
  if (!out.status.ok()) {
    out.shards.clear();
    out.committed.clear();
    out.init_buffers.clear();
  }
  return out;
}

void AgreeOnRegistration(std::shared_ptr<collective::CollectiveGroup> coll,
                         RegistrationProposal proposal, absl::Time deadline, Clock* clock,
                         absl::AnyInvocable<void(absl::Status)> done) {
  std::make_shared<RegistrationExchange>(std::move(coll), std::move(proposal), deadline, clock,
                                         std::move(done))
      ->ExchangeRecords();
}

}  // namespace flatshard::server
