// ClientOptions::address against a real flatshardd: a bare socket path (absolute, ./relative
// or with a directory) connects as "unix:<path>"; an address that is neither a path nor
// host:port is refused at once with INVALID_ARGUMENT saying how to write one, instead of
// waiting call_timeout for a connection that gRPC can never make.

#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon_process.h"

namespace flatshard::client {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

ClientOptions Options(const std::string& address) {
  ClientOptions o;
  o.address = address;
  o.call_timeout = absl::Seconds(5);
  o.join_timeout = absl::Seconds(5);
  o.max_attempts = 1;
  return o;
}

// Connects to `address` and joins a group of one: the daemon answered.
void ExpectServes(const std::string& address, const std::string& group) {
  SCOPED_TRACE(address);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(Options(address));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->Join(group, 1, 0, "t").ok());
  EXPECT_TRUE((*c)->Leave().ok());
}

// Restores the working directory on scope exit.
class ScopedChdir {
 public:
  explicit ScopedChdir(const fs::path& dir) : saved_(fs::current_path()) { fs::current_path(dir); }
  ~ScopedChdir() { fs::current_path(saved_); }

 private:
  fs::path saved_;
};

TEST(ClientAddressTest, ASocketPathConnectsAsUnix) {
  testing::DaemonProcess daemon("fsaddr");
  ExpectServes(daemon.address(), "g0");  // "unix:/..."
  ExpectServes(daemon.socket(), "g1");   // "/tmp/.../flatshardd.sock"
  const fs::path socket(daemon.socket());
  {
    ScopedChdir in_dir(socket.parent_path());
    ExpectServes("./" + socket.filename().string(), "g2");
  }
  {
    ScopedChdir in_parent(socket.parent_path().parent_path());
    ExpectServes((socket.parent_path().filename() / socket.filename()).string(), "g3");
  }
}

TEST(ClientAddressTest, AMalformedAddressIsRefusedAtOnce) {
  for (const char* address : {"flatshardd.sock", "localhost", "host:", "host:http", "host:0",
                              "host:70000", ":7450", "a b:1"}) {
    SCOPED_TRACE(address);
    ClientOptions o = Options(address);
    o.call_timeout = absl::Seconds(30);
    const absl::Time start = absl::Now();
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
    EXPECT_LT(absl::Now() - start, absl::Seconds(1));
    ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
    EXPECT_THAT(c.status().message(),
                AllOf(HasSubstr(absl::StrCat("\"", address, "\"")),
                      HasSubstr("\"unix:/path/to.sock\""), HasSubstr("\"host:port\"")));
  }
}

TEST(ClientAddressTest, HostPortAndGrpcTargetsAreDialedAsGiven) {
  // Nothing listens: each is dialed (UNAVAILABLE after the timeout), not refused.
  for (const char* address : {"127.0.0.1:1", "localhost:1", "[::1]:1", "dns:///127.0.0.1:1",
                              "unix:relative-nobody.sock"}) {
    SCOPED_TRACE(address);
    ClientOptions o = Options(address);
    o.call_timeout = absl::Milliseconds(200);
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
    EXPECT_THAT(c.status().message(), HasSubstr(absl::StrCat("at ", address, " within")));
  }
}

}  // namespace
}  // namespace flatshard::client
