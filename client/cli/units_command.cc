// `flatshardctl units GROUP [--module M]`: a group's registered modules, unit by unit and local
// rank by rank.

#include <iostream>

#include <nlohmann/json.hpp>
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli/admin_command.h"
#include "client/cli/admin_commands.h"

namespace flatshard::cli {
namespace {

std::string LastOp(const v1::UnitStatus& u) {
  if (u.last_op().empty()) return "-";
  return absl::StrCat(u.last_op(), " rank ", u.last_op_rank(), u.last_op_ok() ? "" : " (failed)");
}

void PrintUnits(const v1::ListUnitsResponse& r) {
  if (r.modules().empty()) {
    std::cout << "group " << r.group() << ": no registered modules\n";
    return;
  }
  for (const v1::ModuleUnits& m : r.modules()) {
    std::cout << absl::StrFormat("group %s  module %s  %d units  %s\n", r.group(),
                                 ModuleName(m.module()), m.units().size(),
                                 m.initialized() ? absl::StrCat("generation ", m.generation())
                                                 : std::string("NOT INITIALISED"));
    std::vector<std::vector<std::string>> rows = {{"UNIT", "MODULE", "RANK", "STATE", "SHARD_B",
                                                   "GRAD_B", "UNSHARDED_B", "STATE_B", "LAST_OP",
                                                   "AGE"}};
    for (const v1::UnitStatus& u : m.units()) {
      for (const v1::UnitRank& rank : u.ranks()) {
        rows.push_back(
            {absl::StrCat(u.unit()), ModuleName(u.module()), absl::StrCat(rank.rank()),
             rank.state(), absl::StrCat(rank.shard_bytes()), absl::StrCat(rank.grad_bytes()),
             absl::StrCat(rank.unsharded_bytes()), absl::StrCat(rank.state_bytes()), LastOp(u),
             u.last_op().empty() ? "-" : absl::StrFormat("%.1fs", u.last_op_age_seconds())});
      }
    }
    std::cout << FormatTable(rows, "  ");
  }
}

nlohmann::json UnitsJson(const v1::ListUnitsResponse& r) {
  nlohmann::json modules = nlohmann::json::array();
  for (const v1::ModuleUnits& m : r.modules()) {
    nlohmann::json units = nlohmann::json::array();
    for (const v1::UnitStatus& u : m.units()) {
      nlohmann::json ranks = nlohmann::json::array();
      for (const v1::UnitRank& rank : u.ranks()) {
        ranks.push_back({{"rank", rank.rank()},
                         {"state", rank.state()},
                         {"shard_bytes", rank.shard_bytes()},
                         {"grad_bytes", rank.grad_bytes()},
                         {"unsharded_bytes", rank.unsharded_bytes()},
                         {"state_bytes", rank.state_bytes()}});
      }
      nlohmann::json last_op = nullptr;
      if (!u.last_op().empty()) {
        last_op = {{"op", u.last_op()},
                   {"rank", u.last_op_rank()},
                   {"age_seconds", u.last_op_age_seconds()},
                   {"ok", u.last_op_ok()}};
      }
      units.push_back(
          {{"unit", u.unit()}, {"module", u.module()}, {"ranks", ranks}, {"last_op", last_op}});
    }
    modules.push_back({{"module", m.module()},
                       {"initialized", m.initialized()},
                       {"generation", m.generation()},
                       {"units", units}});
  }
  return {{"group", r.group()}, {"modules", modules}};
}

}  // namespace

int RunUnitsCommand(const std::vector<std::string>& args) {
  AdminCommandSpec spec;
  spec.name = "units";
  spec.synopsis = "GROUP [--module M]";
  spec.description =
      "Lists a group's registered modules unit by unit, one row per rank this daemon hosts:\n"
      "the unit's module, its state on that rank (IDLE, or SUMMONED while a summon is open),\n"
      "the bytes of the rank's shard, gradient shard and the unsharded buffers its open\n"
      "summons hold, and the unit's last operation here (summon, end, reduce_scatter) with\n"
      "the rank that made it and its age. Each module's header says its committed generation\n"
      "(the step every rank rolls back to after a failure), or NOT INITIALISED while its\n"
      "initial values have not committed on every rank.\n";
  spec.flags = {{"module", "M", "only the registered module M ('--module=' for the root)"}};
  spec.min_args = 1;
  spec.max_args = 1;
  spec.args_name = "GROUP";
  return RunAdminCommand(spec, args, [](AdminCall& call) {
    v1::ListUnitsRequest request;
    request.set_group(call.args()[0]);
    if (auto module = call.flags().Get("module")) request.set_module(*module);
    return CallAndPrint(call, &v1::AdminService::Stub::ListUnits, request, UnitsJson, PrintUnits);
  });
}

}  // namespace flatshard::cli
