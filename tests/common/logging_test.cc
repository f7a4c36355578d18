// Log levels at run time, one-line records, and the JSON format's id fields.

#include "common/logging.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flatshard {
namespace {

using ::testing::HasSubstr;

TEST(LoggingTest, LevelsParseAndApplyAtRunTime) {
  EXPECT_EQ(*ParseLogSeverity("INFO"), LogSeverity::kInfo);
  EXPECT_EQ(*ParseLogSeverity("warn"), LogSeverity::kWarning);
  EXPECT_EQ(*ParseLogSeverity("Warning"), LogSeverity::kWarning);
  EXPECT_EQ(*ParseLogSeverity("error"), LogSeverity::kError);
  EXPECT_EQ(ParseLogSeverity("loud").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LogSeverityName(LogSeverity::kWarning), "WARNING");

  ASSERT_TRUE(SetLogLevel("error").ok());
  EXPECT_EQ(MinLogSeverity(), LogSeverity::kError);
  EXPECT_EQ(SetLogLevel("bogus").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MinLogSeverity(), LogSeverity::kError) << "a bad level changes nothing";
  ::testing::internal::CaptureStderr();
  FS_LOG(INFO) << "dropped";
  FS_LOG(WARNING) << "dropped too";
  FS_LOG(ERROR) << "kept";
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, ::testing::Not(HasSubstr("dropped")));
  EXPECT_THAT(err, HasSubstr("kept"));
  ASSERT_TRUE(SetLogLevel("info").ok());

  SetVerbosity(2);
  ::testing::internal::CaptureStderr();
  FS_VLOG(2) << "verbose";
  FS_VLOG(3) << "too verbose";
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, HasSubstr("verbose"));
  EXPECT_THAT(err, ::testing::Not(HasSubstr("too verbose")));
  SetVerbosity(0);
}

TEST(LoggingTest, TextRecordsAreOneLine) {
  EXPECT_EQ(FormatLogRecord(LogFormat::kText, LogSeverity::kWarning, "daemon.cc", 42, 7,
                            "2024-05-01T12:00:00.000001", "group=g rank=1 a\nb"),
            "W2024-05-01T12:00:00.000001 7 daemon.cc:42] group=g rank=1 a\\nb\n");
}

TEST(LoggingTest, JsonRecordsCarryIdFields) {
  const std::string rec =
      FormatLogRecord(LogFormat::kJson, LogSeverity::kInfo, "collective_engine.cc", 9, 11, "T",
                      "group=job-1 rank=3 op_seq=17 unit=2, failed: \"quoted\"\nnext");
  EXPECT_EQ(rec,
            "{\"ts\":\"T\",\"level\":\"INFO\",\"tid\":11,\"src\":\"collective_engine.cc:9\","
            "\"msg\":\"group=job-1 rank=3 op_seq=17 unit=2, failed: \\\"quoted\\\"\\nnext\","
            "\"group\":\"job-1\",\"rank\":\"3\",\"op_seq\":\"17\",\"unit\":\"2\"}\n");
  EXPECT_EQ(*ParseLogFormat("json"), LogFormat::kJson);
  EXPECT_EQ(ParseLogFormat("xml").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LoggingTest, ConcurrentLevelChangesAndLogsAreSafe) {
  ::testing::internal::CaptureStderr();
  std::vector<std::thread> threads;
  threads.emplace_back([] {
    for (int i = 0; i < 200; ++i) SetLogLevel(i % 2 ? "info" : "error").IgnoreError();
  });
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([] {
      for (int i = 0; i < 200; ++i) FS_LOG(INFO) << "group=g i=" << i;
    });
  }
  for (std::thread& t : threads) t.join();
  const std::string err = ::testing::internal::GetCapturedStderr();
  SetLogLevel("info").IgnoreError();
  for (absl::string_view line : absl::StrSplit(err, '\n', absl::SkipEmpty())) {
    EXPECT_THAT(std::string(line), HasSubstr("group=g i="));
  }
}

}  // namespace
}  // namespace flatshard
