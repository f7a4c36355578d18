"""flatshard's exceptions: one class per gRPC code family, all FlatshardError.

Every error of the C++ client library (an ``absl::Status``) arrives as the class of its code,
with ``.code`` the gRPC code name (``"DEADLINE_EXCEEDED"``) and ``.message`` the daemon's (or
the client library's) message, unchanged.
"""

from __future__ import annotations

__all__ = [
    "FlatshardError",
    "InvalidArgumentError",
    "NotFoundError",
    "AlreadyExistsError",
    "PermissionDeniedError",
    "FailedPreconditionError",
    "AbortedError",
    "UnavailableError",
    "DeadlineExceededError",
    "ResourceExhaustedError",
    "InternalError",
    "ShardsLostError",
    "ReadOnlyViewError",
]


class FlatshardError(Exception):
    """A failed flatshard call. ``code``: the gRPC code name; ``message``: unchanged."""

    code: str = "UNKNOWN"
    message: str

    def __init__(self, message: str, code: str | None = None) -> None:
        if code is not None:
            self.code = code
        self.message = message
        super().__init__(f"{self.code}: {message}")

    def __reduce__(self):  # picklable (e.g. across multiprocessing)
        return (_from_status, (self.code, self.message))


class InvalidArgumentError(FlatshardError):
    code = "INVALID_ARGUMENT"


class NotFoundError(FlatshardError):
    code = "NOT_FOUND"


class AlreadyExistsError(FlatshardError):
    code = "ALREADY_EXISTS"


class PermissionDeniedError(FlatshardError):
    code = "PERMISSION_DENIED"


class FailedPreconditionError(FlatshardError):
    code = "FAILED_PRECONDITION"


class AbortedError(FlatshardError):
    code = "ABORTED"


class UnavailableError(FlatshardError):
    code = "UNAVAILABLE"


class DeadlineExceededError(FlatshardError):
    code = "DEADLINE_EXCEEDED"


class ResourceExhaustedError(FlatshardError):
    code = "RESOURCE_EXHAUSTED"


class InternalError(FlatshardError):
    code = "INTERNAL"


class ShardsLostError(FailedPreconditionError):
    """Raised by flatshard.torch (never by the C++ client): a trainer that expected to
    re-attach to a registered module (``FlatShardModule.reattach()``, or the constructor's
    ``require_reattach=True``) found that the group no longer has it, e.g. the daemon
    restarted without ``--state_dir``. Registering again would silently start over from the
    module's initial values at generation 0."""


class ReadOnlyViewError(RuntimeError):
    """A write through a tensor of a read-only (writeback=False) summon (not a daemon error:
    raised before anything is written)."""


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        FailedPreconditionError,
        AbortedError,
        UnavailableError,
        DeadlineExceededError,
        ResourceExhaustedError,
        InternalError,
    )
}


def _from_status(code: str, message: str) -> FlatshardError:
    """The exception for a gRPC code name and message (others: FlatshardError with that code)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return FlatshardError(message, code=code)
    return cls(message)
