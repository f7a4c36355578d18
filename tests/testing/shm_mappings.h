#pragma once
// Which shared-memory segment this process has mapped at an address (/proc/self/maps): tests
// that check where the client's views point.

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>

namespace flatshard::testing {

// The shared-memory segment ("/name") mapped at `p` in this process, from /proc/self/maps;
// "" when `p` is in no /dev/shm mapping.
inline std::string SegmentOf(const void* p) {
  std::ifstream maps("/proc/self/maps");
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  std::string line;
  while (std::getline(maps, line)) {
    unsigned long begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &begin, &end) != 2) continue;
    if (addr < begin || addr >= end) continue;
    const size_t at = line.find("/dev/shm/");
    return at == std::string::npos ? "" : line.substr(at + 8);
  }
  return "";
}

}  // namespace flatshard::testing
