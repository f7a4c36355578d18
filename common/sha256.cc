#include "common/sha256.h"

#include <openssl/evp.h>

#include "absl/strings/escaping.h"
#include "common/logging.h"

namespace flatshard {

std::string Sha256Hex(absl::string_view data) {
  // OpenSSL's SHA-256 (libcrypto, which gRPC links anyway): its assembly uses the CPU's SHA
  // extensions where present. EVP_Digest fails only when libcrypto cannot allocate or has no
  // default provider, a broken installation on which no plan can be fingerprinted.
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  FS_CHECK(EVP_Digest(data.data(), data.size(), digest, &size, EVP_sha256(), nullptr) == 1 &&
           size == 32)
      << "OpenSSL EVP_Digest(SHA-256) failed";
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), size));
}

}  // namespace flatshard
