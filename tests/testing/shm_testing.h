#pragma once
// Helpers for tests that look at POSIX shared-memory segments in /dev/shm.

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"

namespace flatshard::testing {

// Names in /dev/shm (without the leading "/") that start with "<prefix>.".
inline std::vector<std::string> ListSegments(const std::string& prefix) {
  std::vector<std::string> names;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return names;
  while (const dirent* entry = readdir(dir)) {
    if (absl::StartsWith(entry->d_name, prefix + ".")) names.push_back(entry->d_name);
  }
  closedir(dir);
  return names;
}

// Whether a segment ("/name") can be opened.
inline bool SegmentExists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

}  // namespace flatshard::testing
