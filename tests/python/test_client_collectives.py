"""flatshard.Client.all_reduce and Client.broadcast (README "Group collectives") against a real
flatshardd: lists and tensors, sum/max/min, the same result bit for bit on every rank, any
root, and a rank passing other input named on every rank (the group goes on)."""

import pytest
import torch

import flatshard
import flatshard.testing
from conftest import run_group

WORLD = 3


@pytest.fixture(scope="module")
def daemon():
    with flatshard.testing.LocalDaemon() as d:
        yield d


def test_all_reduce_lists_and_tensors(daemon):
    def fn(rank, c):
        out = {op: c.all_reduce([rank, -rank, 0.5 * rank], op) for op in ("sum", "max", "min")}
        t32 = torch.tensor([[1e8 if rank == 0 else -1e8, 0.1 * (rank + 1)]], dtype=torch.float32)
        same = c.all_reduce(t32)
        t64 = c.all_reduce(torch.tensor([1.0 / (rank + 3)], dtype=torch.float64), "max")
        return out, same is t32, t32, t64

    got = run_group(daemon.address, WORLD, fn)
    # The rank-order float32 sum: (1e8 + -1e8) + -1e8, (0.1 + 0.2) + 0.3 in float32.
    want32 = torch.tensor([1e8], dtype=torch.float32) - 1e8 - 1e8
    tenths = (torch.tensor(0.1, dtype=torch.float32) + torch.tensor(0.2, dtype=torch.float32)
              + torch.tensor(0.3, dtype=torch.float32))
    for out, in_place, t32, t64 in got.values():
        assert out == {"sum": [3.0, -3.0, 1.5], "max": [2.0, 0.0, 1.0],
                       "min": [0.0, -2.0, 0.0]}
        assert in_place and t32.shape == (1, 2)
        assert t32[0, 0] == want32[0] and t32[0, 1] == tenths
        assert t64.dtype == torch.float64 and t64.item() == 1.0 / 3
        assert torch.equal(t32, got[0][2])


def test_broadcast_bytes_and_tensors(daemon):
    def fn(rank, c):
        data = c.broadcast(bytes([rank]) * 5, root=2)
        t = torch.full((3,), rank, dtype=torch.bfloat16)
        c.broadcast(t, root=1)
        return data, t

    for data, t in run_group(daemon.address, WORLD, fn).values():
        assert data == bytes([2]) * 5
        assert torch.equal(t, torch.full((3,), 1, dtype=torch.bfloat16))


def test_differing_input_is_named_on_every_rank(daemon):
    def fn(rank, c):
        with pytest.raises(flatshard.InvalidArgumentError,
                           match="AllReduce: rank 1 passed 16 bytes, rank 0 8"):
            c.all_reduce([1.0] * (2 if rank == 1 else 1))
        with pytest.raises(flatshard.InvalidArgumentError, match="rank 2 asked for max"):
            c.all_reduce([1.0], "max" if rank == 2 else "sum")
        with pytest.raises(flatshard.InvalidArgumentError, match="all_reduce: a torch.int64"):
            c.all_reduce(torch.tensor([1]))  # refused before any RPC, on every rank alike
        return c.all_reduce([1.0])  # the group goes on

    assert all(v == [3.0] for v in run_group(daemon.address, WORLD, fn).values())
