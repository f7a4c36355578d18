#pragma once
// WeightsService over gRPC's callback API (README "Publishing weights"): validate, convert,
// call the Publisher, finish. Publish finishes from the publisher's completion callback; the
// OpenWeights stream is a reader's lease (its end, however it comes, releases it, on the
// request workers) and WatchWeights streams new versions as the publisher reports them.
// Thread-safe.

#include "absl/time/time.h"
#include "flatshard/v1/weights_service.grpc.pb.h"
#include "server/publish/publisher.h"
#include "server/service/request_workers.h"

namespace flatshard::server {

namespace access {
class AccessControl;
}
class WeightsPuller;

class WeightsServiceImpl final : public v1::WeightsService::CallbackService {
 public:
  // `access` (may be null: every caller has uid -1) tells each call's uid. Both pointers must
  // outlive the service. `default_wait` bounds a Publish whose RPC carries no deadline.
  // `puller` (may be null: no --weights_sources): OpenWeights copies versions from the
  // sources first (weights_puller.h).
  // `workers` (must outlive the service) runs DropWeights (files removed, segments unmapped)
  // and the release of each OpenWeights lease (its version's last one unmaps it).
  WeightsServiceImpl(Publisher* publisher, RequestWorkers* workers,
                     const access::AccessControl* access, absl::Duration default_wait,
                     WeightsPuller* puller = nullptr)
      : publisher_(publisher),
        workers_(workers),
        access_(access),
        default_wait_(default_wait),
        puller_(puller) {}

  grpc::ServerUnaryReactor* Publish(grpc::CallbackServerContext* ctx,
                                    const v1::PublishRequest* request,
                                    v1::PublishResponse* response) override;
  grpc::ServerWriteReactor<v1::OpenWeightsResponse>* OpenWeights(
      grpc::CallbackServerContext* ctx, const v1::OpenWeightsRequest* request) override;
  grpc::ServerWriteReactor<v1::PublishedVersion>* WatchWeights(
      grpc::CallbackServerContext* ctx, const v1::WatchWeightsRequest* request) override;
  grpc::ServerUnaryReactor* ListWeights(grpc::CallbackServerContext* ctx,
                                        const v1::ListWeightsRequest* request,
                                        v1::ListWeightsResponse* response) override;
  grpc::ServerUnaryReactor* InspectWeights(grpc::CallbackServerContext* ctx,
                                           const v1::InspectWeightsRequest* request,
                                           v1::InspectWeightsResponse* response) override;
  grpc::ServerUnaryReactor* DropWeights(grpc::CallbackServerContext* ctx,
                                        const v1::DropWeightsRequest* request,
                                        v1::DropWeightsResponse* response) override;

 private:
  absl::StatusOr<int64_t> CallerUid(const grpc::CallbackServerContext* ctx) const;

  Publisher* const publisher_;
  RequestWorkers* const workers_;
  const access::AccessControl* const access_;
  const absl::Duration default_wait_;
  WeightsPuller* const puller_;
};

}  // namespace flatshard::server
