"""What the wrapper's parts share: its training state and the plain-tensor view."""
import enum

import torch


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
