#pragma once
// The manifest document (formats.md) as compact text, written straight from the Manifest: the
// fast path of ValidateManifest, which reads it back with ReadValidManifest.

#include <optional>
#include <string>

#include "common/manifest.h"

namespace flatshard {

// The document ManifestToJson(manifest) holds (the same keys and values; refs for repeated
// instances), or nullopt when a string would need an escape (a quote, a backslash, a control
// character or a non-ASCII byte: the DOM path writes those). REQUIRES: every child index is
// in range and the module graph is acyclic and at most kMaxModuleDepth deep.
std::optional<std::string> ManifestToPlainJsonText(const Manifest& manifest);

}  // namespace flatshard
