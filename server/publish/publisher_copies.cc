// Publisher's state directory (Store, Adopt) and its copies between daemons (AddCopy,
// Export): the versions that outlive this daemon or come from another one.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/publish/publisher.h"
#include "server/publish/publisher_internal.h"
#include "server/publish/segment_grant.h"
#include "server/shard_store.h"

namespace flatshard::server {

using publisher_internal::DescriptorOf;
using publisher_internal::OwnerText;
using publisher_internal::Quoted;

void Publisher::StoreNewest(int64_t owner_uid, const std::string& name) {
  if (!files_.enabled()) return;
  std::shared_ptr<Version> v;  // held: its bytes stay while they are written
  {
    absl::MutexLock lock(&mu_);
    auto it = table_.find(Key{owner_uid, name});
    if (it == table_.end() || it->second.empty()) return;
    v = it->second.rbegin()->second;
  }
  Store(*v);
}

void Publisher::Store(const Version& v) {
  if (!files_.enabled()) return;
  absl::MutexLock lock(&files_mu_);
  const Key key{v.info.owner_uid, v.info.name};
  // Writers race (the worker, pullers): the file never goes back to an older version.
  if (auto it = stored_.find(key); it != stored_.end() && it->second >= v.info.version) return;
  if (v.buffer->on_device()) {
    // Not stored (a restart loses it); the name's older stored version must not come back
    // in its place after a restart.
    files_.Remove(v.info.owner_uid, v.info.name, 0);
    stored_.erase(key);
    return;
  }
  {
    StoredWeights meta{v.info.name,
                       v.info.owner_uid,
                       v.info.version,
                       v.info.generation,
                       v.info.group,
                       v.info.module,
                       v.reader_uids,
                       v.token,
                       v.layout,
                       "",
                       0};
    if (absl::Status s = files_.Write(meta, v.buffer->data()); !s.ok()) {
      FS_LOG(WARNING) << "weights " << Quoted(v.info.name) << " version " << v.info.version
                      << " is here but will not survive a restart: " << s;
    } else {
      stored_[key] = v.info.version;
    }
  }
}

absl::StatusOr<std::shared_ptr<Publisher::Version>> Publisher::FromCopy(CopiedVersion copy) {
  auto v = std::make_shared<Version>();
  v->info = std::move(copy.info);
  v->info.readers = 0;
  v->buffer = std::move(copy.buffer);
  v->layout = std::move(copy.layout);
  v->reader_uids = std::move(copy.reader_uids);
  v->token = std::move(copy.token);
  const int fd = v->buffer->segment_fd();
  if (fd >= 0) {
    FS_RETURN_IF_ERROR(SealReadOnly(fd));
    for (int64_t u : v->reader_uids) {
      if (u >= 0 && u != v->info.owner_uid) v->acl.push_back(u);
    }
    if (!v->acl.empty()) FS_RETURN_IF_ERROR(GrantRead(fd, v->acl));
  }
  return v;
}

absl::StatusOr<WeightsInfo> Publisher::AddCopy(CopiedVersion copy) {
  FS_ASSIGN_OR_RETURN(std::shared_ptr<Version> v, FromCopy(std::move(copy)));
  std::vector<std::shared_ptr<Version>> freed;
  std::vector<std::pair<std::shared_ptr<WeightsWatcher>, WeightsInfo>> notify;
  WeightsInfo info;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("flatshardd is shutting down");
    const Key key{v->info.owner_uid, v->info.name};
    auto& versions = table_[key];
    if (auto it = versions.find(v->info.version); it != versions.end()) {
      info = it->second->info;  // another copy of it came first: keep that one
      freed.push_back(std::move(v));
    } else {
      InsertLocked(v, &freed, &notify);
      info = v->info;
    }
  }
  Recycle(&freed);  // after the lock
  for (auto& [w, i] : notify) w->Deliver(i);
  return info;
}

absl::StatusOr<ExportedVersion> Publisher::Export(const WeightsSelector& selector,
                                                  int64_t uid) const {
  absl::MutexLock lock(&mu_);
  FS_ASSIGN_OR_RETURN(std::shared_ptr<Version> v, FindLocked(selector, uid));
  if (v->info.device >= 0 && selector.group_peer && v->peer_copy != nullptr) {
    // The group's other daemons copy the host bytes the leader uploaded (each to its GPU).
    ExportedVersion out;
    out.descriptor = DescriptorOf(v->info, *v->peer_copy, v->layout);
    out.reader_uids = v->reader_uids;
    out.token = v->token;
    out.data = static_cast<const char*>(v->peer_copy->data());
    out.hold = v->peer_copy;  // kept while the copy is sent, even once a newer one replaced it
    return out;
  }
  if (v->info.device >= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("weights ", Quoted(v->info.name), " version ", v->info.version, " of ",
                     OwnerText(v->info.owner_uid), " is in device memory of GPU ", v->info.device,
                     " of its daemon: device versions are not copied to other daemons"));
  }
  ExportedVersion out;
  out.descriptor = DescriptorOf(v->info, *v->buffer, v->layout);
  out.reader_uids = v->reader_uids;
  out.token = v->token;
  out.data = static_cast<const char*>(v->buffer->data());
  out.hold = v;  // the buffer is not freed while the copy is sent
  return out;
}

uint64_t Publisher::Newest(int64_t owner_uid, const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = table_.find(Key{owner_uid, name});
  return it == table_.end() || it->second.empty() ? 0 : it->second.rbegin()->first;
}

int Publisher::Adopt() {
  files_.RemoveUnfinished();
  int adopted = 0;
  for (const StoredWeights& m : files_.List()) {
    auto v = std::make_shared<Version>();
    absl::StatusOr<std::shared_ptr<Buffer>> buffer =
        options_.store->Allocate(BufferKind::kStaging, m.layout.bytes,
                                 absl::StrCat("weights name=", m.name, " adopted"), m.owner_uid);
    absl::Status s = buffer.status();
    if (s.ok()) {
      v->buffer = *std::move(buffer);
      s = WeightsFiles::ReadInto(m, v->buffer->data());
    }
    const int fd = s.ok() ? v->buffer->segment_fd() : -1;
    if (fd >= 0) s = SealReadOnly(fd);
    for (int64_t u : m.reader_uids) {
      if (u >= 0 && u != m.owner_uid) v->acl.push_back(u);
    }
    if (s.ok() && fd >= 0 && !v->acl.empty()) s = GrantRead(fd, v->acl);
    if (!s.ok()) {
      FS_LOG(WARNING) << "published weights " << m.path << " not adopted: " << s;
      continue;
    }
    v->info = WeightsInfo{m.name,
                          m.owner_uid,
                          m.version,
                          m.generation,
                          m.layout.bytes,
                          static_cast<int32_t>(m.layout.entries.size()),
                          0,
                          m.group,
                          m.module};
    v->layout = m.layout;
    v->reader_uids = m.reader_uids;
    v->token = m.token;
    absl::MutexLock lock(&mu_);
    const Key key{m.owner_uid, m.name};
    table_[key][m.version] = v;
    last_version_[key] = std::max(last_version_[key], m.version);
    UpdateGaugesLocked();
    stored_[key] = m.version;  // Adopt runs before any writer: files_mu_ is not needed
    ++adopted;
    FS_LOG(INFO) << "adopted published weights " << Quoted(m.name) << " version " << m.version
                 << " of " << OwnerText(m.owner_uid) << " (" << m.layout.bytes << " bytes)";
  }
  return adopted;
}

}  // namespace flatshard::server
