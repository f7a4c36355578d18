#pragma once
// Publisher's parts shared by its source files (publisher.cc: publishing, leases, watches;
// publisher_copies.cc: the state directory and copies between daemons). Not an API.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/publish/publisher.h"
#include "server/publish/segment_grant.h"
#include "server/shard_store.h"

namespace flatshard::server {

struct Publisher::Version {
  WeightsInfo info;
  std::shared_ptr<Buffer> buffer;
  // A device version of a multi-daemon group on its leader: the host bytes it was uploaded
  // from, for the group's other daemons to copy (null once a newer version is inserted).
  std::shared_ptr<Buffer> peer_copy;
  WeightsLayout layout;
  std::vector<int64_t> reader_uids;
  std::string token;
  std::vector<int64_t> acl;     // uids in the segment's ACL so far
  int32_t readers = 0;          // open leases
  bool in_table = true;         // false once trimmed or dropped (freed with its last lease)
  bool dropped = false;         // by Drop: its segment is not reused
  bool world_readable = false;  // GrantReadToAll'd for a reader of unknown uid

  SegmentGrants Grants() const { return GrantsOf(reader_uids, token, world_readable); }
  static SegmentGrants GrantsOf(std::vector<int64_t> uids, std::string token, bool world) {
    std::sort(uids.begin(), uids.end());
    uids.erase(std::unique(uids.begin(), uids.end()), uids.end());
    return SegmentGrants{std::move(uids), std::move(token), world};
  }
};

namespace publisher_internal {

inline std::string Quoted(const std::string& name) { return absl::StrCat("\"", name, "\""); }

inline WeightsDescriptor DescriptorOf(const WeightsInfo& info, const Buffer& b,
                                      const WeightsLayout& layout) {
  WeightsDescriptor d;
  d.info = info;
  d.segment = b.segment_name();
  d.segment_bytes = b.segment_bytes();
  d.tensors = layout.entries;
  if (b.on_device()) {
    d.ipc_handle = b.ipc_handle();
    d.device_uuid = b.device_uuid();
    d.offset = b.offset();
  }
  return d;
}

inline std::string OwnerText(int64_t uid) {
  return uid < 0 ? "remote (TCP) callers" : absl::StrCat("uid ", uid);
}

}  // namespace publisher_internal

}  // namespace flatshard::server
