// InprocTransport: matching in either order, per-tag separation, size mismatch, abort, and
// shallow stacks for long chains of completions.

#include "server/collective/inproc/inproc_transport.h"

#include <cstring>
#include <functional>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/rank_group.h"

namespace flatshard::collective {
namespace {

using ::flatshard::testing::DoneRecorder;
using ::testing::HasSubstr;

TEST(InprocTransportTest, SendBeforeRecvDeliversOnMatch) {
  InprocTransport t(2);
  int src = 42, dst = 0;
  DoneRecorder sent, received;
  t.Send(0, 1, MessageTag{7, 1}, ConstBuffer{&src, 4}, sent.Callback());
  EXPECT_FALSE(sent.done());  // rendezvous: nothing has moved yet
  EXPECT_EQ(t.unmatched(), 1u);
  t.Recv(1, 0, MessageTag{7, 1}, MutableBuffer{&dst, 4}, received.Callback());
  EXPECT_TRUE(sent.Wait().ok());
  EXPECT_TRUE(received.Wait().ok());
  EXPECT_EQ(dst, 42);
  EXPECT_EQ(t.unmatched(), 0u);
}

TEST(InprocTransportTest, RecvBeforeSendDeliversOnMatch) {
  InprocTransport t(2);
  int src = 5, dst = 0;
  DoneRecorder sent, received;
  t.Recv(1, 0, MessageTag{1, 0}, MutableBuffer{&dst, 4}, received.Callback());
  EXPECT_FALSE(received.done());
  t.Send(0, 1, MessageTag{1, 0}, ConstBuffer{&src, 4}, sent.Callback());
  EXPECT_TRUE(received.Wait().ok());
  EXPECT_EQ(dst, 5);
}

TEST(InprocTransportTest, TagsAndDirectionsDoNotCrossMatch) {
  InprocTransport t(3);
  int a = 1, b = 2, c = 3, got_a = 0, got_b = 0, got_c = 0;
  DoneRecorder d[6];
  t.Send(0, 1, MessageTag{1, 0}, ConstBuffer{&a, 4}, d[0].Callback());
  t.Send(0, 1, MessageTag{2, 0}, ConstBuffer{&b, 4}, d[1].Callback());
  t.Send(2, 1, MessageTag{1, 0}, ConstBuffer{&c, 4}, d[2].Callback());
  t.Recv(1, 0, MessageTag{2, 0}, MutableBuffer{&got_b, 4}, d[3].Callback());
  t.Recv(1, 2, MessageTag{1, 0}, MutableBuffer{&got_c, 4}, d[4].Callback());
  t.Recv(1, 0, MessageTag{1, 0}, MutableBuffer{&got_a, 4}, d[5].Callback());
  for (DoneRecorder& r : d) EXPECT_TRUE(r.Wait().ok());
  EXPECT_EQ(got_a, 1);
  EXPECT_EQ(got_b, 2);
  EXPECT_EQ(got_c, 3);
}

TEST(InprocTransportTest, SizeMismatchFailsBothSides) {
  InprocTransport t(2);
  char src[8] = {}, dst[4] = {};
  DoneRecorder sent, received;
  t.Send(0, 1, MessageTag{3, 9}, ConstBuffer{src, 8}, sent.Callback());
  t.Recv(1, 0, MessageTag{3, 9}, MutableBuffer{dst, 4}, received.Callback());
  EXPECT_TRUE(absl::IsInvalidArgument(sent.Wait()));
  EXPECT_EQ(received.Wait(), sent.status());
  EXPECT_THAT(std::string(sent.status().message()),
              HasSubstr("rank 0 sent 8 bytes but rank 1 expected 4"));
}

TEST(InprocTransportTest, BadRanksAreRejected) {
  InprocTransport t(2);
  int x = 0;
  DoneRecorder self, outside;
  t.Send(1, 1, MessageTag{}, ConstBuffer{&x, 4}, self.Callback());
  t.Recv(0, 2, MessageTag{}, MutableBuffer{&x, 4}, outside.Callback());
  EXPECT_TRUE(absl::IsInvalidArgument(self.Wait()));
  EXPECT_TRUE(absl::IsInvalidArgument(outside.Wait()));
}

TEST(InprocTransportTest, AbortFailsPendingAndLaterTransfersWithTheFirstReason) {
  InprocTransport t(2);
  int x = 0;
  DoneRecorder pending, later;
  t.Recv(1, 0, MessageTag{1, 0}, MutableBuffer{&x, 4}, pending.Callback());
  t.Abort(absl::UnavailableError("peer gone"));
  t.Abort(absl::InternalError("ignored"));
  EXPECT_EQ(pending.Wait(), absl::UnavailableError("peer gone"));
  t.Send(0, 1, MessageTag{1, 0}, ConstBuffer{&x, 4}, later.Callback());
  EXPECT_EQ(later.Wait(), absl::UnavailableError("peer gone"));
  EXPECT_EQ(t.unmatched(), 0u);
}

TEST(InprocTransportTest, DestructionFailsPendingTransfers) {
  DoneRecorder pending;
  int x = 0;
  {
    InprocTransport t(2);
    t.Send(0, 1, MessageTag{1, 0}, ConstBuffer{&x, 4}, pending.Callback());
  }
  EXPECT_TRUE(absl::IsAborted(pending.Wait()));
}

TEST(InprocTransportTest, LongCallbackChainsStayShallow) {
  // Each completion posts the next ping-pong; without the trampoline 200000 messages would
  // nest that many frames deep on this thread.
  InprocTransport t(2);
  constexpr int kMessages = 200000;
  int value = 0, sink = 0;
  int completed = 0;
  std::function<void(int)> step = [&](int i) {
    if (i == kMessages) return;
    t.Recv(1, 0, MessageTag{static_cast<uint64_t>(i), 0}, MutableBuffer{&sink, 4},
           [&, i](absl::Status s) {
             ASSERT_TRUE(s.ok());
             ++completed;
             step(i + 1);
           });
    t.Send(0, 1, MessageTag{static_cast<uint64_t>(i), 0}, ConstBuffer{&value, 4},
           [](absl::Status) {});
  };
  step(0);
  EXPECT_EQ(completed, kMessages);
}

TEST(InprocTransportTest, SameMemoryIsNotCopied) {
  InprocTransport t(2);
  std::vector<char> buf(16, 'x');
  DoneRecorder sent, received;
  t.Send(0, 1, MessageTag{1, 0}, ConstBuffer{buf.data(), 16}, sent.Callback());
  t.Recv(1, 0, MessageTag{1, 0}, MutableBuffer{buf.data(), 16}, received.Callback());
  EXPECT_TRUE(received.Wait().ok());
  EXPECT_EQ(buf[15], 'x');
}

}  // namespace
}  // namespace flatshard::collective
