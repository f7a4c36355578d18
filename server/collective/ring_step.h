#pragma once
// One transfer of a step of the algorithms over Transport (ring_algorithms.cc and
// hierarchical_algorithms.cc): a step posts its transfers, waits for all of them, then does
// its local work.

#include <cstdint>

#include "server/collective/buffer.h"

namespace flatshard::collective {

struct Xfer {
  bool send = false;
  int peer = 0;
  uint32_t sub = 0;
  ConstBuffer src;    // send
  MutableBuffer dst;  // recv
  bool fingerprint = false;
};

}  // namespace flatshard::collective
