#pragma once
// Bounds on what callers may send flatshard (README "Limits", spec/semantics.md §4), and the
// helpers that refuse or quote input against them. One place, so client, daemon and CLI
// refuse the same things with the same words: INVALID_ARGUMENT naming the field and the limit,
// checked before anything expensive (JSON parsing, planning, allocation) happens.
//
// Error texts that quote caller input quote at most kMaxQuotedBytes of it (Truncated); the
// daemon also bounds every status message it sends (kMaxErrorMessageBytes), so no answer can
// outgrow gRPC's metadata limit (8 KiB of headers) and tear the channel (and a lease) down.

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace flatshard {

// Names: a group id, a token, a registered module path or a summoned submodule path, a
// coordinator's peer address. A module path is a dotted FQN; 4 KiB holds a 160-level tree
// (kMaxModuleDepth) of 25-character names.
inline constexpr size_t kMaxGroupBytes = 256;
inline constexpr size_t kMaxTokenBytes = 1024;
inline constexpr size_t kMaxModulePathBytes = 4096;
inline constexpr size_t kMaxAddressBytes = 1024;
// Summons a Summon may end first (SummonRequest.end_first): one unit transition needs one.
inline constexpr int kMaxEndFirst = 64;
// Model descriptions: the JSON texts a client reads, and the module instances of a manifest
// (a 100-layer MoE transformer with 64 experts per layer has ~30,000).
inline constexpr size_t kMaxManifestJsonBytes = size_t{64} << 20;
inline constexpr size_t kMaxPolicyJsonBytes = size_t{1} << 20;
inline constexpr int64_t kMaxManifestModules = 200000;
// Parameters and buffers over all modules of a manifest.
inline constexpr int64_t kMaxManifestTensors = 2000000;
// Largest request the daemon reads (a manifest of kMaxManifestModules modules is far below).
inline constexpr int kMaxRequestBytes = 128 << 20;
// How much of a caller's input an error text quotes, and how long a status message may be.
inline constexpr size_t kMaxQuotedBytes = 256;
inline constexpr size_t kMaxErrorMessageBytes = 2048;

// `text` cut to `max` bytes (at a UTF-8 character boundary) with "..." and the number of bytes
// left out appended; `text` itself when it fits.
inline std::string Truncated(absl::string_view text, size_t max = kMaxQuotedBytes) {
  if (text.size() <= max) return std::string(text);
  size_t cut = max;
  // Do not split a multi-byte character: back up over continuation bytes (10xxxxxx).
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return absl::StrCat(text.substr(0, cut), "... (", text.size() - cut, " more bytes)");
}

// OK when `value` has at most `max` bytes; else INVALID_ARGUMENT "<where>: <field> has N
// bytes, the limit is M" (the value itself is not quoted: it is what is too long).
inline absl::Status CheckLength(absl::string_view where, absl::string_view field,
                                absl::string_view value, size_t max) {
  if (value.size() <= max) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(where, where.empty() ? "" : ": ", field, " has ",
                                                 value.size(), " bytes, the limit is ", max));
}

}  // namespace flatshard
