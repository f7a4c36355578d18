#include "server/publish/publisher.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/limits.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/group/access.h"
#include "server/group_manager.h"
#include "server/metrics/registry.h"
#include "server/publish/distributed_publish.h"
#include "server/publish/publisher_internal.h"
#include "server/publish/segment_grant.h"
#include "server/shard_store.h"

namespace flatshard::server {

using publisher_internal::DescriptorOf;
using publisher_internal::OwnerText;
using publisher_internal::Quoted;

struct Publisher::Batch {
  PublishArgs first;  // the first arrival's arguments: every other rank's must equal them
  int32_t world_size = 0;
  absl::Time deadline = absl::InfiniteFuture();
  std::map<int32_t, PublishDone> arrived;  // by rank
  absl::Status refusal;                    // multi-daemon: this daemon lacks the GPU
};

struct Publisher::Job {
  PublishArgs args;
  std::vector<PublishDone> done;
  // Multi-daemon groups: the publish's number here, the leader's peer address (empty: this
  // daemon leads) and the group's token.
  bool multi = false;
  uint64_t seq = 0;
  std::string leader;
  std::string token;
  int64_t owner_uid = -1;
  // Why this daemon cannot take the version (a GPU it does not use): the publish fails on
  // every daemon with it (the leader reads every daemon's batch first, PublishRounds).
  absl::Status refusal;
};

namespace {

constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE; Debian 12's glibc headers lack it

struct WeightsMetrics {
  metrics::GaugeFamily& versions;
  metrics::GaugeFamily& bytes;
  metrics::GaugeFamily& readers;
  metrics::CounterFamily& publishes;
  metrics::CounterFamily& copied;
  metrics::CounterFamily& reused;
  metrics::GaugeFamily& spare_bytes;
  metrics::GaugeFamily& device_bytes;
  metrics::GaugeFamily& watches;
};

const WeightsMetrics& Metrics() {
  static const WeightsMetrics* m = [] {
    metrics::Registry& r = metrics::DefaultRegistry();
    return new WeightsMetrics{
        r.AddGauge("flatshard_weights_versions",
                   "Published versions of weights alive (kept, or held by a reader)"),
        r.AddGauge("flatshard_weights_bytes", "Bytes of the published versions alive"),
        r.AddGauge("flatshard_weights_readers", "Open reader leases on published versions"),
        r.AddCounter("flatshard_weights_publishes_total",
                     "Collective publishes of weights, by result", {"code"}),
        r.AddCounter("flatshard_weights_copied_bytes_total",
                     "Bytes copied into published versions: one copy per version, whatever "
                     "the number of readers (they map it)"),
        r.AddCounter("flatshard_weights_segment_reuses_total",
                     "Publishes that copied into the spare segment of an earlier version "
                     "instead of a fresh one"),
        r.AddGauge("flatshard_weights_spare_bytes",
                   "Bytes of the spare segments kept for the next version of their names"),
        r.AddGauge("flatshard_weights_device_bytes",
                   "Bytes of the published versions alive in GPU memory (also in "
                   "flatshard_weights_bytes)"),
        r.AddGauge("flatshard_weights_watches",
                   "Open watches of published weights (WaitForVersion, other daemons' follow "
                   "streams)")};
  }();
  return *m;
}

// "name" of field `what` that rank `rank` passed differs from the first rank's.
absl::Status Disagree(const PublishArgs& first, const PublishArgs& a, const char* what) {
  return absl::InvalidArgumentError(
      absl::StrCat("Publish of module \"", a.module, "\" in group ", a.caller.group, ": rank ",
                   a.caller.rank, " passed another ", what, " than rank ", first.caller.rank,
                   " (every rank passes the same arguments)"));
}

absl::Status Compare(const PublishArgs& first, const PublishArgs& a) {
  if (a.name != first.name) return Disagree(first, a, "name");
  if (a.dtype != first.dtype) return Disagree(first, a, "options.dtype");
  if (a.reader_uids != first.reader_uids) return Disagree(first, a, "options.reader_uids");
  if (a.reader_token != first.reader_token) return Disagree(first, a, "options.reader_token");
  if (a.device != first.device) return Disagree(first, a, "options.device");
  return absl::OkStatus();
}

}  // namespace

absl::Status Publisher::ValidateOptions(const PublisherOptions& options) {
  if (options.keep < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--weights_keep must be >= 1, got ", options.keep));
  }
  if (options.fill_threads < 1) {
    return absl::InvalidArgumentError("Publisher: fill_threads must be >= 1");
  }
  return absl::OkStatus();
}

Publisher::Publisher(PublisherOptions options)
    : options_(std::move(options)),
      files_(options_.files_dir),
      devices_(options_.store, options_.gpus),
      worker_([this] { Run(); }) {
  Metrics();  // every family shows (at 0) from the first scrape
}

Publisher::~Publisher() { Shutdown(); }

void Publisher::Shutdown() {
  std::vector<PublishDone> failed;
  std::map<uint64_t, WatchEntry> watches;
  std::map<uint64_t, std::shared_ptr<WeightsLeaseHolder>> holders;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    for (auto& [key, batch] : batches_) {
      for (auto& [rank, done] : batch->arrived) failed.push_back(std::move(done));
    }
    batches_.clear();
    for (Job& job : jobs_) {
      for (PublishDone& done : job.done) failed.push_back(std::move(done));
    }
    jobs_.clear();
    watches.swap(watches_);
    holders.swap(holders_);
    UpdateGaugesLocked();
  }
  for (PublishDone& done : failed) {
    done(absl::UnavailableError("flatshardd is shutting down: nothing was published"));
  }
  const absl::Status ended = absl::UnavailableError(
      "flatshardd is shutting down: the watch ended; watch again once it is back");
  for (auto& [id, w] : watches) w.watcher->End(ended);
  const absl::Status lease_ended = absl::UnavailableError(
      "flatshardd is shutting down: the lease's stream ended; the version stays mapped until "
      "the reader unmaps it (open it again once the daemon is back)");
  for (auto& [id, h] : holders) h->End(lease_ended);
  if (worker_.joinable()) worker_.join();
  spares_.Clear();
}

void Publisher::Publish(PublishArgs args, PublishDone done) {
  if (args.name.empty() || args.name.size() > kMaxGroupBytes) {
    done(absl::InvalidArgumentError(absl::StrCat("Publish: name must have 1 to ", kMaxGroupBytes,
                                                 " bytes, got ", args.name.size())));
    return;
  }
  if (args.dtype.has_value() && !IsFloatingPoint(*args.dtype)) {
    done(absl::InvalidArgumentError(absl::StrCat("Publish: options.dtype ", DTypeName(*args.dtype),
                                                 " is not a floating type (float32, float16, "
                                                 "bfloat16)")));
    return;
  }
  absl::Status refusal;  // a GPU this daemon does not use
  if (args.device != -1) {
    refusal = devices_.Check(args.name, args.device, args.reader_uids, args.reader_token);
    if (refusal.code() != absl::StatusCode::kOk &&
        refusal.code() != absl::StatusCode::kFailedPrecondition) {
      done(refusal);  // bad arguments: every daemon refuses them alike
      return;
    }
  }
  absl::StatusOr<GroupManager::PublisherGroup> group = options_.groups->CheckPublisher(args.caller);
  if (!group.ok()) {
    done(group.status());
    return;
  }
  if (!refusal.ok() && !group->multi) {
    done(refusal);
    return;
  }
  if (group->multi && options_.distributed == nullptr) {
    done(absl::FailedPreconditionError(
        absl::StrCat("Publish: group ", args.caller.group,
                     " has ranks on several daemons and this daemon has no peer channels")));
    return;
  }
  std::vector<PublishDone> failed;
  absl::Status why;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      why = absl::UnavailableError("flatshardd is shutting down: nothing was published");
      failed.push_back(std::move(done));
    } else {
      const auto bkey = std::make_pair(args.caller.group, args.module);
      std::unique_ptr<Batch>& batch = batches_[bkey];
      if (batch == nullptr) {
        batch = std::make_unique<Batch>();
        batch->first = args;
        // Multi-daemon groups: this daemon's ranks (the leader waits for the others').
        batch->world_size = group->multi ? group->local_ranks : group->world_size;
      }
      if (absl::Status s = Compare(batch->first, args); !s.ok()) {
        // Ranks that disagree: nobody publishes (the others would wait for nothing).
        why = s;
        for (auto& [rank, d] : batch->arrived) failed.push_back(std::move(d));
        failed.push_back(std::move(done));
        batches_.erase(bkey);
      } else {
        auto old = batch->arrived.find(args.caller.rank);
        if (old != batch->arrived.end()) {
          // The same rank again (a restarted trainer): its earlier call is answered by now
          // or was cancelled; the newest arrival counts.
          failed.push_back(std::move(old->second));
          why = absl::AbortedError(absl::StrCat("Publish: rank ", args.caller.rank,
                                                " called Publish again; this call was replaced"));
          batch->arrived.erase(old);
        }
        batch->deadline = std::min(batch->deadline, args.deadline);
        batch->arrived[args.caller.rank] = std::move(done);
        // Multi-daemon groups: the batch still forms, so the leader fails it everywhere.
        if (!refusal.ok()) batch->refusal = refusal;
        if (static_cast<int32_t>(batch->arrived.size()) == batch->world_size) {
          Job job;
          job.args = batch->first;
          for (auto& [rank, d] : batch->arrived) job.done.push_back(std::move(d));
          if (group->multi) {
            job.multi = true;
            job.leader = group->leader;
            job.refusal = batch->refusal;
            if (!job.refusal.ok() && job.leader.empty()) {
              job.refusal = absl::Status(
                  job.refusal.code(),
                  absl::StrCat("rank 0's daemon (the publish leader): ", job.refusal.message()));
            }
            job.seq = options_.distributed->rounds().Arrived(bkey.first, bkey.second, group->token,
                                                             job.leader.empty(), job.refusal);
            job.token = group->token;
            job.owner_uid = group->owner_uid;
          }
          batches_.erase(bkey);
          jobs_.push_back(std::move(job));
        }
      }
    }
  }
  for (PublishDone& d : failed) d(why);
}

void Publisher::Run() {
  while (true) {
    std::vector<std::pair<PublishDone, absl::Status>> expired;
    std::optional<Job> job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (stopping_ || !jobs_.empty()) return true;
        const absl::Time now = absl::Now();
        for (const auto& [key, b] : batches_) {
          if (b->deadline <= now) return true;
        }
        return false;
      };
      absl::Time wake = absl::InfiniteFuture();
      for (const auto& [key, b] : batches_) wake = std::min(wake, b->deadline);
      // Re-evaluated at most every 100 ms so that batches arriving meanwhile get their
      // deadlines seen (their arrival signals the lock's condition too).
      mu_.AwaitWithDeadline(absl::Condition(&ready),
                            std::min(wake, absl::Now() + absl::Milliseconds(100)));
      if (stopping_) return;
      const absl::Time now = absl::Now();
      for (auto it = batches_.begin(); it != batches_.end();) {
        if (it->second->deadline > now) {
          ++it;
          continue;
        }
        std::vector<int32_t> missing;
        for (int32_t r = 0; r < it->second->world_size; ++r) {
          if (!it->second->arrived.contains(r)) missing.push_back(r);
        }
        const absl::Status s = absl::DeadlineExceededError(
            absl::StrCat("Publish of module \"", it->first.second, "\" in group ", it->first.first,
                         ": rank(s) ", absl::StrJoin(missing, ", "),
                         " did not call Publish in time (it is collective: every rank calls it)"));
        for (auto& [rank, d] : it->second->arrived) expired.emplace_back(std::move(d), s);
        it = batches_.erase(it);
      }
      if (!jobs_.empty()) {
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
    }
    for (auto& [d, s] : expired) {
      Metrics().publishes.WithLabels({absl::StatusCodeToString(s.code())}).Increment();
      d(s);
    }
    if (job.has_value()) Build(std::move(*job));
  }
}

absl::StatusOr<std::shared_ptr<Buffer>> Publisher::ToDevice(const Buffer& host,
                                                            const PublishArgs& a, int64_t owner_uid,
                                                            const std::string& group) const {
  absl::StatusOr<std::shared_ptr<Buffer>> device = devices_.Upload(
      host, a.device, absl::StrCat("weights name=", a.name, " group=", group), owner_uid);
  if (!device.ok()) {
    return absl::Status(
        device.status().code(),
        absl::StrCat("Publish of weights ", Quoted(a.name), " (", host.bytes(), " bytes for ",
                     OwnerText(owner_uid), ") to GPU ", a.device, ": ", device.status().message()));
  }
  return device;
}

absl::StatusOr<std::shared_ptr<Publisher::Version>> Publisher::MakeVersion(const Job& job) {
  const PublishArgs& a = job.args;
  CheckpointArgs hold;
  hold.group = a.caller.group;
  hold.module = a.module;
  hold.uid = a.caller.uid;
  hold.wait = std::max(absl::Seconds(1), a.deadline - absl::Now());
  auto v = std::make_shared<Version>();
  FS_RETURN_IF_ERROR(options_.groups->ReadCommitted(hold, [&](const CommittedCopies& c) {
    FS_ASSIGN_OR_RETURN(v->layout, LayOutWeights(c.plan, c.manifest, a.dtype));
    std::vector<int32_t> ranks = c.ranks;
    std::vector<std::vector<std::shared_ptr<Buffer>>> by_unit = c.by_unit;
    if (!c.peers.empty()) {  // the leader of a multi-daemon group: the others' shards too
      FS_RETURN_IF_ERROR(
          options_.distributed->GatherShards(c, job.seq, a.deadline, &ranks, &by_unit));
    }
    // The other daemons' batches are paired now: they get this error from here.
    FS_RETURN_IF_ERROR(job.refusal);
    // The spare segment of an earlier version when one fits (spare_segments.h); device
    // versions fill a fresh host buffer and copy it to the GPU afterwards.
    if (a.device < 0) {
      v->buffer = spares_.Take(Key{c.owner_uid, a.name}, v->layout.bytes,
                               Version::GrantsOf(a.reader_uids, a.reader_token, false));
    }
    const bool reused = v->buffer != nullptr;
    Metrics().spare_bytes.WithLabels({}).Set(static_cast<double>(spares_.bytes()));
    absl::StatusOr<std::shared_ptr<Buffer>> buffer =
        reused ? absl::StatusOr<std::shared_ptr<Buffer>>(v->buffer)
               : options_.store->Allocate(BufferKind::kStaging, v->layout.bytes,
                                          absl::StrCat("weights name=", a.name, " group=", c.group),
                                          c.owner_uid);
    if (!buffer.ok()) {
      return absl::Status(
          buffer.status().code(),
          absl::StrCat("Publish of weights ", Quoted(a.name), " (", v->layout.bytes, " bytes for ",
                       OwnerText(c.owner_uid), "): ", buffer.status().message()));
    }
    v->buffer = *std::move(buffer);
    // A fresh segment: map every page in one call instead of one fault per page during the
    // copy (MADV_POPULATE_WRITE, Linux 5.14; older kernels refuse it and the copy faults them
    // in). A spare is mapped and backed already.
    if (!reused && v->layout.bytes > 0) {
      (void)::madvise(v->buffer->data(), static_cast<size_t>(v->layout.bytes), kPopulateWrite);
    }
    FS_RETURN_IF_ERROR(
        FillWeights(c.plan, v->layout, ranks, by_unit, v->buffer->data(), options_.fill_threads));
    Metrics().copied.WithLabels({}).Increment(static_cast<double>(v->layout.bytes));
    if (reused) Metrics().reused.WithLabels({}).Increment();
    v->info.generation = c.generation;
    v->info.owner_uid = c.owner_uid;
    v->info.group = c.group;
    v->info.module = c.module;
    return absl::OkStatus();
  }));
  if (a.device >= 0) {  // once filled, with the committed copies released again
    FS_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> device,
                        ToDevice(*v->buffer, a, v->info.owner_uid, v->info.group));
    // The group's other daemons copy the host bytes (Export); otherwise they are freed here.
    if (job.multi) v->peer_copy = std::move(v->buffer);
    v->buffer = std::move(device);
    v->info.device = a.device;
  }
  // Read-only from now on, for everybody (the daemon keeps its read-write descriptor).
  const int fd = v->buffer->segment_fd();
  if (fd >= 0) {
    FS_RETURN_IF_ERROR(SealReadOnly(fd));
    std::vector<int64_t> uids;
    for (int64_t u : a.reader_uids) {
      if (u >= 0 && u != v->info.owner_uid) uids.push_back(u);
    }
    if (!uids.empty()) {
      FS_RETURN_IF_ERROR(GrantRead(fd, uids));
      v->acl = uids;
    }
  }
  v->info.name = a.name;
  v->info.bytes = v->layout.bytes;
  v->info.tensors = static_cast<int32_t>(v->layout.entries.size());
  v->reader_uids = a.reader_uids;
  v->token = a.reader_token;
  return v;
}

void Publisher::Build(Job job) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::shared_ptr<Version>> made;
  if (job.multi && !job.leader.empty()) {
    // Not the leader: the version the leader built for this publish, copied here.
    // Not the leader: once the leader read this daemon's shards (pairing this batch with its
    // publish), the version it built for it, copied here.
    // A host version lands in the name's spare segment when one fits, as a pull does.
    std::function<std::shared_ptr<Buffer>(const CopiedVersion&)> spare;
    bool reused = false;
    if (job.args.device < 0) {
      spare = [this, &reused](const CopiedVersion& c) {
        std::shared_ptr<Buffer> b = TakeSpare(c);
        reused = b != nullptr;
        return b;
      };
    }
    absl::StatusOr<CopiedVersion> copy = options_.distributed->FetchFromLeader(
        {job.leader, job.args.caller.group, job.token, job.args.module, job.seq, job.args.name,
         job.owner_uid, job.args.deadline, std::move(spare)});
    // The leader got this daemon's refusal when it read its shards: it cannot have built it.
    if (copy.ok() && !job.refusal.ok()) copy = job.refusal;
    if (copy.ok() && reused) Metrics().reused.WithLabels({}).Increment();
    if (copy.ok() && job.args.device >= 0) {  // each daemon uploads to its own GPU
      absl::StatusOr<std::shared_ptr<Buffer>> device =
          ToDevice(*copy->buffer, job.args, copy->info.owner_uid, copy->info.group);
      if (device.ok()) {
        copy->buffer = *std::move(device);  // the copied host bytes are freed here
        copy->info.device = job.args.device;
      } else {
        copy = device.status();
      }
    }
    made = copy.ok() ? FromCopy(*std::move(copy)) : copy.status();
  } else {
    made = MakeVersion(job);
    // Multi-daemon: a commit landed between the daemons' holds; read them all again.
    for (int attempt = 2;
         job.multi && attempt <= 5 && made.status().code() == absl::StatusCode::kAborted;
         ++attempt) {
      FS_LOG(INFO) << "publish of weights " << Quoted(job.args.name) << ": " << made.status()
                   << "; reading again";
      absl::SleepFor(absl::Milliseconds(20 * attempt));
      made = MakeVersion(job);
    }
  }
  absl::StatusOr<WeightsInfo> result =
      made.ok() ? absl::StatusOr<WeightsInfo>(WeightsInfo{}) : made.status();
  std::vector<std::shared_ptr<Version>> freed;
  std::vector<std::pair<std::shared_ptr<WeightsWatcher>, WeightsInfo>> notify;
  std::vector<std::shared_ptr<Buffer>> old_copies;  // freed after the lock
  if (made.ok()) {
    std::shared_ptr<Version> v = *made;
    absl::MutexLock lock(&mu_);
    InsertLocked(v, &freed, &notify);
    result = v->info;
    // Older versions' host copies: the group's other daemons copied them before their ranks'
    // Publish returned, so before the ranks could publish again.
    for (auto& [n, old] : table_[Key{v->info.owner_uid, v->info.name}]) {
      if (old != v && old->peer_copy != nullptr) old_copies.push_back(std::move(old->peer_copy));
    }
  }
  if (job.multi && job.leader.empty()) {  // the other daemons copy it now (or fail with it)
    options_.distributed->rounds().Done(
        job.args.caller.group, job.args.module, job.seq,
        result.ok() ? absl::StatusOr<uint64_t>(result->version) : result.status());
  }
  Recycle(&freed);  // after the lock
  Metrics().publishes.WithLabels({absl::StatusCodeToString(result.status().code())}).Increment();
  if (result.ok()) {
    FS_LOG(INFO) << "published weights " << Quoted(result->name) << " version " << result->version
                 << " of " << OwnerText(result->owner_uid) << " group=" << result->group
                 << " module=\"" << result->module << "\" generation=" << result->generation << " ("
                 << result->bytes << " bytes, " << result->tensors << " tensors, "
                 << absl::ToDoubleMilliseconds(absl::Now() - start) << " ms)";
  } else {
    FS_LOG(WARNING) << "publish of weights " << Quoted(job.args.name)
                    << " group=" << job.args.caller.group << " failed: " << result.status();
  }
  for (auto& [w, info] : notify) w->Deliver(info);
  // The trainers are answered before the version is stored: writing it to disk (with fsync)
  // costs 25x the copy (256 MiB: 3.2 s vs 0.13 s on the development VM) and readers can use
  // it already. The next publish (this thread) waits for the write.
  for (PublishDone& d : job.done) d(result);
  job.done.clear();
  // Restarts: the newest version goes to the state directory.
  if (made.ok()) Store(**made);
}

void Publisher::InsertLocked(
    const std::shared_ptr<Version>& v, std::vector<std::shared_ptr<Version>>* freed,
    std::vector<std::pair<std::shared_ptr<WeightsWatcher>, WeightsInfo>>* notify) {
  const Key key{v->info.owner_uid, v->info.name};
  uint64_t& last = last_version_[key];
  if (v->info.version == 0) v->info.version = last + 1;
  last = std::max(last, v->info.version);
  table_[key][v->info.version] = v;
  TrimLocked(key, freed);
  for (auto& [id, w] : watches_) {
    // Copies may come out of order (a version asked by number): never one it told of already.
    if (w.key == key && v->info.version > w.after &&
        CheckReader(*v, w.uid, w.token, Admin(w.uid)).ok()) {
      w.after = v->info.version;
      notify->emplace_back(w.watcher, v->info);
    }
  }
  UpdateGaugesLocked();
}

void Publisher::TrimLocked(const Key& key, std::vector<std::shared_ptr<Version>>* freed) {
  auto it = table_.find(key);
  if (it == table_.end()) return;
  auto& versions = it->second;
  int newer = 0;  // versions newer than the one looked at
  for (auto v = versions.rbegin(); v != versions.rend();) {
    if (newer++ < options_.keep || v->second->readers > 0) {
      ++v;
      continue;
    }
    v->second->in_table = false;
    freed->push_back(v->second);
    v = decltype(v)(versions.erase(std::next(v).base()));
  }
  if (versions.empty()) table_.erase(it);
}

absl::Status Publisher::CheckReader(const Version& v, int64_t uid, const std::string& token,
                                    bool admin) {
  if (admin || uid == v.info.owner_uid) return absl::OkStatus();
  if (std::find(v.reader_uids.begin(), v.reader_uids.end(), uid) != v.reader_uids.end()) {
    return absl::OkStatus();
  }
  if (!v.token.empty() && internal::TokensEqual(token, v.token)) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat(OwnerText(uid), " may not read weights ", Quoted(v.info.name), " of ",
                   OwnerText(v.info.owner_uid),
                   token.empty() ? " (no reader token given" : " (wrong reader token",
                   "; the publisher grants uids with reader_uids and readers with reader_token)"));
}

absl::StatusOr<std::shared_ptr<Publisher::Version>> Publisher::FindLocked(
    const WeightsSelector& selector, int64_t uid) const {
  const int64_t owner = selector.owner_uid == -2 ? uid : selector.owner_uid;
  auto it = table_.find(Key{owner, selector.name});
  if (it == table_.end() || it->second.empty()) {
    return absl::NotFoundError(absl::StrCat("no published weights ", Quoted(selector.name), " of ",
                                            OwnerText(owner),
                                            " on this daemon (published versions survive a daemon "
                                            "restart unless it runs with --ephemeral, "
                                            "and then only the newest of each name; versions in "
                                            "GPU memory never do)"));
  }
  std::shared_ptr<Version> v;
  if (selector.version == 0) {
    v = it->second.rbegin()->second;
  } else if (auto f = it->second.find(selector.version); f != it->second.end()) {
    v = f->second;
  } else {
    std::vector<uint64_t> have;
    for (const auto& [n, x] : it->second) have.push_back(n);
    return absl::NotFoundError(absl::StrCat("weights ", Quoted(selector.name), " of ",
                                            OwnerText(owner), " have no version ", selector.version,
                                            " (versions here: ", absl::StrJoin(have, ", "), ")"));
  }
  FS_RETURN_IF_ERROR(CheckReader(*v, uid, selector.token, Admin(uid)));
  return v;
}

absl::StatusOr<WeightsDescriptor> Publisher::Open(const WeightsSelector& selector, int64_t uid,
                                                  uint64_t* lease,
                                                  std::shared_ptr<WeightsLeaseHolder> holder) {
  absl::MutexLock lock(&mu_);
  if (stopping_) {
    return absl::UnavailableError(
        absl::StrCat("flatshardd is shutting down: cannot open weights ", Quoted(selector.name)));
  }
  FS_ASSIGN_OR_RETURN(std::shared_ptr<Version> v, FindLocked(selector, uid));
  const int fd = v->buffer->segment_fd();
  // Admit the reader's uid to the segment (the kernel checks it at shm_open). Cheap
  // (an xattr on tmpfs), so it runs under the lock that orders the ACL's updates.
  if (fd >= 0 && uid != v->info.owner_uid && !Admin(uid)) {
    if (uid < 0) {
      FS_RETURN_IF_ERROR(GrantReadToAll(fd));
      v->world_readable = true;
    } else if (std::find(v->acl.begin(), v->acl.end(), uid) == v->acl.end()) {
      std::vector<int64_t> acl = v->acl;
      acl.push_back(uid);
      FS_RETURN_IF_ERROR(GrantRead(fd, acl));
      v->acl = std::move(acl);
    }
  }
  ++v->readers;
  *lease = next_id_++;
  leases_[*lease] = v;
  if (holder != nullptr) holders_[*lease] = std::move(holder);
  UpdateGaugesLocked();
  WeightsDescriptor d = DescriptorOf(v->info, *v->buffer, v->layout);
  d.info.readers = v->readers;
  return d;
}

void Publisher::Release(uint64_t lease) {
  std::vector<std::shared_ptr<Version>> freed;
  {
    absl::MutexLock lock(&mu_);
    auto it = leases_.find(lease);
    if (it == leases_.end()) return;
    std::shared_ptr<Version> v = std::move(it->second);
    leases_.erase(it);
    holders_.erase(lease);
    if (--v->readers == 0) {
      if (v->in_table) {
        TrimLocked(Key{v->info.owner_uid, v->info.name}, &freed);
      } else {
        freed.push_back(v);
      }
    }
    UpdateGaugesLocked();
  }
  Recycle(&freed);
}

absl::StatusOr<uint64_t> Publisher::Watch(const WeightsSelector& selector, int64_t uid,
                                          uint64_t after, std::shared_ptr<WeightsWatcher> watcher) {
  std::optional<WeightsInfo> now;
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      return absl::UnavailableError(absl::StrCat(
          "flatshardd is shutting down: cannot watch weights \"", selector.name, "\""));
    }
    const int64_t owner = selector.owner_uid == -2 ? uid : selector.owner_uid;
    const Key key{owner, selector.name};
    id = next_id_++;
    WatchEntry& w = watches_[id] = WatchEntry{key, uid, selector.token, watcher, after};
    UpdateGaugesLocked();
    if (auto it = table_.find(key); it != table_.end() && !it->second.empty()) {
      const Version& v = *it->second.rbegin()->second;
      if (v.info.version > after && CheckReader(v, uid, selector.token, Admin(uid)).ok()) {
        now = v.info;
        w.after = v.info.version;
      }
    }
  }
  if (now.has_value()) watcher->Deliver(*now);
  return id;
}

void Publisher::Unwatch(uint64_t id) {
  std::shared_ptr<WeightsWatcher> gone;  // released after the lock
  absl::MutexLock lock(&mu_);
  if (auto it = watches_.find(id); it != watches_.end()) {
    gone = std::move(it->second.watcher);
    watches_.erase(it);
    UpdateGaugesLocked();
  }
}

std::vector<WeightsInfo> Publisher::List(int64_t uid, const std::string& name) const {
  std::vector<WeightsInfo> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, versions] : table_) {
    if (!name.empty() && key.second != name) continue;
    for (const auto& [n, v] : versions) {
      if (!CheckReader(*v, uid, "", Admin(uid)).ok()) continue;
      out.push_back(v->info);
      out.back().readers = v->readers;
    }
  }
  return out;
}

absl::StatusOr<WeightsDescriptor> Publisher::Inspect(const WeightsSelector& selector,
                                                     int64_t uid) const {
  absl::MutexLock lock(&mu_);
  FS_ASSIGN_OR_RETURN(std::shared_ptr<Version> v, FindLocked(selector, uid));
  WeightsDescriptor d = DescriptorOf(v->info, *v->buffer, v->layout);
  d.info.readers = v->readers;
  return d;
}

absl::StatusOr<int> Publisher::Drop(const WeightsSelector& selector, int64_t uid) {
  std::vector<std::shared_ptr<Version>> freed;
  int dropped = 0;
  {
    absl::MutexLock lock(&mu_);
    const int64_t owner = selector.owner_uid == -2 ? uid : selector.owner_uid;
    WeightsSelector s = selector;
    s.owner_uid = owner;
    FS_RETURN_IF_ERROR(FindLocked(s, uid).status());
    if (uid != owner && !Admin(uid)) {
      return absl::PermissionDeniedError(
          absl::StrCat(OwnerText(uid), " may not drop weights ", Quoted(selector.name), " of ",
                       OwnerText(owner), " (only the owner or an admin may)"));
    }
    auto it = table_.find(Key{owner, selector.name});
    auto& versions = it->second;
    for (auto v = versions.begin(); v != versions.end();) {
      if (selector.version != 0 && v->first != selector.version) {
        ++v;
        continue;
      }
      v->second->in_table = false;
      v->second->dropped = true;
      if (v->second->readers == 0) freed.push_back(v->second);
      v = versions.erase(v);
      ++dropped;
    }
    if (versions.empty()) table_.erase(it);
    UpdateGaugesLocked();
  }
  // The stored newest version goes with it (file I/O: after the lock).
  const int64_t owner = selector.owner_uid == -2 ? uid : selector.owner_uid;
  {
    absl::MutexLock lock(&files_mu_);
    files_.Remove(owner, selector.name, selector.version);
    auto it = stored_.find(Key{owner, selector.name});
    if (it != stored_.end() && (selector.version == 0 || it->second == selector.version)) {
      stored_.erase(it);
    }
  }
  if (selector.version == 0) {
    spares_.Forget(Key{owner, selector.name});
    Metrics().spare_bytes.WithLabels({}).Set(static_cast<double>(spares_.bytes()));
  }
  freed.clear();  // dropped: freed, not reused
  FS_LOG(INFO) << "dropped " << dropped << " version(s) of weights " << Quoted(selector.name)
               << " (by " << OwnerText(uid) << ")";
  return dropped;
}

std::shared_ptr<Buffer> Publisher::TakeSpare(const CopiedVersion& copy) {
  std::shared_ptr<Buffer> spare =
      spares_.Take(Key{copy.info.owner_uid, copy.info.name}, copy.layout.bytes,
                   Version::GrantsOf(copy.reader_uids, copy.token, false));
  Metrics().spare_bytes.WithLabels({}).Set(static_cast<double>(spares_.bytes()));
  return spare;
}

void Publisher::Recycle(std::vector<std::shared_ptr<Version>>* freed) {
  for (std::shared_ptr<Version>& v : *freed) {
    // Only a segment nobody else holds (a file write in progress, a descriptor being built)
    // is reused; the daemon's own mapping then is the only one besides lapsed readers'.
    if (v.use_count() == 1 && !v->dropped && v->buffer != nullptr && !v->buffer->on_device() &&
        v->buffer.use_count() == 1) {
      spares_.Offer(Key{v->info.owner_uid, v->info.name}, std::move(v->buffer), v->Grants());
    }
  }
  freed->clear();
  Metrics().spare_bytes.WithLabels({}).Set(static_cast<double>(spares_.bytes()));
}

void Publisher::UpdateGaugesLocked() {
  std::set<const Version*> alive;
  int64_t bytes = 0, device_bytes = 0, readers = 0;
  auto add = [&](const std::shared_ptr<Version>& v) {
    if (!alive.insert(v.get()).second) return;
    bytes += v->info.bytes;
    if (v->info.device >= 0) device_bytes += v->info.bytes;
  };
  for (const auto& [key, versions] : table_) {
    for (const auto& [n, v] : versions) add(v);
  }
  for (const auto& [id, v] : leases_) {
    add(v);
    ++readers;
  }
  const WeightsMetrics& m = Metrics();
  m.versions.WithLabels({}).Set(static_cast<double>(alive.size()));
  m.bytes.WithLabels({}).Set(static_cast<double>(bytes));
  m.device_bytes.WithLabels({}).Set(static_cast<double>(device_bytes));
  m.readers.WithLabels({}).Set(static_cast<double>(readers));
  m.watches.WithLabels({}).Set(static_cast<double>(watches_.size()));
}

}  // namespace flatshard::server
