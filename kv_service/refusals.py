"""Why the index refuses a call, said once for every store.

A store finds the reason (the in-memory store in Python, the Redis store as the result code its Lua
script returns) and raises ``refuse(code, ...)``: the error type and the message a worker or an
operator acts on are chosen here, so the stores cannot drift apart in what they answer.
"""

from __future__ import annotations

from enum import Enum, auto

from kvmesh.contract.errors import FailedPrecondition, KVMeshError, NotFound


class Refusal(Enum):
    NOT_REGISTERED = auto()
    """The worker is unknown or its lease lapsed (a call it makes as a registered worker)."""
    NOT_REGISTERED_ADMIN = auto()
    """An admin call names a worker that is not registered."""
    NOT_LIVE_FOR_MODEL = auto()
    """A router reserves on a worker that is not a live worker of the model."""
    SPEC = auto()
    """The worker's block size or hash differs from its model's live workers'."""
    MODEL = auto()
    """The worker id is live for another model."""
    STALE_REGISTRATION = auto()
    """A registration with an epoch below the live one."""
    HEARTBEAT_EPOCH = auto()
    """A heartbeat for an epoch other than the registered one."""
    STALE_EPOCH = auto()
    """An event batch (or a snapshot) of an epoch below the live one."""
    SEQ_REGRESSION = auto()
    """An event batch (or a snapshot) whose seq is not after the last applied."""


def refuse(code: Refusal, worker_id: str, *, model_id: str = "", epoch: int = 0, live: object = "",
           seq: int = 0, snapshot: bool = False, spec: tuple[object, object] = ("", ""),
           registered: tuple[object, object] = ("", ""), other_model: str = "") -> KVMeshError:
    """The error for ``code``; ``live`` is the live epoch (or, for SEQ_REGRESSION, the last seq applied)."""
    w = f"worker {worker_id!r}"
    if code is Refusal.NOT_REGISTERED:
        return NotFound(f"{w} is not registered or its lease expired; register it again")
    if code is Refusal.NOT_REGISTERED_ADMIN:
        return NotFound(f"{w} is not registered")
    if code is Refusal.NOT_LIVE_FOR_MODEL:
        return NotFound(f"{w} is not a live worker of model {model_id!r}")
    if code is Refusal.SPEC:
        return FailedPrecondition(
            f"model {model_id!r} is served with block_size={spec[0]}, hash={spec[1]}; {w} registered "
            f"block_size={registered[0]}, hash={registered[1]}: start it with the same settings")
    if code is Refusal.MODEL:
        return FailedPrecondition(f"worker id {worker_id!r} is live for model {other_model!r}; "
                                  f"give the worker serving {model_id!r} another --worker-id")
    if code is Refusal.STALE_REGISTRATION:
        return FailedPrecondition(f"stale registration of {worker_id!r}: epoch {epoch} < live epoch {live}")
    if code is Refusal.HEARTBEAT_EPOCH:
        return FailedPrecondition(f"heartbeat for epoch {epoch} but {w} is registered with epoch {live}")
    if code is Refusal.STALE_EPOCH:
        what = "snapshot for dead epoch" if snapshot else "stale epoch"
        return FailedPrecondition(f"{what} {epoch} of {w}: the live epoch is {live}")
    assert code is Refusal.SEQ_REGRESSION
    what = "snapshot seq" if snapshot else "got"
    return FailedPrecondition(f"seq regression for {w}: {what} {seq}, last applied {live}")
