"""Batches of the local plane as torch shared memory, for DataLoader workers.

In a worker, ``WindowDataset`` asks the daemon to give each batch's segment away
(``LocalChannel.call(adopt=...)``) and maps it as a torch shared-memory storage
(``adopt_segment``). The batch's tensors are views of that storage (``as_tensor``), so
when torch sends the batch to the main process it sends the storage's descriptor, not its
bytes: the tensor the training loop receives is the memory the daemon wrote, once.
"""

from __future__ import annotations

import numpy as np
import torch


def adopt_segment(fd: int, size: int) -> np.ndarray:
    """The segment behind ``fd`` as a torch storage (torch keeps its own descriptor),
    seen as a flat uint8 array whose base is the storage's tensor."""
    storage = torch.UntypedStorage._new_shared_fd_cpu(fd, size)  # type: ignore[attr-defined]
    flat: np.ndarray = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    return flat


def shared_empty(shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
    """An uninitialized array in torch shared memory (its base is the storage's tensor, so
    ``as_tensor`` gives a tensor of that storage): a tensor made from it crosses to the main
    process as a descriptor, as torch's own collate does in a worker."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None:  # a torch without it: plain memory, torch copies it as it would
        return np.empty(shape, dtype)
    flat = torch.empty(0, dtype=torch.uint8).set_(new_shared(max(nbytes, 1))).numpy()
    return flat[:nbytes].view(dtype).reshape(shape)


def as_tensor(v: np.ndarray) -> torch.Tensor:
    """``v`` as a tensor sharing its memory: a view of the segment's storage when ``v`` is a
    view of an adopted segment (so it travels between processes as a descriptor), else
    ``torch.from_numpy``."""
    seg = v.base
    if (isinstance(seg, np.ndarray) and isinstance(seg.base, torch.Tensor)
            and v.flags.c_contiguous and seg.dtype == np.uint8 and seg.ndim == 1):
        off = v.ctypes.data - seg.ctypes.data
        if off >= 0 and off + v.nbytes <= seg.nbytes:
            dtype = torch.from_numpy(np.empty(0, v.dtype)).dtype
            return seg.base[off:off + v.nbytes].view(dtype).view(v.shape)
    return torch.from_numpy(v)
