// Access control against real flatshardd processes (README "Access control"):
//   - a wrong token is PERMISSION_DENIED and changes nothing;
//   - a process of another uid (a test user, created here when running as root) can neither
//     join nor call into a group created by root, nor open its segments in /dev/shm (EACCES),
//     but can make and map its own group (its segments are handed to its uid, still 0600);
//   - mutual TLS on --tcp_address with certificates made here with `openssl`: a client with a
//     certificate of the daemon's CA works; no client certificate, or one of another CA, is
//     refused (UNAVAILABLE: gRPC reports the failed handshake as a transport failure) and
//     leaves nothing behind;
//   - startup refuses a non-loopback TCP address without TLS (naming --allow_insecure_tcp) and
//     an unknown --socket_group;
//   - two daemons with mutual TLS on their peer ports form a group; a daemon whose
//     certificate another CA signed cannot join it.

#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "flatshard/client.h"
#include "flatshard/v1/admin_service.grpc.pb.h"
#include "flatshard/v1/shard_service.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/files.h"
#include "tests/testing/run_as_user.h"
#include "tests/testing/shm_testing.h"

namespace flatshard::client {
namespace {

using ::flatshard::testing::DaemonOptions;
using ::flatshard::testing::DaemonProcess;
using ::flatshard::testing::ExampleModelFile;
using ::testing::HasSubstr;

constexpr char kToken[] = "s3cret";
constexpr char kTestUser[] = "fsaccess";

std::unique_ptr<Client> Connect(const std::string& address, ClientOptions options = {}) {
  options.address = address;
  options.call_timeout = absl::Seconds(10);
  options.join_timeout = absl::Seconds(10);
  options.max_attempts = 1;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// examples/models/gpt_tied.<kind>.json; a child running as another uid reads the copy its
// parent left in its own directory (FS_AC_MODEL_DIR): the checkout may live where that uid
// cannot enter.
std::string GptTied(const std::string& kind) {
  if (const char* dir = std::getenv("FS_AC_MODEL_DIR")) {
    return ::flatshard::testing::ReadFile(std::filesystem::path(dir) /
                                          ("gpt_tied." + kind + ".json"));
  }
  return ExampleModelFile("gpt_tied", kind);
}

absl::Status Register(Client& client) {
  return client.Register("", GptTied("manifest"), GptTied("policy"), InitMode::kZeros).status();
}

// A directory every uid can enter and read, holding a copy of this test binary and the model
// files its child needs, so that a child running as another uid works wherever the checkout
// lives (a `mktemp -d` directory is 0700). Removed with the object.
class WorldReadableCopy {
 public:
  WorldReadableCopy() {
    char tmpl[] = "/tmp/fsac-child.XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return;
    dir_ = tmpl;
    std::error_code ec;
    std::filesystem::permissions(dir_, std::filesystem::perms(0755), ec);
    char self[4096] = {};
    if (ec || ::readlink("/proc/self/exe", self, sizeof(self) - 1) <= 0) return;
    binary_ = dir_ / "access_control_test";
    std::filesystem::copy_file(self, binary_, ec);
    if (!ec) std::filesystem::permissions(binary_, std::filesystem::perms(0755), ec);
    for (const std::string kind : {"manifest", "policy"}) {
      const std::filesystem::path file = dir_ / ("gpt_tied." + kind + ".json");
      std::ofstream(file) << ExampleModelFile("gpt_tied", kind);
      if (!ec) std::filesystem::permissions(file, std::filesystem::perms(0644), ec);
    }
    ok_ = !ec;
  }
  ~WorldReadableCopy() {
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }
  bool ok() const { return ok_; }
  const std::filesystem::path& dir() const { return dir_; }
  const std::filesystem::path& binary() const { return binary_; }

 private:
  std::filesystem::path dir_;
  std::filesystem::path binary_;
  bool ok_ = false;
};

// ShardService.GetShardViews with a made-up caller, straight over gRPC.
grpc::Status RawGetShardViews(const std::shared_ptr<grpc::Channel>& channel,
                              const std::string& group, const std::string& token,
                              uint64_t session = 1) {
  auto stub = v1::ShardService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::GetShardViewsRequest request;
  request.mutable_caller()->set_group(group);
  request.mutable_caller()->set_rank(0);
  request.mutable_caller()->set_token(token);
  request.mutable_caller()->set_session(session);
  v1::GetShardViewsResponse response;
  return stub->GetShardViews(&ctx, request, &response);
}

// Waits until `group` exists on the daemon at `address` (a caller check stops answering
// NOT_FOUND).
void WaitForGroup(const std::string& address, const std::string& group) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  for (int i = 0; i < 500; ++i) {
    if (RawGetShardViews(channel, group, kToken, 0).error_code() != grpc::StatusCode::NOT_FOUND) {
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ADD_FAILURE() << "group " << group << " did not appear";
}

// --- Tokens ------------------------------------------------------------------------------

TEST(AccessControlTest, WrongTokenIsPermissionDeniedAndChangesNothing) {
  DaemonProcess d("fsac");
  // Rank 0 waits in Join for rank 1; an impostor with the wrong token tries rank 1.
  std::unique_ptr<Client> rank0 = Connect(d.address());
  ASSERT_NE(rank0, nullptr);
  absl::Status joined0;
  std::thread t([&] { joined0 = rank0->Join("g", 2, 0, kToken); });
  std::unique_ptr<Client> impostor = Connect(d.address());
  ASSERT_NE(impostor, nullptr);
  WaitForGroup(d.address(), "g");  // else the impostor would create it
  absl::Status denied = impostor->Join("g", 2, 1, "wrong");
  EXPECT_TRUE(absl::IsPermissionDenied(denied)) << denied;
  EXPECT_THAT(std::string(denied.message()), HasSubstr("wrong token"));
  // Rank 1 is still free: the real rank 1 joins and both complete.
  std::unique_ptr<Client> rank1 = Connect(d.address());
  ASSERT_NE(rank1, nullptr);
  absl::Status joined1 = rank1->Join("g", 2, 1, kToken);
  t.join();
  EXPECT_TRUE(joined0.ok()) << joined0;
  EXPECT_TRUE(joined1.ok()) << joined1;
  // A call with the wrong token is refused the same way; no segment was made for it.
  const size_t segments = d.Segments().size();
  grpc::Status raw = RawGetShardViews(
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()), "g", "wrong");
  EXPECT_EQ(raw.error_code(), grpc::StatusCode::PERMISSION_DENIED) << raw.error_message();
  EXPECT_EQ(d.Segments().size(), segments);
}

// --- Other uids --------------------------------------------------------------------------

// The part run as the test user, in a fresh process (exec of this binary): see
// OtherUidCannotJoinNorMapRootsGroup. Never runs on its own (DISABLED_).
TEST(OtherUidChild, DISABLED_Run) {
  const char* address = std::getenv("FS_AC_ADDRESS");
  const char* segments = std::getenv("FS_AC_SEGMENTS");
  ASSERT_NE(address, nullptr);
  ASSERT_NE(segments, nullptr);
  const uid_t uid = ::getuid();
  ASSERT_NE(uid, 0u) << "the child must run as the test user";
  // Root's segments: 0600, owned by the daemon's uid; not even readable.
  for (absl::string_view path : absl::StrSplit(segments, ',', absl::SkipEmpty())) {
    const int fd = ::open(std::string(path).c_str(), O_RDONLY);
    EXPECT_EQ(fd, -1) << path << " opened by uid " << uid;
    EXPECT_EQ(errno, EACCES) << path;
    if (fd >= 0) ::close(fd);
  }
  std::unique_ptr<Client> client = Connect(address);
  ASSERT_NE(client, nullptr);
  // The right token does not help: the group belongs to root.
  absl::Status joined = client->Join("roots", 2, 1, kToken);
  EXPECT_TRUE(absl::IsPermissionDenied(joined)) << joined;
  EXPECT_THAT(std::string(joined.message()), HasSubstr(absl::StrCat("uid ", uid)));
  grpc::Status raw = RawGetShardViews(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()), "roots", kToken);
  EXPECT_EQ(raw.error_code(), grpc::StatusCode::PERMISSION_DENIED) << raw.error_message();
  EXPECT_THAT(raw.error_message(), HasSubstr(absl::StrCat("uid ", uid)));
  // Its own group works, segments included (they are handed to this uid).
  absl::Status own = client->Join("users", 1, 0, "other-token");
  ASSERT_TRUE(own.ok()) << own;
  ASSERT_TRUE(Register(*client).ok());
  SummonOptions writeback;
  absl::StatusOr<std::unique_ptr<SummonedParams>> full = client->Summon("", "", writeback);
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_FALSE((*full)->params().empty());
  const ParamView& first = (*full)->params()[0];
  static_cast<float*>(first.data)[0] = 42.0f;
  ASSERT_TRUE((*full)->End().ok());
  absl::StatusOr<ShardViews> shards = client->GetShardViews("");
  ASSERT_TRUE(shards.ok()) << shards.status();
  // An operator's changes are root's and the daemon's uid's alone; reading is open.
  auto admin =
      v1::AdminService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    v1::SetLogLevelRequest req;
    req.set_level("error");
    v1::SetLogLevelResponse resp;
    const grpc::Status s = admin->SetLogLevel(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(absl::StrCat("uid ", uid)));
  }
  {
    grpc::ClientContext ctx;
    v1::DrainRequest req;
    req.set_timeout_ms(100);
    std::unique_ptr<grpc::ClientReader<v1::DrainProgress>> reader = admin->Drain(&ctx, req);
    v1::DrainProgress progress;
    while (reader->Read(&progress)) {
    }
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    v1::GetStatusResponse resp;
    const grpc::Status s = admin->GetStatus(&ctx, v1::GetStatusRequest(), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_FALSE(resp.draining());
  }
}

// Creates kTestUser (with its own group) unless it exists; its uid and gid.
bool EnsureTestUser(uid_t* uid, gid_t* gid) {
  if (getpwnam(kTestUser) == nullptr) {
    const std::string cmd = absl::StrCat(
        "useradd --system --user-group --no-create-home "
        "--shell /usr/sbin/nologin ",
        kTestUser, " >/dev/null 2>&1");
    if (std::system(cmd.c_str()) != 0 && getpwnam(kTestUser) == nullptr) return false;
  }
  const passwd* pw = getpwnam(kTestUser);
  if (pw == nullptr) return false;
  *uid = pw->pw_uid;
  *gid = pw->pw_gid;
  return true;
}

TEST(AccessControlTest, OtherUidCannotJoinNorMapRootsGroup) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "needs root: creates the user " << kTestUser
                 << " and runs a client as that user";
  }
  uid_t uid = 0;
  gid_t gid = 0;
  ASSERT_TRUE(EnsureTestUser(&uid, &gid)) << "useradd " << kTestUser << " failed";
  DaemonOptions options;
  options.tag_prefix = "fsacu";
  options.extra_flags = {absl::StrCat("--socket_group=", kTestUser)};
  DaemonProcess d(options);
  // The socket: 0660, group kTestUser.
  struct stat st;
  ASSERT_EQ(::stat(d.socket().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  EXPECT_EQ(st.st_gid, gid);

  // Root's group: rank 0 waits for rank 1, which the other uid will try to take.
  std::unique_ptr<Client> rank0 = Connect(d.address());
  std::unique_ptr<Client> rank1 = Connect(d.address());
  ASSERT_NE(rank0, nullptr);
  ASSERT_NE(rank1, nullptr);
  absl::Status joined0;
  std::thread t([&] { joined0 = rank0->Join("roots", 2, 0, kToken); });
  WaitForGroup(d.address(), "roots");
  // A segment root owns already exists for the child to fail on: a second root group.
  std::unique_ptr<Client> other_root = Connect(d.address());
  ASSERT_NE(other_root, nullptr);
  ASSERT_TRUE(other_root->Join("roots2", 1, 0, kToken).ok());
  ASSERT_TRUE(Register(*other_root).ok());
  const std::vector<std::string> root_segments = d.Segments();
  ASSERT_FALSE(root_segments.empty());

  // The child: this binary again, as the test user, running OtherUidChild.DISABLED_Run; a
  // copy of it in a directory that user can enter, wherever the checkout lives.
  WorldReadableCopy copy;
  ASSERT_TRUE(copy.ok()) << "cannot copy the test binary to " << copy.dir();
  std::vector<std::string> args = {copy.binary().string(),
                                   "--gtest_filter=OtherUidChild.DISABLED_Run",
                                   "--gtest_also_run_disabled_tests"};
  std::vector<std::string> env = {
      absl::StrCat("FS_AC_ADDRESS=", d.address()),
      absl::StrCat("FS_AC_SEGMENTS=", absl::StrJoin(root_segments, ",")),
      absl::StrCat("FS_AC_MODEL_DIR=", copy.dir().string()), "PATH=/usr/bin:/bin", "HOME=/"};
  const int status = ::flatshard::testing::RunAsUser(std::move(args), std::move(env), uid, gid);
  ASSERT_NE(status, -1) << "fork or waitpid failed";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the client running as uid " << uid << " failed (status " << status << "; its output "
      << "is above)";

  // Nothing of root's changed: rank 1 is free, both ranks complete, root's segments stay
  // root's; the child's own segments belong to its uid, mode 0600.
  absl::Status joined1 = rank1->Join("roots", 2, 1, kToken);
  t.join();
  EXPECT_TRUE(joined0.ok()) << joined0;
  EXPECT_TRUE(joined1.ok()) << joined1;
  EXPECT_TRUE(other_root->GetShardViews("").ok());
  const std::set<std::string> before(root_segments.begin(), root_segments.end());
  int child_segments = 0;
  for (const std::string& path : d.Segments()) {
    ASSERT_EQ(::stat(path.c_str(), &st), 0) << path;
    EXPECT_EQ(st.st_mode & 0777, 0600u) << path;
    if (before.count(path) != 0) {
      EXPECT_EQ(st.st_uid, 0u) << path;
    } else {
      EXPECT_EQ(st.st_uid, uid) << path;
      ++child_segments;
    }
  }
  EXPECT_GT(child_segments, 0) << "the child's group made no segments";
}

// --- TLS ---------------------------------------------------------------------------------

// Certificates made with openssl for the whole suite: ca (server.pem for 127.0.0.1 and
// localhost, client.pem) and another CA (other_client.pem).
class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(
        (std::filesystem::temp_directory_path() / absl::StrCat("fsac_tls", getpid())).string());
    std::filesystem::create_directories(*dir_);
    const std::string script = absl::StrCat(
        "set -e; cd ", *dir_, "; ",
        "K='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes'; "
        "openssl req -x509 $K -keyout ca.key -out ca.pem -days 2 -subj /CN=fs-test-ca; "
        "openssl req -x509 $K -keyout ca2.key -out ca2.pem -days 2 -subj /CN=fs-other-ca; "
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > server.ext; "
        "printf 'subjectAltName=DNS:trainer\\n' > client.ext; "
        "openssl req -new $K -keyout server.key -out server.csr -subj /CN=flatshardd; "
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "  -out server.pem -days 2 -extfile server.ext; "
        "openssl req -new $K -keyout client.key -out client.csr -subj /CN=trainer; "
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "  -out client.pem -days 2 -extfile client.ext; "
        "openssl req -new $K -keyout other_client.key -out other_client.csr -subj /CN=trainer; "
        "openssl x509 -req -in other_client.csr -CA ca2.pem -CAkey ca2.key -CAcreateserial "
        "  -out other_client.pem -days 2 -extfile client.ext; "
        "openssl req -new $K -keyout other_server.key -out other_server.csr -subj /CN=other; "
        "openssl x509 -req -in other_server.csr -CA ca2.pem -CAkey ca2.key -CAcreateserial "
        "  -out other_server.pem -days 2 -extfile server.ext",
        " >", *dir_, "/openssl.log 2>&1");
    ok_ = std::system(script.c_str()) == 0;
  }
  static void TearDownTestSuite() {
    std::error_code ignored;
    std::filesystem::remove_all(*dir_, ignored);
    delete dir_;
  }
  void SetUp() override {
    ASSERT_TRUE(ok_) << "openssl failed:\n"
                     << ::flatshard::testing::ReadFile(*dir_ + "/openssl.log");
  }

  static std::string File(const std::string& name) { return *dir_ + "/" + name; }
  // Daemon flags for mutual TLS with `name`.pem / `name`.key and CA `ca`.pem.
  static std::vector<std::string> TlsFlags(const std::string& name = "server",
                                           const std::string& ca = "ca") {
    return {"--tls_cert=" + File(name + ".pem"), "--tls_key=" + File(name + ".key"),
            "--tls_ca=" + File(ca + ".pem")};
  }
  static std::string Pem(const std::string& name) {
    return ::flatshard::testing::ReadFile(File(name));
  }

  static std::string* dir_;
  static bool ok_;
};
std::string* TlsTest::dir_ = nullptr;
bool TlsTest::ok_ = false;

// A free loopback TCP port (closed again: the daemon binds it right after).
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

grpc::Status Ping(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = v1::ShardService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::PingRequest request;
  v1::PingResponse response;
  return stub->Ping(&ctx, request, &response);
}

TEST_F(TlsTest, ClientCertificateOfTheCaWorksOthersAreRefused) {
  const std::string tcp = absl::StrCat("127.0.0.1:", FreePort());
  DaemonOptions options;
  options.tag_prefix = "fsact";
  options.extra_flags = TlsFlags();
  options.extra_flags.push_back("--tcp_address=" + tcp);
  DaemonProcess d(options);

  // No client certificate: the server requires one.
  {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = Pem("ca.pem");
    grpc::Status s = Ping(grpc::CreateChannel(tcp, grpc::SslCredentials(ssl)));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
  // A client certificate of another CA.
  {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = Pem("ca.pem");
    ssl.pem_cert_chain = Pem("other_client.pem");
    ssl.pem_private_key = Pem("other_client.key");
    grpc::Status s = Ping(grpc::CreateChannel(tcp, grpc::SslCredentials(ssl)));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
  // Plaintext to the TLS port.
  {
    grpc::Status s = Ping(grpc::CreateChannel(tcp, grpc::InsecureChannelCredentials()));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
  // The client library with the wrong certificate: Connect cannot reach the daemon.
  {
    ClientOptions o;
    o.address = tcp;
    o.call_timeout = absl::Seconds(2);
    o.max_attempts = 1;
    o.tls_ca_file = File("ca.pem");
    o.tls_cert_file = File("other_client.pem");
    o.tls_key_file = File("other_client.key");
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
    EXPECT_TRUE(absl::IsUnavailable(c.status())) << c.status();
  }
  // Nothing was made for the refused clients.
  EXPECT_TRUE(d.Segments().empty());

  // The right certificate: join, register, summon over TCP.
  ClientOptions good;
  good.tls_ca_file = File("ca.pem");
  good.tls_cert_file = File("client.pem");
  good.tls_key_file = File("client.key");
  std::unique_ptr<Client> client = Connect(tcp, good);
  ASSERT_NE(client, nullptr);
  absl::Status joined = client->Join("remote", 1, 0, kToken);
  ASSERT_TRUE(joined.ok()) << joined;
  ASSERT_TRUE(Register(*client).ok());
  SummonOptions read_only;
  read_only.writeback = false;
  absl::StatusOr<std::unique_ptr<SummonedParams>> full = client->Summon("", "", read_only);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_TRUE((*full)->End().ok());
  // flatshardctl over the TLS port: with the client certificate it answers; without, one line
  // and exit 1.
  const std::string ctl = absl::StrCat(FS_BINARY_DIR, "/client/flatshardctl status --address ", tcp,
                                       " --timeout-ms 3000");
  const std::string tls_flags = absl::StrCat(" --tls-ca ", File("ca.pem"), " --tls-cert ",
                                             File("client.pem"), " --tls-key ", File("client.key"));
  int status = std::system((ctl + tls_flags + " >/dev/null 2>&1").c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << ctl << tls_flags;
  status = std::system((ctl + " >/dev/null 2>&1").c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << ctl;
  // A Unix-socket caller (a uid) is not a remote caller: the TCP group is not its.
  std::unique_ptr<Client> local = Connect(d.address());
  ASSERT_NE(local, nullptr);
  absl::Status denied = local->Join("remote", 1, 0, kToken);
  EXPECT_TRUE(absl::IsPermissionDenied(denied)) << denied;
}

// Runs flatshardd with `flags` (plus a private socket and prefix) and expects it to exit at
// startup; its exit status and stderr.
std::pair<int, std::string> RunDaemonExpectingExit(const std::vector<std::string>& flags) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / absl::StrCat("fsacx", getpid())).string();
  std::filesystem::create_directories(dir);
  std::string cmd = absl::StrCat("timeout 10 ", FS_BINARY_DIR, "/server/flatshardd --socket=", dir,
                                 "/s.sock --ephemeral --segment_prefix=fsacx", getpid());
  for (const std::string& f : flags) absl::StrAppend(&cmd, " '", f, "'");
  absl::StrAppend(&cmd, " 2>", dir, "/err.log");
  const int status = std::system(cmd.c_str());
  std::string err = ::flatshard::testing::ReadFile(dir + "/err.log");
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, err};
}

TEST(AccessControlStartupTest, NonLoopbackWithoutTlsIsRefused) {
  auto [code, err] = RunDaemonExpectingExit({"--tcp_address=0.0.0.0:0"});
  EXPECT_EQ(code, 1) << err;
  EXPECT_THAT(err, HasSubstr("--allow_insecure_tcp"));
  EXPECT_THAT(err, HasSubstr("--tcp_address 0.0.0.0:0"));
  auto [peer_code, peer_err] = RunDaemonExpectingExit({"--peer_address=0.0.0.0:0"});
  EXPECT_EQ(peer_code, 1) << peer_err;
  EXPECT_THAT(peer_err, HasSubstr("--allow_insecure_tcp"));
  auto [group_code, group_err] = RunDaemonExpectingExit({"--socket_group=no-such-group-fs"});
  EXPECT_EQ(group_code, 1) << group_err;
  EXPECT_THAT(group_err, HasSubstr("--socket_group"));
  EXPECT_THAT(group_err, HasSubstr("no-such-group-fs"));
  auto [tls_code, tls_err] =
      RunDaemonExpectingExit({"--tcp_address=127.0.0.1:0", "--tls_cert=/nonexistent.pem"});
  EXPECT_EQ(tls_code, 1) << tls_err;
  EXPECT_THAT(tls_err, HasSubstr("--tls_cert: cannot read /nonexistent.pem"));
  auto [half_code, half_err] = RunDaemonExpectingExit(
      {"--tcp_address=127.0.0.1:0", absl::StrCat("--tls_cert=", FS_SOURCE_DIR, "/README.md")});
  EXPECT_EQ(half_code, 1) << half_err;
  EXPECT_THAT(half_err, HasSubstr("is not a PEM file"));
}

TEST(AccessControlStartupTest, NonLoopbackWithAllowInsecureStarts) {
  DaemonOptions options;
  options.tag_prefix = "fsaci";
  options.extra_flags = {"--tcp_address=0.0.0.0:0", "--allow_insecure_tcp"};
  DaemonProcess d(options);
  EXPECT_TRUE(d.running());
  std::unique_ptr<Client> client = Connect(d.address());
  EXPECT_NE(client, nullptr);
}

TEST_F(TlsTest, PeersOverMutualTlsFormAGroup) {
  std::vector<std::unique_ptr<DaemonProcess>> daemons;
  for (int i = 0; i < 2; ++i) {
    DaemonOptions o;
    o.tag_prefix = "fsacp";
    o.peer = true;
    o.node_name = absl::StrCat("node", i);
    o.extra_flags = TlsFlags();
    daemons.push_back(std::make_unique<DaemonProcess>(o));
  }
  const std::string coordinator = daemons[0]->peer_address();
  std::vector<std::unique_ptr<Client>> clients(2);
  std::vector<absl::Status> results(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    clients[r] = Connect(daemons[r]->address());
    ASSERT_NE(clients[r], nullptr);
  }
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      results[r] = clients[r]->Join("peers", 2, r, kToken, coordinator);
      if (results[r].ok()) results[r] = Register(*clients[r]);
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_TRUE(results[0].ok()) << results[0];
  EXPECT_TRUE(results[1].ok()) << results[1];

  // A daemon whose certificate another CA signed is refused by the coordinator's port.
  DaemonOptions o;
  o.tag_prefix = "fsacp";
  o.peer = true;
  o.node_name = "intruder";
  o.extra_flags = TlsFlags("other_server", "ca2");
  o.extra_flags.push_back("--peer_timeout=1s");
  DaemonProcess intruder(o);
  ClientOptions short_join;
  short_join.address = intruder.address();
  short_join.join_timeout = absl::Seconds(3);
  short_join.max_attempts = 1;
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(short_join);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::Status joined = (*c)->Join("other", 2, 0, kToken, coordinator);
  EXPECT_FALSE(joined.ok());
  EXPECT_TRUE(absl::IsUnavailable(joined) || absl::IsDeadlineExceeded(joined)) << joined;
}

}  // namespace
}  // namespace flatshard::client
