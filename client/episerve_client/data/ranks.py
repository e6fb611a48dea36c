"""Every rank builds a dataset on rank 0's episode set (its manifest).

Each rank lists the daemon when it builds its dataset, and the daemon picks up new episodes
as they appear: listed separately, two ranks could disagree on ``len`` and on what global
index ``g`` means, and a ``DistributedSampler`` would then hand out overlapping and missing
samples without an error. So when a default process group is initialized, rank 0 lists and
chooses, and broadcasts its manifest; the other ranks build on it as if it were given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from episerve_client.data.manifest import Manifest
from episerve_client.errors import FailedPrecondition


def distributed() -> bool:
    """A default process group of more than one rank is initialized."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def rank() -> int:
    import torch.distributed as dist

    return int(dist.get_rank())


def from_rank0(choose: Callable[[], Manifest]) -> Manifest | None:
    """Rank 0 runs ``choose`` and every rank gets its manifest; on rank 0, None (it keeps
    what it chose). A failure on rank 0 is sent too, and raised on every rank, so no rank
    waits forever for a manifest that will not come.

    A collective: every rank must call it (build its datasets in the same order). With NCCL,
    ``broadcast_object_list`` moves the pickled manifest through the GPU of
    ``torch.cuda.current_device()``: call ``torch.cuda.set_device(local_rank)`` first.
    """
    import torch.distributed as dist

    payload: list[Any] = [None]
    failure: Exception | None = None
    if rank() == 0:
        try:
            payload = [("ok", choose().episodes)]
        except Exception as exc:  # sent on, so the other ranks fail instead of waiting
            failure = exc
            payload = [("error", f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(payload, src=0)
    if failure is not None:
        raise failure
    status, body = payload[0]
    if status != "ok":
        raise FailedPrecondition(f"rank 0 could not build the dataset, so no rank can: {body}")
    return None if rank() == 0 else Manifest(tuple((str(h), int(t)) for h, t in body))
