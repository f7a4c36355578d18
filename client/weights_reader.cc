// WeightsReader and WeightsVersion (client.h), and Client::Publish's RPC.

#include "client/weights_reader.h"

#include <atomic>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/channel_target.h"
#include "client/client_internal.h"
#include "client/cuda_ipc.h"
#include "common/grpc_status.h"
#include "common/limits.h"
#include "common/shm_segment.h"
#include "common/status_macros.h"

namespace flatshard::client {
namespace internal {
namespace {

// proto DType = DType + 1 (0: unspecified); see types.proto.
v1::DType ToProtoDType(DType d) { return static_cast<v1::DType>(static_cast<int>(d) + 1); }

absl::StatusOr<DType> FromProtoDType(v1::DType d, const std::string& tensor) {
  if (d <= v1::DTYPE_UNSPECIFIED || d > v1::DTYPE_BOOL) {
    return absl::InternalError(
        absl::StrCat("OpenWeights: tensor \"", tensor, "\" has an unknown dtype ", d));
  }
  return static_cast<DType>(static_cast<int>(d) - 1);
}

void SetDeadline(grpc::ClientContext* ctx, absl::Duration timeout) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

v1::WeightsSelector SelectorOf(const std::string& name, const OpenWeightsOptions& o,
                               uint64_t version) {
  v1::WeightsSelector s;
  s.set_name(name);
  s.set_owner_uid(o.owner_uid);
  s.set_version(version);
  s.set_token(o.token);
  return s;
}

absl::Status CheckName(const char* method, const std::string& name) {
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(method, ": empty name"));
  return CheckLength(method, "name", name, kMaxGroupBytes);
}

}  // namespace

PublishedVersion FromProto(const v1::PublishedVersion& v) {
  PublishedVersion out;
  out.name = v.name();
  out.owner_uid = v.owner_uid();
  out.version = v.version();
  out.generation = v.generation();
  out.bytes = v.bytes();
  out.tensors = v.tensors();
  out.device = v.has_device() ? v.device() : -1;
  return out;
}

absl::StatusOr<PublishedVersion> PublishCall(const std::shared_ptr<grpc::Channel>& channel,
                                             const v1::Caller& caller, const std::string& module,
                                             const std::string& name, const PublishOptions& options,
                                             absl::Duration timeout) {
  FS_RETURN_IF_ERROR(CheckName("Publish", name));
  FS_RETURN_IF_ERROR(
      CheckLength("Publish", "options.reader_token", options.reader_token, kMaxTokenBytes));
  if (options.device < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Publish: options.device must be a GPU ordinal >= 0 or -1 (host), got ", options.device));
  }
  if (options.dtype.has_value() && !IsFloatingPoint(*options.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Publish: options.dtype ", DTypeName(*options.dtype), " is not a floating type"));
  }
  v1::PublishRequest request;
  *request.mutable_caller() = caller;
  request.set_registered_module(module);
  request.set_name(name);
  if (options.dtype.has_value()) request.mutable_options()->set_dtype(ToProtoDType(*options.dtype));
  for (int64_t uid : options.reader_uids) request.mutable_options()->add_reader_uids(uid);
  request.mutable_options()->set_reader_token(options.reader_token);
  if (options.device >= 0) request.mutable_options()->set_device(options.device);
  auto stub = v1::WeightsService::NewStub(channel);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, timeout);
  v1::PublishResponse response;
  FS_RETURN_IF_ERROR(FromGrpcStatus(stub->Publish(&ctx, request, &response)));
  return FromProto(response.version());
}

}  // namespace internal

// ---- WeightsVersion ----

// The open OpenWeights stream: the daemon holds the version while it is open.
struct WeightsVersion::Lease {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::OpenWeightsResponse>> reader;

  ~Lease() {
    ctx.TryCancel();
    if (reader != nullptr) (void)reader->Finish();  // CANCELLED: expected
  }
};

WeightsVersion::~WeightsVersion() { (void)Release(); }

const WeightsTensor* WeightsVersion::Find(absl::string_view fqn) const {
  for (const WeightsTensor& t : tensors_) {
    if (t.name == fqn) return &t;
  }
  return nullptr;
}

absl::Status WeightsVersion::Release() {
  lease_.reset();
  mapping_.reset();
  return absl::OkStatus();
}

// ---- WeightsReader ----

struct WeightsReader::Channel {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::WeightsService::Stub> stub;
  // Device versions: each pool slab is opened once while versions in it are open (CUDA IPC
  // refuses a second open of one allocation in a process), by (GPU uuid, handle).
  std::unique_ptr<internal::DeviceMemoryOpener> opener;
  absl::Mutex mu;
  std::map<std::string, std::weak_ptr<internal::DeviceMapping>> slabs ABSL_GUARDED_BY(mu);

  absl::StatusOr<std::shared_ptr<internal::DeviceMapping>> OpenSlab(const std::string& handle,
                                                                    const std::string& uuid) {
    absl::MutexLock lock(&mu);  // held across Open: two opens of one slab must not race
    const std::string key = absl::StrCat(uuid, "/", handle);
    if (std::shared_ptr<internal::DeviceMapping> m = slabs[key].lock()) return m;
    FS_ASSIGN_OR_RETURN(std::unique_ptr<internal::DeviceMapping> opened,
                        opener->Open(handle, uuid));
    std::shared_ptr<internal::DeviceMapping> m = std::move(opened);
    slabs[key] = m;
    for (auto it = slabs.begin(); it != slabs.end();) {  // forget slabs no version holds
      it = it->second.expired() ? slabs.erase(it) : std::next(it);
    }
    return m;
  }
};

WeightsReader::WeightsReader(ClientOptions options, std::unique_ptr<Channel> channel)
    : options_(std::move(options)), channel_(std::move(channel)) {}

WeightsReader::~WeightsReader() = default;

absl::StatusOr<std::unique_ptr<WeightsReader>> WeightsReader::Connect(ClientOptions options) {
  return Connect(std::move(options), internal::NewCudaIpcOpener());
}

absl::StatusOr<std::unique_ptr<WeightsReader>> internal::WeightsReaderAccess::Connect(
    ClientOptions options, std::unique_ptr<DeviceMemoryOpener> opener) {
  return WeightsReader::Connect(std::move(options), std::move(opener));
}

absl::StatusOr<std::unique_ptr<WeightsReader>> WeightsReader::Connect(
    ClientOptions options, std::unique_ptr<internal::DeviceMemoryOpener> opener) {
  FS_ASSIGN_OR_RETURN(options.address, internal::ChannelTarget(options.address));
  if (options.call_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("WeightsReader::Connect: call_timeout must be positive, got ",
                     absl::FormatDuration(options.call_timeout)));
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);  // indexes of large models exceed 4 MiB
  FS_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                      internal::ChannelCredentials(options));
  auto channel = std::make_unique<Channel>();
  channel->channel = grpc::CreateCustomChannel(options.address, credentials, args);
  if (!channel->channel->WaitForConnected(absl::ToChronoTime(absl::Now() + options.call_timeout))) {
    return absl::UnavailableError(absl::StrCat("cannot reach flatshardd at ", options.address,
                                               " within ",
                                               absl::FormatDuration(options.call_timeout)));
  }
  channel->stub = v1::WeightsService::NewStub(channel->channel);
  channel->opener = std::move(opener);
  return std::unique_ptr<WeightsReader>(new WeightsReader(std::move(options), std::move(channel)));
}

absl::StatusOr<std::unique_ptr<WeightsVersion>> WeightsReader::Open(
    const std::string& name, const OpenWeightsOptions& options) {
  FS_RETURN_IF_ERROR(internal::CheckName("Open", name));
  v1::OpenWeightsRequest request;
  *request.mutable_selector() = internal::SelectorOf(name, options, options.version.value_or(0));
  if (options.version.has_value() && *options.version == 0) {
    return absl::InvalidArgumentError("Open: version 0 does not exist (versions start at 1)");
  }
  auto lease = std::make_unique<WeightsVersion::Lease>();
  // The stream has no deadline: it lives as long as the version is held. The first message
  // must come within call_timeout, though.
  lease->reader = channel_->stub->OpenWeights(&lease->ctx, request);
  v1::OpenWeightsResponse d;
  {
    std::atomic<bool> got{false};
    absl::Mutex mu;
    bool done = false;
    // A watchdog cancels the stream if the descriptor does not arrive in time.
    std::thread watchdog([&] {
      absl::MutexLock lock(&mu);
      mu.AwaitWithTimeout(absl::Condition(&done), options_.call_timeout);
      if (!done) lease->ctx.TryCancel();
    });
    got = lease->reader->Read(&d);
    {
      absl::MutexLock lock(&mu);
      done = true;
    }
    watchdog.join();
    if (!got) {
      absl::Status s = FromGrpcStatus(lease->reader->Finish());
      lease->reader.reset();
      if (s.ok()) s = absl::InternalError("OpenWeights: the daemon sent no descriptor");
      if (s.code() == absl::StatusCode::kCancelled) {
        s = absl::DeadlineExceededError(absl::StrCat("Open of weights \"", name,
                                                     "\": no answer within ",
                                                     absl::FormatDuration(options_.call_timeout)));
      }
      return s;
    }
  }
  std::unique_ptr<WeightsVersion> v(new WeightsVersion());
  v->info_ = internal::FromProto(d.version());
  const char* base = nullptr;
  int device = -1;
  if (v->info_.device >= 0) {
    // In the daemon's GPU memory: the pool slab through CUDA IPC, the version inside it.
    absl::StatusOr<std::shared_ptr<internal::DeviceMapping>> slab =
        channel_->OpenSlab(d.ipc_handle(), d.device_uuid());
    if (!slab.ok()) {
      return absl::Status(
          slab.status().code(),
          absl::StrCat("Open of weights \"", name, "\" version ", v->info_.version,
                       ": it is in device memory of the daemon's GPU ", v->info_.device, " (",
                       d.device_uuid(), "): ", slab.status().message()));
    }
    if (d.offset() > d.segment_bytes()) {
      return absl::InternalError(absl::StrCat("OpenWeights: offset ", d.offset(),
                                              " is outside the ", d.segment_bytes(), "-byte slab"));
    }
    base = static_cast<const char*>((*slab)->data()) + d.offset();
    device = (*slab)->device();
    v->mapping_ = std::shared_ptr<const void>(*slab, (*slab)->data());
  } else {
    auto segment = std::make_shared<ShmSegment>();
    FS_ASSIGN_OR_RETURN(*segment, ShmSegment::Open(d.segment(), d.segment_bytes(), false));
    base = static_cast<const char*>(segment->data());
    v->mapping_ = std::shared_ptr<const void>(segment, segment->data());
  }
  const uint64_t limit = d.segment_bytes() - (v->info_.device >= 0 ? d.offset() : 0);
  for (const v1::WeightsTensor& t : d.tensors()) {
    if (t.offset() + t.bytes() > limit || t.offset() + t.bytes() < t.offset()) {
      return absl::InternalError(absl::StrCat("OpenWeights: tensor \"", t.name(), "\" at ",
                                              t.offset(), "+", t.bytes(), " is outside the ",
                                              d.segment_bytes(), "-byte segment"));
    }
    WeightsTensor w;
    w.name = t.name();
    FS_ASSIGN_OR_RETURN(w.dtype, internal::FromProtoDType(t.dtype(), t.name()));
    w.shape.assign(t.shape().begin(), t.shape().end());
    w.data = base == nullptr ? nullptr : base + t.offset();
    w.bytes = static_cast<int64_t>(t.bytes());
    w.device = device;
    v->tensors_.push_back(std::move(w));
  }
  v->lease_ = std::move(lease);
  return v;
}

absl::StatusOr<PublishedVersion> WeightsReader::WaitForVersion(const std::string& name,
                                                               uint64_t after,
                                                               absl::Duration timeout,
                                                               const OpenWeightsOptions& options) {
  FS_RETURN_IF_ERROR(internal::CheckName("WaitForVersion", name));
  v1::WatchWeightsRequest request;
  *request.mutable_selector() = internal::SelectorOf(name, options, after);
  grpc::ClientContext ctx;
  internal::SetDeadline(&ctx, timeout);
  std::unique_ptr<grpc::ClientReader<v1::PublishedVersion>> reader =
      channel_->stub->WatchWeights(&ctx, request);
  v1::PublishedVersion v;
  if (reader->Read(&v)) {
    ctx.TryCancel();
    (void)reader->Finish();
    return internal::FromProto(v);
  }
  absl::Status s = FromGrpcStatus(reader->Finish());
  if (s.ok() || s.code() == absl::StatusCode::kDeadlineExceeded) {
    return absl::DeadlineExceededError(absl::StrCat("no version of weights \"", name,
                                                    "\" newer than ", after, " appeared within ",
                                                    absl::FormatDuration(timeout)));
  }
  return s;
}

absl::StatusOr<std::vector<PublishedVersion>> WeightsReader::List() {
  grpc::ClientContext ctx;
  internal::SetDeadline(&ctx, options_.call_timeout);
  v1::ListWeightsRequest request;
  v1::ListWeightsResponse response;
  FS_RETURN_IF_ERROR(FromGrpcStatus(channel_->stub->ListWeights(&ctx, request, &response)));
  std::vector<PublishedVersion> out;
  for (const v1::PublishedVersion& v : response.versions()) out.push_back(internal::FromProto(v));
  return out;
}

}  // namespace flatshard::client
