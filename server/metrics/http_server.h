#pragma once
// MetricsServer: a minimal HTTP/1.1 server for Prometheus scrapes. One thread accepts one
// connection at a time, reads one request (up to 8 KiB, 2 s), answers and closes:
//   GET /metrics  -> 200, Content-Type: text/plain; version=0.0.4, the body from `render`
//   anything else -> 404 (HEAD /metrics gets the 200 headers without a body)
// Prometheus scrapes rarely and with one connection, so one thread is enough; a slow client
// delays the next scrape by at most the read timeout.
//
//   FS_ASSIGN_OR_RETURN(std::unique_ptr<MetricsServer> server,
//                       MetricsServer::Start("127.0.0.1:9450", [] { return Render(); }));
//   server->address();  // "127.0.0.1:9450" (the port it got, when asked for port 0)
//
// Thread safety: Start and the destructor from one thread; address() from any. `render`
// runs on the server's thread, one call at a time.

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard::metrics {

class MetricsServer {
 public:
  using RenderFn = std::function<std::string()>;

  // Listens on `address` ("host:port", "[v6]:port" or ":port" for every interface; port 0
  // picks a free one) and starts the thread.
  // Errors: INVALID_ARGUMENT for a malformed address; UNAVAILABLE when it cannot bind.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(absl::string_view address,
                                                              RenderFn render);
  // Stops the thread and closes the socket; a request in progress is cut off.
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // "host:port" with the bound port.
  const std::string& address() const { return address_; }
  int port() const { return port_; }

 private:
  MetricsServer(int listen_fd, int wake_fd, std::string address, int port, RenderFn render);
  void Loop();
  void Serve(int fd);

  const int listen_fd_;
  const int wake_fd_;  // an eventfd: written by the destructor to stop the loop
  const std::string address_;
  const int port_;
  const RenderFn render_;
  std::thread thread_;
};

}  // namespace flatshard::metrics
