#!/usr/bin/env python3
"""Prints the UCX 1.13 shared-memory (mm: sysv, posix) receive FIFOs of a process (issue 27).

  scripts/stress_ucx_fifo.py PID [PID...]      (root, or ptrace access to PID)

Finds the FIFOs among the process's shared mappings (a uct_mm_fifo_ctl_t whose pid field is
PID) and reads their head, tail and element flags through /proc/PID/mem. A FIFO is WEDGED
when a slot below head was claimed by a sender (head moved past it) but never published (its
owner bit still says "previous round") while the receiver is idle: UCX's receiver reads slots
strictly in order, so nothing behind that slot is ever received, from any sender. That is what
a sender killed between its claim (a CAS on head) and its publish leaves behind.
Layout (UCX 1.13 src/uct/sm/mm/base/mm_iface.h, defaults UCX_MM_FIFO_SIZE=64,
UCX_MM_FIFO_ELEM_SIZE=128): head u64 @0, tail u64 @128, pid i32 @136, elements @192.
"""
import os
import struct
import sys

CTL_SIZE = 192
ARMED = 1 << 63


def fifo_size():
    return int(os.environ.get("UCX_MM_FIFO_SIZE", "64"))


def elem_size():
    return int(os.environ.get("UCX_MM_FIFO_ELEM_SIZE", "128"))


def inspect(pid):
    n, esz = fifo_size(), elem_size()
    shift = n.bit_length() - 1
    found = 0
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            parts = line.split()
            if len(parts) < 6 or not ("SYSV" in parts[5] or "ucx" in parts[5] or "shm" in parts[5]):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if hi - lo < CTL_SIZE + n * esz:
                continue
            try:
                mem.seek(lo)
                raw = mem.read(CTL_SIZE + n * esz)
            except OSError:
                continue
            head, = struct.unpack_from("<Q", raw, 0)
            tail, = struct.unpack_from("<Q", raw, 128)
            owner, = struct.unpack_from("<i", raw, 136)
            if owner != pid:
                continue
            found += 1
            head &= ~ARMED
            first_unpublished = None
            ready_after = 0
            for seq in range(tail, head):
                flags = raw[CTL_SIZE + (seq & (n - 1)) * esz]
                ready = (flags & 1) == ((seq >> shift) & 1)
                if not ready and first_unpublished is None:
                    first_unpublished = seq
                elif ready and first_unpublished is not None:
                    ready_after += 1
            state = "empty" if head == tail else "pending"
            if first_unpublished is not None:
                state = (f"WEDGED at slot {first_unpublished} (claimed, never published); "
                         f"{ready_after} published slot(s) behind it")
            print(f"pid {pid} {parts[5]} @{lo:#x}: head {head} tail {tail} "
                  f"({head - tail} in flight): {state}")
    if found == 0:
        print(f"pid {pid}: no UCX mm FIFO found")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        inspect(int(p))
