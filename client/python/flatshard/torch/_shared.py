"""What the wrapper's parts share: its training state, the plain-tensor view and small
helpers of its hooks, and registration retried while the daemon says "register again"."""
import enum
import time
from typing import Any, List

import torch

from ..errors import UnavailableError


class TrainingState(enum.Enum):
    IDLE = "IDLE"
    FORWARD_BACKWARD = "FORWARD_BACKWARD"
    SUMMON_FULL_PARAMS = "SUMMON_FULL_PARAMS"


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a plain torch.Tensor. Read-only summons hand out ReadOnlyTensor,
    whose write guard costs a Python dispatch per op; the wrapper never writes its forward and
    backward buffers, so it computes on plain tensors."""
    if type(t) is torch.Tensor:
        return t
    with torch._C.DisableTorchFunction():
        return t.as_subclass(torch.Tensor)


# A grad_fn to probe the autograd engine with (never executed).
_PROBE = (torch.zeros(1, requires_grad=True) * 1).grad_fn


def _in_backward() -> bool:
    """Whether this thread runs an autograd backward now (torch raises outside one). Without
    the probe (another torch), assume it does: keeps the step instead of dropping it."""
    try:
        torch._C._will_engine_execute_node(_PROBE)
        return True
    except RuntimeError:
        return False
    except Exception:  # noqa: BLE001 - the private API changed
        return True


def _flatten(x: Any) -> List[Any]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [y for e in x for y in _flatten(e)]
    if isinstance(x, dict):
        return [y for e in x.values() for y in _flatten(e)]
    return []


def register_retrying(client: Any, name: str, manifest: str, policy: str, init: str,
                      timeout: float) -> Any:
    """``client.register``, again while the daemon refuses it with UNAVAILABLE "... register
    again": in a group over several daemons a re-formed group may still be rolling the module
    back to its committed generation when a restarted trainer registers. A refused register
    changed nothing (the daemon refuses before it attaches or allocates), so it is safe to
    repeat; after ``timeout`` seconds the last refusal is raised. Other errors at once."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        try:
            return client.register(name, manifest, policy, init=init)
        except UnavailableError as e:
            if "register again" not in str(e) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)  # a back-off between attempts (not a synchronisation)
        delay = min(2 * delay, 0.5)
