"""What a failed storage call is to the caller: an I/O error of the medium is data loss
(never retried), a broken connection to an object store is transient, and both name the
episode and the key of the object that failed."""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import pytest
from botocore.exceptions import EndpointConnectionError
from zarr.storage import MemoryStore

from episerve_proto.errors import DataLossError, Unavailable
from episerve_server.plan.fetched_runs import storage_error
from episerve_server.storage.store import CountingStore


def test_an_io_error_of_the_medium_is_data_loss_naming_the_object() -> None:
    exc = OSError(errno.EIO, "Input/output error", "ep3.zarr/left.obs/c/1/0")
    err = storage_error(exc, "ep3", "left.obs")
    assert isinstance(err, DataLossError) and not err.transient
    assert (err.episode, err.key) == ("ep3", "left.obs")
    assert "'ep3.zarr/left.obs/c/1/0'" in str(err)


@pytest.mark.parametrize("exc", [OSError(errno.ECONNRESET, "reset"), TimeoutError("slow")])
def test_other_storage_failures_are_transient(exc: Exception) -> None:
    err = storage_error(exc, "ep3", "left.obs")  # type: ignore[arg-type]
    assert isinstance(err, Unavailable) and err.transient
    assert (err.episode, err.key) == ("ep3", "left.obs")


@pytest.mark.parametrize("timeout_s", [0.0, 5.0])
def test_a_broken_object_store_connection_is_unavailable_naming_the_key(
        timeout_s: float) -> None:
    store = CountingStore(MemoryStore(), timeout_s=timeout_s)

    async def reset() -> Any:
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1/bucket")

    with pytest.raises(Unavailable) as info:
        asyncio.run(store._timed("get", "ep1.zarr/obs/c/0/0", reset))
    assert (info.value.episode, info.value.key) == ("ep1", "obs")
    assert "connection to storage broke" in str(info.value)


def test_an_os_error_is_told_which_key_it_failed_on() -> None:
    store = CountingStore(MemoryStore())

    async def bad_sector() -> Any:
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OSError, match="Input/output error") as info:
        asyncio.run(store._timed("get", "ep1.zarr/obs/c/0/0", bad_sector))
    assert info.value.filename == "ep1.zarr/obs/c/0/0"
