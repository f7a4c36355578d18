// The metrics registry's exposition format and the /metrics HTTP server, over a real socket.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/metrics/daemon_metrics.h"
#include "server/metrics/http_server.h"
#include "server/metrics/registry.h"

namespace flatshard::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// Sends `request` to 127.0.0.1:port and returns everything the server answered.
std::string Http(int port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "connect failed";
  }
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return out;
}

TEST(MetricsRegistryTest, RendersCountersGaugesAndHistogramsInTextFormat) {
  Registry r;
  CounterFamily& rpcs = r.AddCounter("t_rpcs_total", "RPCs\nanswered", {"method", "code"});
  rpcs.WithLabels({"Join", "OK"}).Increment();
  rpcs.WithLabels({"Join", "OK"}).Increment(2);
  rpcs.WithLabels({"Summon", "NOT_FOUND"}).Increment();
  GaugeFamily& mem = r.AddGauge("t_memory_bytes", "memory", {"kind"});
  mem.WithLabels({"shard"}).Set(1 << 20);
  mem.WithLabels({"shard"}).Add(-1);
  HistogramFamily& lat = r.AddHistogram("t_latency_seconds", "latency", {"method"}, {0.1, 1});
  lat.WithLabels({"Join"}).Observe(0.05);
  lat.WithLabels({"Join"}).Observe(0.5);
  lat.WithLabels({"Join"}).Observe(5);
  r.AddCounter("t_unlabelled_total", "no labels");

  const std::string text = r.Render();
  EXPECT_THAT(text, HasSubstr("# HELP t_rpcs_total RPCs\\nanswered\n# TYPE t_rpcs_total counter\n"
                              "t_rpcs_total{method=\"Join\",code=\"OK\"} 3\n"
                              "t_rpcs_total{method=\"Summon\",code=\"NOT_FOUND\"} 1\n"));
  EXPECT_THAT(text,
              HasSubstr("# TYPE t_memory_bytes gauge\nt_memory_bytes{kind=\"shard\"} 1048575\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE t_latency_seconds histogram\n"
                              "t_latency_seconds_bucket{method=\"Join\",le=\"0.1\"} 1\n"
                              "t_latency_seconds_bucket{method=\"Join\",le=\"1\"} 2\n"
                              "t_latency_seconds_bucket{method=\"Join\",le=\"+Inf\"} 3\n"
                              "t_latency_seconds_sum{method=\"Join\"} 5.55\n"
                              "t_latency_seconds_count{method=\"Join\"} 3\n"));
  // A family without labels shows its zero before anything happened.
  EXPECT_THAT(text, HasSubstr("# TYPE t_unlabelled_total counter\nt_unlabelled_total 0\n"));
  // Registering again returns the same family.
  EXPECT_EQ(&r.AddCounter("t_rpcs_total", "other help", {"method", "code"}), &rpcs);
}

TEST(MetricsRegistryTest, EscapesLabelValuesAndFormatsValuesExactly) {
  EXPECT_EQ(EscapeLabelValue("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(12345678901234.0), "12345678901234");
  EXPECT_EQ(FormatValue(0.25), "0.25");
  EXPECT_EQ(FormatValue(1.0 / 0.0), "+Inf");
  Registry r;
  r.AddGauge("t_g", "g", {"group"}).WithLabels({"job \"x\""}).Set(1);
  EXPECT_THAT(r.Render(), HasSubstr("t_g{group=\"job \\\"x\\\"\"} 1\n"));
}

TEST(MetricsRegistryTest, ConcurrentIncrementsAreAllCounted) {
  Registry r;
  CounterFamily& c = r.AddCounter("t_c_total", "c", {"thread"});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 10000; ++i) c.WithLabels({t % 2 ? "odd" : "even"}).Increment();
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(c.WithLabels({"odd"}).value(), 20000);
  EXPECT_EQ(c.WithLabels({"even"}).value(), 20000);
}

TEST(MetricsRegistryTest, DaemonMetricsAreRegisteredUpFront) {
  GetDaemonMetrics();
  RecordRpc("Ping", absl::StatusCode::kOk, absl::Milliseconds(2));
  RecordCollective("AllGather", absl::StatusCode::kOk, "inproc", 4096);
  RecordCollective("AllGather", absl::StatusCode::kAborted, "inproc", 4096);
  const std::string text = DefaultRegistry().Render();
  for (const char* name :
       {"flatshard_rpcs_total", "flatshard_rpc_latency_seconds", "flatshard_collectives_total",
        "flatshard_collective_bytes_total", "flatshard_aborted_collectives_total",
        "flatshard_memory_bytes", "flatshard_memory_limit_bytes", "flatshard_groups",
        "flatshard_clients", "flatshard_gpu_memory_bytes"}) {
    EXPECT_THAT(text, HasSubstr(std::string("# TYPE ") + name + " ")) << name;
  }
  EXPECT_THAT(text, HasSubstr("flatshard_rpcs_total{method=\"Ping\",code=\"OK\"} 1\n"));
  EXPECT_THAT(text,
              HasSubstr("flatshard_collectives_total{kind=\"AllGather\",status=\"ABORTED\"} 1\n"));
  // Failed ops move no bytes.
  EXPECT_THAT(text, HasSubstr("flatshard_collective_bytes_total{backend=\"inproc\"} 4096\n"));
}

TEST(MetricsServerTest, ServesMetricsAndNotFoundElsewhere) {
  int renders = 0;
  absl::StatusOr<std::unique_ptr<MetricsServer>> server = MetricsServer::Start("127.0.0.1:0", [&] {
    ++renders;
    return std::string("m 1\n");
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);
  EXPECT_EQ((*server)->address(), "127.0.0.1:" + std::to_string(port));

  const std::string ok = Http(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_THAT(ok, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(ok, HasSubstr("Content-Type: text/plain; version=0.0.4"));
  EXPECT_THAT(ok, HasSubstr("Content-Length: 4\r\n"));
  EXPECT_THAT(ok, HasSubstr("\r\n\r\nm 1\n"));
  EXPECT_THAT(Http(port, "GET / HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 404 Not Found\r\n"));
  EXPECT_THAT(Http(port, "POST /metrics HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 404"));
  const std::string head = Http(port, "HEAD /metrics HTTP/1.0\r\n\r\n");
  EXPECT_THAT(head, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(head, Not(HasSubstr("m 1")));
  // Garbage and early hang-ups do not stop the server.
  EXPECT_THAT(Http(port, "\r\n\r\n"), StartsWith("HTTP/1.1 404"));
  EXPECT_THAT(Http(port, "GET /metrics?x=1 HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 200"));
  server->reset();  // stops promptly
}

TEST(MetricsServerTest, RefusesBadAddresses) {
  EXPECT_EQ(MetricsServer::Start("nope", [] { return std::string(); }).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsServer::Start("127.0.0.1:99999", [] { return std::string(); }).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<MetricsServer>> first =
      MetricsServer::Start("127.0.0.1:0", [] { return std::string(); });
  ASSERT_TRUE(first.ok());
  // The port is taken.
  EXPECT_EQ(MetricsServer::Start((*first)->address(), [] { return std::string(); }).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace flatshard::metrics
