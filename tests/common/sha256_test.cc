// Tests for common/sha256 against the FIPS 180-4 / NIST test vectors and against digests
// computed with coreutils' sha256sum for lengths around the 55/56/64-byte padding boundaries.

#include "common/sha256.h"

#include <string>

#include "gtest/gtest.h"

namespace flatshard {
namespace {

TEST(Sha256Test, EmptyString) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(Sha256Test, Abc) {
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256Test, FourHundredFortyEightBitVector) {
  EXPECT_EQ(Sha256Hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(Sha256Test, EightHundredNinetySixBitVector) {
  EXPECT_EQ(
      Sha256Hex("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmn"
                "opqklmnopqrlmnopqrsmnopqrstnopqrstu"),
      "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
}

TEST(Sha256Test, OneMillionA) {
  EXPECT_EQ(Sha256Hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// Digests of n times 'a' from `printf 'a%.0s' $(seq n) | sha256sum`.
TEST(Sha256Test, LengthsAroundThePaddingBoundaries) {
  const struct {
    size_t length;
    const char* digest;
  } kCases[] = {
      {55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318"},
      {56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a"},
      {63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34"},
      {64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb"},
      {65, "635361c48bb9eab14198e76ea8ab7f1a41685d6ad62aa9146d301d4f17eb0ae0"},
      {119, "31eba51c313a5c08226adf18d4a359cfdfd8d2e816b13f4af952f7ea6584dcfb"},
      {120, "2f3d335432c70b580af0e8e1b3674a7c020d683aa5f73aaaedfdc55af904c21c"},
      {128, "6836cf13bac400e9105071cd6af47084dfacad4e5e302c94bfed24e013afb73e"},
  };
  for (const auto& c : kCases) {
    EXPECT_EQ(Sha256Hex(std::string(c.length, 'a')), c.digest) << "length " << c.length;
  }
}

TEST(Sha256Test, BinaryInputWithNulAndHighBytes) {
  // printf '\x00' | sha256sum
  EXPECT_EQ(Sha256Hex(absl::string_view("\0", 1)),
            "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d");
  // printf '\xff' | sha256sum: high bytes are read as unsigned.
  EXPECT_EQ(Sha256Hex("\xff"), "a8100ae6aa1940d0b663bb31cd466142ebbdbd5187131b92d93818987832eb89");
}

TEST(Sha256Test, OutputIsSixtyFourLowerCaseHexDigits) {
  for (size_t n : {0, 1, 55, 56, 64, 1000}) {
    std::string d = Sha256Hex(std::string(n, 'x'));
    ASSERT_EQ(d.size(), 64u);
    for (char c : d) EXPECT_TRUE((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')) << d;
  }
}

}  // namespace
}  // namespace flatshard
