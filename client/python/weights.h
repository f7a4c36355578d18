#pragma once
// The binding of published weights (issue 25): flatshard._C.PublishedVersion, WeightsVersion
// and WeightsReader over flatshard::client::WeightsReader, and the publish half that
// module.cc's Client uses. flatshard.weights (Python) wraps them.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "flatshard/client.h"

namespace flatshard::python {

// Defines PublishedVersion, WeightsVersion and WeightsReader on `m`.
void DefineWeights(pybind11::module_& m);

// PublishOptions from Python's arguments: `dtype` a flatshard dtype name, "" for the
// parameters' own; throws StatusError (INVALID_ARGUMENT naming dtype) for an unknown one.
// `device`: PublishOptions::device (-1: host memory).
client::PublishOptions MakePublishOptions(const std::string& dtype,
                                          const std::vector<int64_t>& reader_uids,
                                          const std::string& reader_token, int device = -1);

}  // namespace flatshard::python
