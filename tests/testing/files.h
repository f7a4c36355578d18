#pragma once
// Reading test data files. Uses FS_SOURCE_DIR (set by fs_cc_test).

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace flatshard::testing {

// The whole file; an empty string (and a test failure) when it cannot be read.
inline std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// examples/models/<model>.<kind>.json, e.g. ExampleModelFile("gpt_tied", "manifest").
inline std::string ExampleModelFile(const std::string& model, const std::string& kind) {
  return ReadFile(std::filesystem::path(FS_SOURCE_DIR) / "examples" / "models" /
                  (model + "." + kind + ".json"));
}

}  // namespace flatshard::testing
