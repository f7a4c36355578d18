#pragma once
// GET /metrics from a daemon started with --metrics_address (tests only), and its samples.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace flatshard::testing {

// The whole HTTP answer from 127.0.0.1 at host_port's port ("" when it cannot connect).
inline std::string ScrapeMetrics(const std::string& host_port) {
  int port = 0;
  if (!absl::SimpleAtoi(host_port.substr(host_port.rfind(':') + 1), &port)) return "";
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n";
    ::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
    char buf[8192];
    ssize_t n;
    while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

// Sample name with labels -> value, from ScrapeMetrics' answer.
inline std::map<std::string, double> ParseMetrics(const std::string& text) {
  std::map<std::string, double> out;
  const size_t body = text.find("\r\n\r\n");
  if (body == std::string::npos) return out;
  for (absl::string_view line : absl::StrSplit(text.substr(body + 4), '\n', absl::SkipEmpty())) {
    if (line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    double v = 0;
    if (sp != absl::string_view::npos && absl::SimpleAtod(line.substr(sp + 1), &v)) {
      out[std::string(line.substr(0, sp))] = v;
    }
  }
  return out;
}

}  // namespace flatshard::testing
