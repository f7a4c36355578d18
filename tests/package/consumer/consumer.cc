// A trainer built outside the flatshard source tree against an installed flatshard (CMake's
// find_package(flatshard) or pkg-config): one rank of a small job. It may include only the
// installed public headers. Prints one "OK" line, or the failed step on stderr with exit 1.
//
//   consumer --address unix:SOCK --group G --world_size N --rank R
//
// Every rank: checks the header version against the linked library, joins, registers a
// two-layer model with rank 0's initial values (kFromRank0), checks its layout
// (<flatshard/plan.h>: units, parameters, offsets, shard ranges) against the manifest and the
// views, summons everything read-only and checks rank 0's values, reduce-scatters gradients
// (rank r writes r+1 everywhere; SUM) and checks its gradient shards hold N(N+1)/2, then
// leaves.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "flatshard/client.h"
#include "flatshard/plan.h"
#include "flatshard/version.h"

namespace fc = flatshard::client;

namespace {

constexpr char kManifest[] = R"({
 "format": "flatshard.manifest/1",
 "root": {"id": 0, "type": "Net", "bases": ["Module"], "params": [], "children": [
  {"name": "fc1", "module": {"id": 1, "type": "Linear", "bases": ["Module"], "children": [],
   "params": [{"name": "weight", "id": 0, "shape": [6, 4], "dtype": "float32", "requires_grad": true},
              {"name": "bias", "id": 1, "shape": [6], "dtype": "float32", "requires_grad": true}]}},
  {"name": "fc2", "module": {"id": 2, "type": "Linear", "bases": ["Module"], "children": [],
   "params": [{"name": "weight", "id": 2, "shape": [3, 6], "dtype": "float32", "requires_grad": true}]}}
 ]}
})";
constexpr char kPolicy[] = R"({"format": "flatshard.policy/1", "auto_wrap": {"kind": "always"}})";
constexpr const char* kParams[] = {"fc1.weight", "fc1.bias", "fc2.weight"};
constexpr int64_t kNumels[] = {6 * 4, 6, 3 * 6};

float Initial(int param, int64_t i) { return static_cast<float>(param * 1000 + i) * 0.5f; }

int rank_ = -1;

[[noreturn]] void Fail(const std::string& step, const std::string& why) {
  std::fprintf(stderr, "consumer rank %d: %s: %s\n", rank_, step.c_str(), why.c_str());
  std::exit(1);
}
void Check(const absl::Status& status, const std::string& step) {
  if (!status.ok()) Fail(step, status.ToString());
}
void Expect(bool ok, const std::string& what) {
  if (!ok) Fail("layout", what);
}

// The registered layout as the manifest and policy ("always": one unit per Linear) say.
void CheckLayout(const fc::PlanLayout& layout, int world) {
  Expect(layout.world_size == world && layout.rank == rank_ && layout.shard_rank == rank_ &&
             layout.shard_world_size == world && layout.sharding_strategy == "FULL_SHARD",
         "world " + std::to_string(layout.world_size) + ", rank " + std::to_string(layout.rank));
  Expect(!layout.fingerprint.empty(), "no fingerprint");
  for (int p = 0; p < 3; ++p) {
    const fc::PlanLayout::Unit* unit = layout.FindUnitOf(kParams[p]);
    Expect(unit != nullptr, std::string("no unit holds ") + kParams[p]);
    Expect(unit->module == (p < 2 ? "fc1" : "fc2") && unit->module_type == "Linear",
           std::string(kParams[p]) + " is in unit of module " + unit->module);
    const fc::PlanLayout::Param* param = unit->FindParam(kParams[p]);
    Expect(param->numel == kNumels[p] && param->dtype == flatshard::DType::kFloat32,
           std::string(kParams[p]) + " has " + std::to_string(param->numel) + " elements");
    // use_orig_params=false: back to back in manifest order.
    Expect(param->offset == (p == 1 ? kNumels[0] : 0),
           std::string(kParams[p]) + " at offset " + std::to_string(param->offset));
  }
  for (const fc::PlanLayout::Unit& unit : layout.units) {
    int64_t numel = 0;
    for (const fc::PlanLayout::Param& p : unit.params) numel += p.numel;
    Expect(numel == unit.numel && unit.padded_numel == unit.shard_numel * world &&
               unit.padded_numel >= unit.numel,
           "unit " + std::to_string(unit.index) + " sizes");
    Expect(static_cast<int>(unit.shard_ranges.size()) == world,
           "unit " + std::to_string(unit.index) + " shard ranges");
    int64_t next = 0;
    for (const fc::PlanLayout::Range& r : unit.shard_ranges) {
      Expect(r.begin == next && r.size() == unit.shard_numel, "shard ranges are not contiguous");
      next = r.end;
    }
    Expect(next == unit.padded_numel && unit.local_shard == unit.shard_ranges[rank_],
           "unit " + std::to_string(unit.index) + ": local shard");
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string address, group;
  int world = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--address")
      address = value;
    else if (flag == "--group")
      group = value;
    else if (flag == "--world_size")
      world = std::atoi(value.c_str());
    else if (flag == "--rank")
      rank_ = std::atoi(value.c_str());
    else
      Fail("flags", "unknown flag " + flag);
  }
  if (address.empty() || group.empty() || world < 1 || rank_ < 0 || rank_ >= world) {
    Fail("flags", "usage: consumer --address A --group G --world_size N --rank R");
  }
  if (std::strcmp(fc::LibraryVersion(), FLATSHARD_VERSION_STRING) != 0) {
    Fail("version", std::string("headers are ") + FLATSHARD_VERSION_STRING + ", library is " +
                        fc::LibraryVersion());
  }

  fc::ClientOptions options;
  options.address = address;
  options.call_timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<fc::Client>> connected = fc::Client::Connect(options);
  Check(connected.status(), "connect");
  std::unique_ptr<fc::Client> client = std::move(*connected);
  Check(client->Join(group, world, rank_, "consumer-token"), "join");

  absl::StatusOr<fc::RegisteredModule> model =
      client->Register("", kManifest, kPolicy, fc::InitMode::kFromRank0);
  Check(model.status(), "register");
  if (model->layout == nullptr) Fail("register", "no layout");
  CheckLayout(*model->layout, world);
  if ((model->init_summon != nullptr && model->init_summon->has_views()) != (rank_ == 0)) {
    Fail("register", "the kFromRank0 init summon should have views on rank 0 only");
  }
  if (rank_ == 0) {
    for (int p = 0; p < 3; ++p) {
      const fc::ParamView* view = model->init_summon->Find(kParams[p]);
      if (view == nullptr || view->dtype != flatshard::DType::kFloat32 || !view->writable) {
        Fail("init", std::string("no writable float32 view of ") + kParams[p]);
      }
      float* data = static_cast<float*>(view->data);
      for (int64_t i = 0; i < view->numel; ++i) data[i] = Initial(p, i);
    }
  }
  if (model->init_summon != nullptr) Check(model->init_summon->End(), "init end");

  fc::SummonOptions read_only;
  read_only.writeback = false;
  absl::StatusOr<std::unique_ptr<fc::SummonedParams>> full = client->Summon("", "", read_only);
  Check(full.status(), "summon");
  int64_t elements = 0;
  std::map<int32_t, int64_t> unit_numel;  // a unit's parameter elements (shards add padding)
  for (int p = 0; p < 3; ++p) {
    const fc::ParamView* view = (*full)->Find(kParams[p]);
    if (view == nullptr) Fail("summon", std::string("no view of ") + kParams[p]);
    const float* data = static_cast<const float*>(view->data);
    for (int64_t i = 0; i < view->numel; ++i) {
      if (data[i] != Initial(p, i)) {
        Fail("summon", std::string(kParams[p]) + "[" + std::to_string(i) + "] is " +
                           std::to_string(data[i]) + ", want " + std::to_string(Initial(p, i)));
      }
    }
    elements += view->numel;
    unit_numel[view->unit] += view->numel;
    Expect(model->layout->FindUnitOf(kParams[p])->index == view->unit,
           std::string("the view of ") + kParams[p] + " is in another unit than the layout's");
  }
  Check((*full)->End(), "summon end");
  if (elements != 6 * 4 + 6 + 3 * 6)
    Fail("summon", "saw " + std::to_string(elements) + " elements");

  absl::StatusOr<fc::ShardViews> shards = client->GetShardViews("");
  Check(shards.status(), "shard views");
  const float mine = static_cast<float>(rank_ + 1);
  for (const fc::UnitShardView& unit : *shards) {
    Check(client->ReduceScatterGrads("", unit.unit, fc::ReduceOp::kSum, /*accumulate=*/false,
                                     [&](fc::PendingReduceScatter& grads) {
                                       float* g = static_cast<float*>(grads.data());
                                       for (int64_t i = 0; i < grads.numel(); ++i) g[i] = mine;
                                       return absl::OkStatus();
                                     }),
          "reduce-scatter unit " + std::to_string(unit.unit));
  }
  shards = client->GetShardViews("");
  Check(shards.status(), "shard views after reduce-scatter");
  const float want = static_cast<float>(world * (world + 1) / 2);
  int64_t checked = 0;
  for (const fc::UnitShardView& unit : *shards) {
    const fc::PlanLayout::Unit* planned = model->layout->FindUnit(unit.unit);
    Expect(planned != nullptr && planned->local_shard.begin == unit.shard_offset &&
               planned->local_shard.size() == unit.shard_numel &&
               planned->numel == unit_numel[unit.unit],
           "unit " + std::to_string(unit.unit) + ": the shard view differs from the layout");
    if (unit.grad == nullptr)
      Fail("grads", "unit " + std::to_string(unit.unit) + " has no gradient shard");
    const float* g = static_cast<const float*>(unit.grad);
    // Padding (after the unit's parameters, in the last ranks' shards) is not checked.
    for (int64_t i = 0; i < unit.shard_numel && unit.shard_offset + i < unit_numel[unit.unit];
         ++i) {
      if (g[i] != want) {
        Fail("grads", "unit " + std::to_string(unit.unit) + " grad[" + std::to_string(i) + "] is " +
                          std::to_string(g[i]) + ", want " + std::to_string(want));
      }
      ++checked;
    }
  }
  if (rank_ == 0 && checked == 0) Fail("grads", "rank 0 checked no gradient element");
  Check(client->Leave(), "leave");
  std::printf(
      "consumer rank %d/%d OK: flatshard %s, %lld elements summoned, %lld gradient "
      "elements checked, layout of %zu units (this rank's shard of unit %d: [%lld, %lld))\n",
      rank_, world, fc::LibraryVersion(), static_cast<long long>(elements),
      static_cast<long long>(checked), model->layout->units.size(),
      static_cast<int>(model->layout->units.front().index),
      static_cast<long long>(model->layout->units.front().local_shard.begin),
      static_cast<long long>(model->layout->units.front().local_shard.end));
  return 0;
}
