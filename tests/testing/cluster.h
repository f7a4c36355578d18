#pragma once
// A Cluster of real flatshardd processes on this host standing in for nodes, and a Layout
// that places a group's ranks on them:
//   kSingle              1 daemon without a PeerService; ranks join with no coordinator (a
//                        local group: the behaviour before multi-daemon groups).
//   kTwoDaemons          2 daemons; rank r on daemon r % 2.
//   kThreeDaemonsUneven  3 daemons; rank r on daemon r % 3 (world 4: 2/1/1 ranks).
// In the multi-daemon layouts every daemon has a PeerService on a free loopback port, a
// distinct node name ("node0", "node1", ...) and the coordinator is daemon 0.
//
// Every daemon is a DaemonProcess (tests/testing/daemon_process.h): killed and cleaned up
// (socket, segments, directory) when the Cluster goes away, on every path.
// Thread-compatible; create, Kill and Restart from the test's main thread.

#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/daemon_process.h"

namespace flatshard::testing {

enum class Layout { kSingle, kTwoDaemons, kThreeDaemonsUneven };

// For INSTANTIATE_TEST_SUITE_P names: "Single", "TwoDaemons", "ThreeDaemonsUneven".
inline std::string LayoutName(Layout layout) {
  switch (layout) {
    case Layout::kSingle:
      return "Single";
    case Layout::kTwoDaemons:
      return "TwoDaemons";
    case Layout::kThreeDaemonsUneven:
      return "ThreeDaemonsUneven";
  }
  return "Unknown";
}

// gtest prints parameters with it ("GetParam() = TwoDaemons").
inline void PrintTo(Layout layout, std::ostream* os) { *os << LayoutName(layout); }

inline int DaemonCount(Layout layout) {
  switch (layout) {
    case Layout::kSingle:
      return 1;
    case Layout::kTwoDaemons:
      return 2;
    case Layout::kThreeDaemonsUneven:
      return 3;
  }
  return 1;
}

// Usable as the name generator of INSTANTIATE_TEST_SUITE_P over Layout values.
struct LayoutParamName {
  template <typename ParamInfo>
  std::string operator()(const ParamInfo& info) const {
    return LayoutName(info.param);
  }
};

inline const std::vector<Layout>& AllLayouts() {
  static const std::vector<Layout> kAll = {Layout::kSingle, Layout::kTwoDaemons,
                                           Layout::kThreeDaemonsUneven};
  return kAll;
}
inline const std::vector<Layout>& MultiDaemonLayouts() {
  static const std::vector<Layout> kMulti = {Layout::kTwoDaemons, Layout::kThreeDaemonsUneven};
  return kMulti;
}

struct ClusterOptions {
  std::string tag_prefix = "fscl";
  std::string default_wait = "10s";
  // Extra flags for every daemon, e.g. {"--peer_timeout=2s"}.
  std::vector<std::string> extra_flags;
  // Flags for one daemon, by index, after extra_flags.
  std::vector<std::vector<std::string>> daemon_flags;
  bool metrics = false;  // DaemonOptions::metrics on every daemon
};

class Cluster {
 public:
  explicit Cluster(Layout layout, ClusterOptions options = {}) : layout_(layout) {
    const int n = DaemonCount(layout);
    for (int i = 0; i < n; ++i) {
      DaemonOptions o;
      o.tag_prefix = options.tag_prefix;
      o.default_wait = options.default_wait;
      o.extra_flags = options.extra_flags;
      if (static_cast<size_t>(i) < options.daemon_flags.size()) {
        o.extra_flags.insert(o.extra_flags.end(), options.daemon_flags[i].begin(),
                             options.daemon_flags[i].end());
      }
      o.metrics = options.metrics;
      if (multi()) {
        o.peer = true;
        o.node_name = "node" + std::to_string(i);
      }
      daemons_.push_back(std::make_unique<DaemonProcess>(std::move(o)));
    }
  }
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  Layout layout() const { return layout_; }
  bool multi() const { return layout_ != Layout::kSingle; }
  int daemon_count() const { return static_cast<int>(daemons_.size()); }
  // The smallest world that puts a rank on every daemon (1, 2 or 3): tests written for one
  // rank use it so that multi-daemon layouts really span daemons.
  int spanning_world() const { return daemon_count(); }

  // Which daemon rank `rank` joins.
  int DaemonOf(int rank) const { return rank % daemon_count(); }
  DaemonProcess& daemon(int i) { return *daemons_.at(i); }
  const DaemonProcess& daemon(int i) const { return *daemons_.at(i); }
  DaemonProcess& DaemonFor(int rank) { return daemon(DaemonOf(rank)); }
  const DaemonProcess& DaemonFor(int rank) const { return daemon(DaemonOf(rank)); }
  // The gRPC address ("unix:...") and socket path of rank `rank`'s daemon.
  std::string AddressFor(int rank) const { return DaemonFor(rank).address(); }
  const std::string& SocketFor(int rank) const { return DaemonFor(rank).socket(); }
  // Whether ranks a and b are on the same daemon (they share read-only summon buffers).
  bool SameDaemon(int a, int b) const { return DaemonOf(a) == DaemonOf(b); }
  // The coordinator every rank names when it joins: daemon 0's peer address; "" for kSingle.
  std::string coordinator() const { return multi() ? daemons_[0]->peer_address() : ""; }

  // SIGKILL of daemon i (a crashed node); Restart brings it back with the same node name.
  void Kill(int i) { daemon(i).Kill(); }
  bool Restart(int i) { return daemon(i).Restart(); }
  bool Restart(int i, const std::vector<std::string>& more_flags) {
    return daemon(i).Restart(more_flags);
  }

  void PrintLogs() const {
    for (const auto& d : daemons_) d->PrintLogTail();
  }

 private:
  Layout layout_;
  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
};

}  // namespace flatshard::testing
