// A trainer that closes its Client (or Leaves) hands its rank back before the call returns:
// ~Client waits for the daemon to end the session (client.h), so a new Client joins the same
// rank at once, never ALREADY_EXISTS for the rank's old session. A real daemon, real gRPC.

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon_process.h"

namespace flatshard {
namespace {

class SessionHandoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::DaemonOptions o;
    o.tag_prefix = "fshandover";
    daemon_ = std::make_unique<testing::DaemonProcess>(o);
    ASSERT_TRUE(daemon_->running());
  }

  std::unique_ptr<client::Client> Connect() {
    client::ClientOptions options;
    options.address = daemon_->address();
    options.call_timeout = absl::Seconds(30);
    absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  std::unique_ptr<testing::DaemonProcess> daemon_;
};

TEST_F(SessionHandoverTest, AClosedClientsRankIsJoinedAgainAtOnce) {
  for (int i = 0; i < 30; ++i) {
    std::unique_ptr<client::Client> c = Connect();
    ASSERT_NE(c, nullptr);
    ASSERT_TRUE(c->Join("handover", 1, 0, "").ok()) << "round " << i;
    c.reset();  // closes the lease: the next Join must not find the old session
  }
  std::unique_ptr<client::Client> last = Connect();
  ASSERT_NE(last, nullptr);
  EXPECT_TRUE(last->Join("handover", 1, 0, "").ok());
}

TEST_F(SessionHandoverTest, ALeftRankIsJoinedAgainAtOnceByAnotherClient) {
  std::unique_ptr<client::Client> keep = Connect();  // the Client outlives its session
  ASSERT_NE(keep, nullptr);
  for (int i = 0; i < 30; ++i) {
    ASSERT_TRUE(keep->Join("handover-leave", 1, 0, "").ok()) << "round " << i;
    ASSERT_TRUE(keep->Leave().ok()) << "round " << i;
    std::unique_ptr<client::Client> other = Connect();
    ASSERT_NE(other, nullptr);
    absl::Status joined = other->Join("handover-leave", 1, 0, "");
    ASSERT_TRUE(joined.ok()) << "round " << i << ": " << joined;
    other.reset();
  }
}

}  // namespace
}  // namespace flatshard
