#pragma once
// The parent's side of the daemon chaos trials (tests/chaos/daemon_chaos_test.cc): the trainer
// processes of one phase of a trial (this test binary re-executed), the lines they say through
// a pipe each, and the re-joins the parent asks of trainers that finished while another
// re-attaches. Thread-compatible; used from the test's main thread.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/chaos/chaos_testing.h"
#include "tests/testing/rank_group.h"

namespace flatshard::chaos {

constexpr int kWorld = 3;  // ranks of every trial

struct Line {
  absl::Time at;    // read by the parent
  absl::Time sent;  // said by the trainer
  std::string text;
};

struct Trainer {
  pid_t pid = -1;
  int fd = -1;
  int go = -1;  // closing it lets the trainer exit after its last word
  std::string buffer;
  std::vector<Line> lines;
  bool eof = false;
  bool asked_to_rejoin = false;  // "r" sent after its last "done"
};

inline bool FinalLine(const std::string& l) {
  return absl::StartsWith(l, "done ") || absl::StartsWith(l, "bad ") ||
         absl::StartsWith(l, "fatal ");
}

// The trainer processes of one phase of a trial.
class Trainers {
 public:
  Trainers(ChaosCluster& cluster, std::string group)
      : cluster_(cluster), group_(std::move(group)) {}
  ~Trainers() { KillAll(); }

  void Start(const std::string& mode, uint64_t target, int optimizer_pause_ms = 10) {
    mode_ = mode;
    trainers_.assign(kWorld, Trainer());
    for (int r = 0; r < kWorld; ++r) {
      // Close-on-exec everywhere but on the child's own ends while it is spawned.
      int fds[2], go[2];
      ASSERT_EQ(pipe2(fds, O_CLOEXEC), 0);
      ASSERT_EQ(pipe2(go, O_CLOEXEC), 0);
      fcntl(fds[1], F_SETFD, 0);
      fcntl(go[0], F_SETFD, 0);
      trainers_[r].pid = ::flatshard::testing::SpawnSelf(
          "DaemonChaosChild.Run",
          {absl::StrCat("FS_CHAOS_FD=", fds[1]), absl::StrCat("FS_CHAOS_GO_FD=", go[0]),
           absl::StrCat("FS_CHAOS_RANK=", r), "FS_CHAOS_GROUP=" + group_,
           "FS_CHAOS_COORDINATOR=" + cluster_.coordinator(),
           "FS_CHAOS_ADDRESS=" + cluster_.AddressFor(r), "FS_CHAOS_MODE=" + mode,
           absl::StrCat("FS_CHAOS_TARGET=", target),
           absl::StrCat("FS_CHAOS_OPTIMIZER_PAUSE_MS=", optimizer_pause_ms)});
      close(fds[1]);
      close(go[0]);
      ASSERT_GT(trainers_[r].pid, 0);
      trainers_[r].fd = fds[0];
      trainers_[r].go = go[1];
    }
  }

  // Reads lines until `stop` returns true, every pipe closed, or `timeout` (returns false).
  bool Pump(absl::Duration timeout, const std::function<bool(int, const std::string&)>& stop) {
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      std::vector<pollfd> fds = OpenPipes();
      if (fds.empty()) return true;
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return false;
      if (poll(fds.data(), fds.size(), static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <=
          0) {
        continue;
      }
      // Every line said by now, on every pipe, before deciding anything on them: a rank's
      // "verified" said before another's "done" may still sit unread in its own pipe, and
      // deciding on the "done" alone asked that rank to re-join for nothing (a stale
      // "attaching", AskDoneRanksToRejoin).
      ReadEverythingSaid();
      bool stopped = false;
      for (int r = 0; r < kWorld; ++r) {
        Trainer& t = trainers_[r];
        size_t nl;
        while ((nl = t.buffer.find('\n')) != std::string::npos) {
          std::string line = t.buffer.substr(0, nl);
          t.buffer.erase(0, nl + 1);
          absl::Time sent = absl::Now();
          if (const size_t at = line.rfind(" @"); at != std::string::npos) {
            int64_t micros = 0;
            if (absl::SimpleAtoi(line.substr(at + 2), &micros)) {
              sent = absl::FromUnixMicros(micros);
              line.resize(at);
            }
          }
          t.lines.push_back(Line{absl::Now(), sent, line});
          if (!absl::StartsWith(line, "done ")) t.asked_to_rejoin = false;
          if (!stopped && stop(r, line)) stopped = true;
        }
      }
      if (mode_ == "train") AskDoneRanksToRejoin();
      if (stopped) return true;
    }
  }

  // Reads until every trainer said its last word (or `timeout`); false on timeout.
  bool PumpToFinal(absl::Duration timeout) {
    auto all_final = [&] {
      for (const Trainer& t : trainers_) {
        if (t.eof) continue;
        if (t.lines.empty() || !IsLast(t.lines.back().text)) return false;
      }
      return true;
    };
    if (all_final()) return true;
    return Pump(timeout, [&](int, const std::string&) { return all_final(); });
  }

  // Lets every trainer exit, and reads what is left.
  void Release() {
    for (Trainer& t : trainers_) {
      if (t.go >= 0) close(t.go);
      t.go = -1;
    }
    Pump(absl::Seconds(20), [](int, const std::string&) { return false; });
  }

  void KillAll() {
    for (Trainer& t : trainers_) {
      if (t.pid > 0) {
        kill(t.pid, SIGKILL);
        waitpid(t.pid, nullptr, 0);
        t.pid = -1;
      }
      if (t.fd >= 0) close(t.fd);
      if (t.go >= 0) close(t.go);
      t.fd = t.go = -1;
      t.eof = true;
    }
  }
  const Trainer& trainer(int r) const { return trainers_[r]; }

 private:
  // A rank re-attaches (its last "attaching" is after its last "verified") while others
  // already said "done": the daemon died after their last collective, and they must join
  // again too. (A rank cannot have finished after a re-attach it did not take part in: the
  // re-attach's Register and summon are collective.)
  void AskDoneRanksToRejoin() {
    bool someone_attaching = false;
    for (const Trainer& t : trainers_) {
      for (auto it = t.lines.rbegin(); it != t.lines.rend(); ++it) {
        if (it->text == "attaching") {
          someone_attaching = true;
          break;
        }
        if (absl::StartsWith(it->text, "verified ")) break;
      }
    }
    if (!someone_attaching) return;
    for (Trainer& t : trainers_) {
      if (t.go < 0 || t.lines.empty() || t.asked_to_rejoin) continue;
      if (absl::StartsWith(t.lines.back().text, "done ")) {
        (void)!write(t.go, "r", 1);
        t.asked_to_rejoin = true;
      }
    }
  }
  // The pipes of the trainers still writing.
  std::vector<pollfd> OpenPipes() const {
    std::vector<pollfd> fds;
    for (const Trainer& t : trainers_) {
      if (!t.eof) fds.push_back(pollfd{t.fd, POLLIN, 0});
    }
    return fds;
  }
  // Reads whatever every pipe holds now into its trainer's buffer (no wait).
  void ReadEverythingSaid() {
    for (;;) {
      std::vector<pollfd> fds = OpenPipes();
      if (fds.empty() || poll(fds.data(), fds.size(), 0) <= 0) return;
      for (const pollfd& p : fds) {
        if (p.revents == 0) continue;
        for (Trainer& t : trainers_) {
          if (t.fd != p.fd || t.eof) continue;
          char buf[4096];
          const ssize_t n = read(t.fd, buf, sizeof(buf));
          if (n <= 0) {
            t.eof = true;
          } else {
            t.buffer.append(buf, n);
          }
        }
      }
    }
  }
  bool IsLast(const std::string& l) const {
    if (mode_ == "verify" && absl::StartsWith(l, "verified ")) return true;
    return FinalLine(l);
  }

  ChaosCluster& cluster_;
  std::string group_;
  std::string mode_;
  std::vector<Trainer> trainers_;
};

}  // namespace flatshard::chaos
