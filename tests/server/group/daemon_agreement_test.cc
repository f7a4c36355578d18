// Tests for server/group/daemon_agreement: a peer table whose daemons differ in their collective
// settings is refused with one message naming both daemons, their ranks and their settings.

#include "server/group/daemon_agreement.h"

#include <string>

#include "gtest/gtest.h"

namespace flatshard::server {
namespace {

peer::DaemonIdentity Daemon(const std::string& node, const std::string& settings) {
  peer::DaemonIdentity d;
  d.node = node;
  d.daemon_id = node + "/1/2";
  d.peer_address = node + ":7000";
  d.collective_settings = settings;
  return d;
}

// Ranks 0 and 2 on node0, 1 and 3 on node1.
peer::PeerTable Table(const std::string& settings0, const std::string& settings1) {
  peer::PeerTable t;
  t.group = std::string("g");  // (assigning a char* here trips GCC 12's -Wrestrict)
  t.epoch = 3;
  for (int r = 0; r < 4; ++r) {
    t.rank_daemons.push_back(r % 2 == 0 ? Daemon("node0", settings0) : Daemon("node1", settings1));
  }
  return t;
}

TEST(DaemonAgreementTest, EqualSettingsAgree) {
  EXPECT_TRUE(CheckDaemonsAgree(Table("hierarchical=on", "hierarchical=on")).ok());
  EXPECT_TRUE(CheckDaemonsAgree(Table("hierarchical=off", "hierarchical=off")).ok());
  EXPECT_TRUE(CheckDaemonsAgree(peer::PeerTable{}).ok());
}

TEST(DaemonAgreementTest, DifferentSettingsNameBothDaemons) {
  absl::Status s = CheckDaemonsAgree(Table("hierarchical=on", "hierarchical=off"));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "group g: its daemons disagree on how the remote backend runs all-gather and "
            "reduce-scatter: daemon node0 (node0/1/2, ranks 0, 2) has hierarchical=on, daemon "
            "node1 (node1/1/2, ranks 1, 3) has hierarchical=off; start every daemon of the group "
            "with the same --ucx_hierarchical");
}

TEST(DaemonAgreementTest, ADaemonWithoutSettingsIsNamedAsOlder) {
  peer::PeerTable t = Table("hierarchical=on", "");
  t.rank_daemons.resize(2);
  absl::Status s = CheckDaemonsAgree(t);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("daemon node1 (node1/1/2, rank 1) has no settings (an older "
                             "flatshardd)"),
            absl::string_view::npos)
      << s;
}

TEST(DaemonAgreementTest, NcclGroupsAreNotChecked) {
  // Device memory moves over NCCL: no remote backend runs the group's ops.
  peer::PeerTable t = Table("hierarchical=on", "hierarchical=off");
  t.device_transport = "nccl";
  EXPECT_TRUE(CheckDaemonsAgree(t).ok());
  t.device_transport = "host";
  EXPECT_FALSE(CheckDaemonsAgree(t).ok());
}

}  // namespace
}  // namespace flatshard::server
