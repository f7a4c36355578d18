#include "server/service/admin_service_impl.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"

namespace flatshard::server {

grpc::ServerUnaryReactor* AdminServiceImpl::ListPendingCollectives(
    grpc::CallbackServerContext* ctx, const v1::ListPendingCollectivesRequest* request,
    v1::ListPendingCollectivesResponse* response) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::vector<GroupManager::GroupCollectives> groups = groups_->ListCollectives(request->group());
  if (!request->group().empty() && groups.empty()) {
    reactor->Finish(ToGrpcStatus(
        absl::NotFoundError(absl::StrCat("this daemon hosts no group ", request->group()))));
    return reactor;
  }
  for (const GroupManager::GroupCollectives& g : groups) {
    v1::GroupCollectives* out = response->add_groups();
    out->set_group(g.group);
    out->set_world_size(g.world_size);
    out->set_epoch(g.epoch);
    for (int32_t r : g.local_ranks) out->add_local_ranks(r);
    out->set_status(g.status.ok() ? std::string("OK") : g.status.ToString());
    for (const collective::PendingOpInfo& op : g.pending) {
      v1::PendingCollective* p = out->add_pending();
      p->set_op_seq(op.op_seq);
      p->set_kind(std::string(collective::CollectiveKindName(op.kind)));
      p->set_unit(op.unit);
      p->set_bytes(op.bytes);
      p->set_name(op.name);
      for (int r : op.arrived_ranks) p->add_arrived_ranks(r);
      for (int r : op.missing_ranks) p->add_missing_ranks(r);
      p->set_age_seconds(absl::ToDoubleSeconds(op.age));
      p->set_running(op.running);
    }
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace flatshard::server
