// Runs LLVMFuzzerTestOneInput over saved inputs without libFuzzer, so the default (gcc) build
// replays the corpus and the regression inputs as an ordinary test.
//
//   flatshard_fuzz_replay [-v] [-slow_s=SECONDS] [-rss_limit_mb=MB] PATH...
//
// Each PATH is a file or a directory (walked recursively, in sorted order). A failing input
// traps inside the target (with -v its name is printed to stderr just before it runs). With
// -slow_s, inputs that take longer are listed at the end and the exit status is 1.
// Memory is capped like libFuzzer's -rss_limit_mb (default 2048): without ASan by an
// address-space limit (std::bad_alloc then aborts), under ASan by hard_rss_limit_mb.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

#include <sys/resource.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

#if defined(__SANITIZE_ADDRESS__)
#define FS_REPLAY_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FS_REPLAY_ASAN 1
#endif
#endif

#ifdef FS_REPLAY_ASAN
// ASan reserves terabytes of address space, so the cap is its own RSS watchdog. ASAN_OPTIONS
// in the environment still overrides this.
extern "C" const char* __asan_default_options() { return "hard_rss_limit_mb=2048"; }
#endif

namespace {

namespace fs = std::filesystem;

bool ReadFile(const fs::path& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  out->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return !in.bad();
}

}  // namespace

int main(int argc, char** argv) {
  bool verbose = false;
  double slow_s = 0;         // 0: no limit
  long rss_limit_mb = 2048;  // 0: no limit
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "-v") == 0) {
      verbose = true;
      continue;
    }
    if (std::strncmp(argv[i], "-slow_s=", 8) == 0) {
      char* end = nullptr;
      slow_s = std::strtod(argv[i] + 8, &end);
      if (end == argv[i] + 8 || *end != '\0' || slow_s < 0) {
        std::fprintf(stderr, "replay: bad %s\n", argv[i]);
        return 2;
      }
      continue;
    }
    if (std::strncmp(argv[i], "-rss_limit_mb=", 14) == 0) {
      char* end = nullptr;
      rss_limit_mb = std::strtol(argv[i] + 14, &end, 10);
      if (end == argv[i] + 14 || *end != '\0' || rss_limit_mb < 0) {
        std::fprintf(stderr, "replay: bad %s\n", argv[i]);
        return 2;
      }
      continue;
    }
    const fs::path arg(argv[i]);
    std::error_code ec;
    if (fs::is_directory(arg, ec)) {
      std::vector<fs::path> found;
      for (fs::recursive_directory_iterator it(arg, ec), end; !ec && it != end; it.increment(ec)) {
        if (it->is_regular_file(ec)) found.push_back(it->path());
      }
      if (ec) {
        std::fprintf(stderr, "replay: cannot walk %s: %s\n", argv[i], ec.message().c_str());
        return 2;
      }
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::is_regular_file(arg, ec)) {
      files.push_back(arg);
    } else {
      std::fprintf(stderr, "replay: no such file or directory: %s\n", argv[i]);
      return 2;
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "usage: %s [-v] FILE_OR_DIR...  (no inputs found)\n", argv[0]);
    return 2;
  }
#ifndef FS_REPLAY_ASAN
  if (rss_limit_mb > 0) {
    const rlim_t bytes = static_cast<rlim_t>(rss_limit_mb) << 20;
    const rlimit limit = {bytes, bytes};
    if (setrlimit(RLIMIT_AS, &limit) != 0) std::perror("replay: setrlimit");
  }
#endif
  std::string data;
  std::vector<std::string> slow;
  for (const fs::path& file : files) {
    if (!ReadFile(file, &data)) {
      std::fprintf(stderr, "replay: cannot read %s\n", file.c_str());
      return 2;
    }
    // Printed before running, so a trap leaves the culprit as the last line.
    if (verbose) std::fprintf(stderr, "replay: %s (%zu bytes)\n", file.c_str(), data.size());
    const auto start = std::chrono::steady_clock::now();
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(data.data()), data.size());
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (slow_s > 0 && seconds > slow_s) {
      slow.push_back(file.string() + " (" + std::to_string(seconds) + " s)");
    }
  }
  std::printf("replay: %zu inputs ran without a crash\n", files.size());
  if (!slow.empty()) {
    std::fprintf(stderr, "replay: %zu inputs took longer than %g s:\n", slow.size(), slow_s);
    for (const std::string& s : slow) std::fprintf(stderr, "  %s\n", s.c_str());
    return 1;
  }
  return 0;
}
