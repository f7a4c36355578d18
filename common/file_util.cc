#include "common/file_util.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace flatshard {

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(std::strerror(errno));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return absl::InvalidArgumentError("read error");
  return buffer.str();
}

}  // namespace flatshard
