#pragma once
// Pieces of the daemon chaos tests (tests/chaos/daemon_chaos_test.cc) that are not the trial
// logic: a model whose size the test chooses, the value every element must hold after each
// committed generation, the checks of a rank's shards and of a summon against it, and a
// ChaosCluster of real flatshardd processes that each keep a --state_dir and come back on the
// same Unix socket and the same peer port after a SIGKILL.
//
// The value after generation g is a pure function of g (and of the unit and flat element):
// every trainer knows, without any record, what every shard must hold at every committed
// generation; two generations differ in every element (a mix of two steps is seen) and no
// value is zero (zeros handed out as the model are seen).
//
// Thread-compatible; create, Kill and Restart daemons from the test's main thread.

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "flatshard/client.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon_process.h"

namespace flatshard::chaos {

// The environment variable `name` ("" when unset), and as an int (`fallback` when unset or not
// a number): the trials' knobs (FS_CHAOS_*).
inline std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}
inline int EnvInt(const char* name, int fallback) {
  int v = 0;
  return absl::SimpleAtoi(Env(name), &v) ? v : fallback;
}

// A model of `blocks` units ("b<i>", each a Block holding a Linear [rows, cols] with bias)
// plus the root unit (a [cols] "scale"); policy: wrap every Block. float32 throughout.
inline std::string ChaosManifest(int blocks, int rows, int cols) {
  std::string children;
  int module_id = 1;
  int param_id = 1;
  for (int b = 0; b < blocks; ++b) {
    if (b > 0) children += ",";
    const int block_id = module_id++;
    const int linear_id = module_id++;
    absl::StrAppend(&children, "{\"name\":\"b", b, "\",\"module\":{\"id\":", block_id,
                    ",\"type\":\"Block\",\"bases\":[\"Module\"],\"params\":[],\"children\":[",
                    "{\"name\":\"fc\",\"module\":{\"id\":", linear_id,
                    ",\"type\":\"Linear\",\"bases\":[\"Module\"],\"params\":[",
                    "{\"name\":\"weight\",\"id\":", param_id, ",\"shape\":[", rows, ",", cols,
                    "],\"dtype\":\"float32\",\"requires_grad\":true},",
                    "{\"name\":\"bias\",\"id\":", param_id + 1, ",\"shape\":[", rows,
                    "],\"dtype\":\"float32\",\"requires_grad\":true}],\"children\":[]}}]}}");
    param_id += 2;
  }
  return absl::StrCat("{\"format\":\"flatshard.manifest/1\",\"root\":{\"id\":0,\"type\":\"Net\",",
                      "\"bases\":[\"Module\"],\"params\":[{\"name\":\"scale\",\"id\":0,\"shape\":[",
                      cols, "],\"dtype\":\"float32\",\"requires_grad\":true}],\"children\":[",
                      children, "]}}");
}
inline std::string ChaosPolicy() {
  return R"({"format": "flatshard.policy/1", "auto_wrap": {"kind": "module_types", "types": ["Block"]}})";
}

// The value of flat element `i` of unit `u` after generation `g` (exact in float32 for
// g < 16000).
inline float Value(uint64_t g, int32_t u, int64_t i) {
  return static_cast<float>(g * 1000 + 1 + (u * 131 + i) % 997);
}

// Per unit: which flat elements are parameters (not padding, whose value is unspecified).
inline std::vector<std::vector<bool>> ParamMask(const Plan& plan) {
  std::vector<std::vector<bool>> mask;
  for (const PlanUnit& u : plan.units) {
    std::vector<bool> m(u.padded_numel, false);
    for (const PlanParam& p : u.params) {
      for (int64_t i = 0; i < p.numel; ++i) m[p.offset + i] = true;
    }
    mask.push_back(std::move(m));
  }
  return mask;
}

// Writes generation `g` into the full buffers of a summon (rank 0 of a rank0_only summon, or
// the init summon).
inline void FillFull(const Plan& plan, const client::SummonedParams& s, uint64_t g) {
  for (const PlanUnit& u : plan.units) {
    for (const PlanParam& p : u.params) {
      const client::ParamView* v = s.Find(p.fqn);
      if (v == nullptr) continue;
      float* data = static_cast<float*>(v->data);
      for (int64_t i = 0; i < p.numel; ++i) data[i] = Value(g, u.index, p.offset + i);
    }
  }
}

// "" when every parameter of a summon's full buffers holds generation `g`; else the first
// differing element, its value and the generation that value belongs to (if any).
inline std::string CheckFull(const Plan& plan, const client::SummonedParams& s, uint64_t g) {
  for (const PlanUnit& u : plan.units) {
    for (const PlanParam& p : u.params) {
      const client::ParamView* v = s.Find(p.fqn);
      if (v == nullptr) return absl::StrCat("no view of ", p.fqn);
      const float* data = static_cast<const float*>(v->data);
      for (int64_t i = 0; i < p.numel; ++i) {
        const float want = Value(g, u.index, p.offset + i);
        if (data[i] != want) {
          return absl::StrCat("summoned unit ", u.index, " ", p.fqn, "[", i, "] = ", data[i],
                              ", want generation ", g, "'s ", want);
        }
      }
    }
  }
  return "";
}

// "" when every parameter element of this rank's shards holds generation `g`.
inline std::string CheckShards(const Plan& plan, const client::ShardViews& views, uint64_t g) {
  const std::vector<std::vector<bool>> mask = ParamMask(plan);
  for (const client::UnitShardView& s : views) {
    const float* data = static_cast<const float*>(s.data);
    for (int64_t i = 0; i < s.shard_numel; ++i) {
      const int64_t flat = s.shard_offset + i;
      if (flat >= static_cast<int64_t>(mask[s.unit].size()) || !mask[s.unit][flat]) continue;
      const float want = Value(g, s.unit, flat);
      if (data[i] != want) {
        return absl::StrCat("shard of unit ", s.unit, " element ", flat, " = ", data[i],
                            ", want generation ", g, "'s ", want);
      }
    }
  }
  return "";
}

// Writes generation `g` into this rank's shards in place; `half` 0: the first half of each
// shard, 1: the rest (an optimizer step that a kill can cut in two).
inline void WriteShards(const client::ShardViews& views, uint64_t g, int half) {
  for (const client::UnitShardView& s : views) {
    float* data = static_cast<float*>(s.data);
    const int64_t mid = s.shard_numel / 2;
    for (int64_t i = half == 0 ? 0 : mid; i < (half == 0 ? mid : s.shard_numel); ++i) {
      data[i] = Value(g, s.unit, s.shard_offset + i);
    }
  }
}

// Whether a daemon listens on the Unix socket of `address` ("unix:/path") now.
inline bool SocketAccepts(const std::string& address) {
  std::string path = address;
  if (absl::StartsWith(path, "unix:")) path = path.substr(5);
  sockaddr_un a{};
  if (path.size() >= sizeof(a.sun_path)) return false;
  a.sun_family = AF_UNIX;
  path.copy(a.sun_path, path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

// A free loopback TCP port (bound and released; a daemon takes it right after), below the
// kernel's ephemeral range when there is room: a killed daemon comes back on the same port,
// and one the kernel may hand to any outgoing connection meanwhile was taken by another
// process in the ~100 ms before a restart ("cannot listen on --peer_address", soak seed 24002).
inline int FreePort() {
  auto bound = [](int port) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    int got = -1;
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
      socklen_t len = sizeof(a);
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
      got = ntohs(a.sin_port);
    }
    close(fd);
    return got;
  };
  int low = 32768;  // the ephemeral range's first port (/proc/sys/net/ipv4/ip_local_port_range)
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d", &low) != 1) low = 32768;
    std::fclose(f);
  }
  if (low > 12000) {
    // A pseudo-random start (pid and time), so that concurrent test processes differ.
    const int span = std::min(low, 65536) - 10000;
    const int start = static_cast<int>(
        (static_cast<uint64_t>(getpid()) * 7919 + absl::ToUnixMicros(absl::Now())) % span);
    for (int i = 0; i < 256; ++i) {
      const int port = bound(10000 + (start + i * 97) % span);
      if (port > 0) return port;
    }
  }
  return bound(0);
}

// Whether the built flatshardd knows --state_dir (branch `restart` merged).
inline bool DaemonHasStateDir() {
  const char* no_state = std::getenv("FS_CHAOS_NO_STATE_DIR");
  if (no_state != nullptr && std::string(no_state) == "1") return true;
  const std::string cmd = std::string(FS_BINARY_DIR) + "/server/flatshardd --helpfull 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return false;
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  pclose(p);
  return absl::StrContains(out, "state_dir");
}

// `n` flatshardd processes, each with its own --state_dir (a directory the daemon creates
// under this cluster's temp directory). With n > 1 each has a PeerService on a loopback port
// chosen here, kept across restarts (the coordinator, daemon 0, is where every rank's Join
// goes, so it must come back on the same address), and node name "node<i>". Rank r lives on
// daemon r % n.
class ChaosCluster {
 public:
  ChaosCluster(int n, std::vector<std::string> extra_flags) : n_(n) {
    static int counter = 0;
    root_ =
        std::filesystem::temp_directory_path() / absl::StrCat("fschaos", getpid(), "x", counter++);
    std::filesystem::create_directories(root_);
    for (int i = 0; i < n; ++i) {
      testing::DaemonOptions o;
      o.tag_prefix = "fsch";
      o.default_wait = "10s";
      o.extra_flags = extra_flags;
      // FS_CHAOS_NO_STATE_DIR=1 (debugging the harness): no --state_dir, so a restart loses
      // the shards and the trials must fail.
      const char* no_state = std::getenv("FS_CHAOS_NO_STATE_DIR");
      if (no_state == nullptr || std::string(no_state) != "1") {
        o.extra_flags.push_back("--state_dir=" + state_dir(i));
      }
      if (n > 1) {
        const int port = FreePort();
        peer_addresses_.push_back(absl::StrCat("127.0.0.1:", port));
        peer_files_.push_back((root_ / absl::StrCat("peer", i)).string());
        o.node_name = absl::StrCat("node", i);
        o.extra_flags.push_back("--peer_address=" + peer_addresses_[i]);
        o.extra_flags.push_back("--peer_address_file=" + peer_files_[i]);
      }
      daemons_.push_back(std::make_unique<testing::DaemonProcess>(std::move(o)));
      if (n > 1) {
        EXPECT_TRUE(WaitForPeerFile(i)) << "daemon " << i << " has no PeerService";
      }
    }
  }
  ~ChaosCluster() {
    daemons_.clear();
    std::error_code ignored;
    std::filesystem::remove_all(root_, ignored);
  }
  ChaosCluster(const ChaosCluster&) = delete;
  ChaosCluster& operator=(const ChaosCluster&) = delete;

  int size() const { return n_; }
  testing::DaemonProcess& daemon(int i) { return *daemons_.at(i); }
  std::string state_dir(int i) const { return (root_ / absl::StrCat("state", i)).string(); }
  std::string AddressFor(int rank) const { return daemons_.at(rank % n_)->address(); }
  std::string coordinator() const { return n_ > 1 ? peer_addresses_[0] : ""; }

  void Kill(int i) { daemon(i).Kill(); }
  // Starts daemon i again with the same flags (state dir, socket, segment prefix, peer port);
  // returns once it listens on both.
  bool Restart(int i) {
    if (n_ > 1) std::remove(peer_files_[i].c_str());
    if (!daemon(i).Restart()) return false;
    return n_ == 1 || WaitForPeerFile(i);
  }
  void PrintLogs(size_t lines = 60) const {
    for (const auto& d : daemons_) d->PrintLogTail(lines);
  }

 private:
  bool WaitForPeerFile(int i) const {
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (access(peer_files_[i].c_str(), F_OK) != 0) {
      if (absl::Now() > until) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return true;
  }

  int n_;
  std::filesystem::path root_;
  std::vector<std::string> peer_addresses_;
  std::vector<std::string> peer_files_;
  std::vector<std::unique_ptr<testing::DaemonProcess>> daemons_;
};

}  // namespace flatshard::chaos
