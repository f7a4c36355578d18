"""Forward and backward prefetch for FlatShardModule (FSDP's ``forward_prefetch`` and
``backward_prefetch``): the next unit's all-gather runs in the daemon while this unit computes.

The order comes from the first iteration (after registration or a re-attach, on every rank
alike), as FSDP's execution-order data: the units' pre-forward
order (forward prefetch) and their post-forward order, reversed (backward prefetch). A later
iteration whose order differs is warned about once; prefetching then follows the first
iteration's order, which stays correct (a prefetched unit nobody uses is ended, a unit nobody
prefetched is summoned when needed) but may not pay off. Every rank must run the same units in
the same order, as with FSDP: prefetches are collectives.

Memory stays bounded: at most one unit is prefetched at a time, so at most two units of a
forward (or backward) are unsharded at once besides the root's.
"""
import enum
import time
import warnings
from typing import Any, Callable, Dict, List, Optional


class BackwardPrefetch(enum.Enum):
    """FSDP's ``BackwardPrefetch``: when a unit's backward prefetches the next one's
    parameters. ``BACKWARD_PRE``: as the unit's backward starts (more overlap, one more unit
    unsharded); ``BACKWARD_POST``: once the unit's gradient was reduce-scattered."""
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


class _ExecOrder:
    """The units' order in the first iteration, and whether later iterations kept it."""

    def __init__(self) -> None:
        self.pre_forward: Optional[List[int]] = None
        self.post_forward: Optional[List[int]] = None
        # The units whose parameters the first backward needed, in the order it needed them:
        # a unit none of whose parameters a gradient needs (e.g. the first layer's weights
        # when its input needs none) is not summoned in backward, so not prefetched either.
        self.backward: Optional[List[int]] = None
        self._pre: List[int] = []
        self._post: List[int] = []
        self._bwd: List[int] = []
        self._warned = False

    def record_pre(self, unit: int) -> None:
        self._pre.append(unit)

    def record_post(self, unit: int) -> None:
        self._post.append(unit)

    def record_backward(self, unit: int) -> None:
        self._bwd.append(unit)

    def discard_iteration(self) -> None:
        """Forgets what the current (failed) iteration ran."""
        self._pre, self._post, self._bwd = [], [], []

    def end_iteration(self) -> None:
        pre, post, bwd = self._pre, self._post, self._bwd
        self._pre, self._post, self._bwd = [], [], []
        if self.backward is None and bwd:
            self.backward = bwd
        if not pre:
            return  # a step without a forward through the units (e.g. a bare backward)
        if self.pre_forward is None:
            self.pre_forward, self.post_forward = pre, post
        elif (pre != self.pre_forward or post != self.post_forward) and not self._warned:
            self._warned = True
            warnings.warn(
                f"FlatShardModule: this iteration ran the units in the order {pre} (post-forward "
                f"{post}), the first one in {self.pre_forward} (post-forward "
                f"{self.post_forward}); prefetching follows the first iteration's order, which "
                f"may no longer overlap anything. Every rank must still run the same order.")

    @staticmethod
    def _after(order: Optional[List[int]], unit: int) -> Optional[int]:
        if not order:
            return None
        try:
            i = order.index(unit)
        except ValueError:
            return None
        return order[i + 1] if i + 1 < len(order) else None

    def next_forward(self, unit: int) -> Optional[int]:
        return self._after(self.pre_forward, unit)

    def next_backward(self, unit: int) -> Optional[int]:
        if self.backward:
            return self._after(self.backward, unit)
        # Until a backward ran: the reverse post-forward order, as FSDP's.
        rev = list(reversed(self.post_forward)) if self.post_forward else None
        return self._after(rev, unit)


class _Prefetcher:
    """Started summons of the units that run next. ``summon(unit)`` returns a prefetched
    summon when there is one, else summons at once; ``start(unit)`` starts one."""

    def __init__(self, client: Any, name: str, path_of: Callable[[int], str],
                 forward: bool, backward: Optional[BackwardPrefetch],
                 compute_precision: bool = False) -> None:
        self._client = client
        # Mixed precision: the units come in their compute dtype, cast by the daemon.
        self._compute = {"compute_precision": True} if compute_precision else {}
        self._name = name
        self._path_of = path_of
        self.forward = bool(forward)
        self.backward = backward
        self.order = _ExecOrder()
        self._pending: Dict[int, Any] = {}  # unit -> PendingSummon
        # Read-only summons whose Ends ride on the next summon's RPC (end_first): one round
        # trip per unit transition.
        self._ending: List[Any] = []
        # Seconds this process waited for summons (started or not) and how many there were:
        # the communication prefetch did not hide.
        self.waited_s = 0.0
        self.summons = 0
        self.prefetched = 0

    def summon(self, unit: int) -> Any:
        t0 = time.perf_counter()
        try:
            pending = self._pending.pop(unit, None)
            if pending is not None:
                self.prefetched += 1
                return pending.wait()
            return self._client.summon(self._name, self._path_of(unit), recurse=False,
                                       writeback=False, end_first=self._take_ending(),
                                       **self._compute)
        finally:
            self.summons += 1
            self.waited_s += time.perf_counter() - t0

    def start(self, unit: Optional[int], busy: Callable[[int], bool]) -> None:
        """Starts `unit`'s summon unless it is None, already started, or `busy(unit)` (its
        summon is open); at most one at a time (bounded memory)."""
        if unit is None or unit in self._pending or self._pending or busy(unit):
            return
        self._pending[unit] = self._client.summon_async(self._name, self._path_of(unit),
                                                        recurse=False, writeback=False,
                                                        end_first=self._take_ending(),
                                                        **self._compute)

    def release(self, summon: Any) -> None:
        """Ends read-only `summon` with the next summon's RPC instead of an RPC of its own."""
        self._ending.append(summon)

    def _take_ending(self) -> List[Any]:
        out, self._ending = self._ending, []
        return out

    def flush(self) -> None:
        """Ends the summons `release` deferred (no summon follows)."""
        first: Optional[BaseException] = None
        for s in self._take_ending():
            try:
                s.end()
            except Exception as e:  # noqa: BLE001 - end every one, raise the first error
                first = first or e
        if first is not None:
            raise first

    def reset(self) -> None:
        """Forgets the recorded order: after a re-attach, every rank of the group (restarted
        ones too, which know no order) records it anew, so all prefetch alike."""
        self.cancel()
        self.order = _ExecOrder()

    def cancel(self) -> None:
        """Ends the deferred End and the summons started and not used (each waits for its
        collective first)."""
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - a read-only End changes nothing; the daemon ends
            pass           # it with the session at worst
        pending, self._pending = self._pending, {}
        for p in pending.values():
            try:
                p.wait().end()
            except Exception:  # noqa: BLE001 - unused; the step's own calls report errors
                pass
