#pragma once
// Zero-copy export of mapped host memory as Python memoryviews: the buffer protocol, so a
// trainer without numpy or torch (the core of the wheel needs neither) reads and writes views.
// The memoryview's exporter owns a share of the mappings, like DLPack capsules and numpy arrays
// (dlpack_export.h), so a memoryview that outlives its summon never points at unmapped memory.
//
// Thread safety: the functions need the GIL.

#include <pybind11/pybind11.h>

#include "client/python/dlpack_export.h"

namespace flatshard::python {

// Defines flatshard._C._HostBuffer, the exporter behind ToMemoryview's memoryviews.
void DefineHostBuffer(pybind11::module_& m);

// A memoryview over host memory `region` (format of its dtype, shape of the region; bfloat16 as
// "H", uint16), read-only unless `writable`. Throws std::invalid_argument for device memory,
// unless `device_as_host` (simulated GPUs).
pybind11::memoryview ToMemoryview(const Region& region, const Keepalive& keep, bool writable,
                                  bool device_as_host = false);

}  // namespace flatshard::python
