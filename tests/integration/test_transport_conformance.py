"""Every transport passes the one transport suite (``tests/support/transports.py``): gRPC
over TCP and over a unix socket, the local plane, a client routing through a two-worker
front, and the front answering a forwarded Read; each with the sync and the async client
(the local plane with the sync one only: the async client reads over gRPC)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from episerve_client import messages
from episerve_client.errors import from_rpc_error
from episerve_client.read_answer import read_result
from episerve_proto.contract import SERVICE_PATH
from episerve_tools.launch import DaemonProcess
from tests.support.transports import TransportTests

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def front(ramp_roots: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    sock = tmp_path_factory.mktemp("front") / "episerve.sock"
    d = DaemonProcess(ramp_roots["sharded"], "--rescan-s", "0", unix=sock, workers=2)
    yield d
    d.stop(timeout_s=30)


class TestGrpcOverTcp(TransportTests):
    @pytest.fixture
    def target(self, shared_daemons: dict[str, DaemonProcess]) -> str:
        return shared_daemons["tcp"].target


class TestGrpcOverUnix(TransportTests):
    @pytest.fixture
    def target(self, shared_daemons: dict[str, DaemonProcess]) -> str:
        return shared_daemons["unix"].target


class TestLocalPlane(TransportTests):
    TRANSPORT = "local"

    @pytest.fixture
    def target(self, shared_daemons: dict[str, DaemonProcess]) -> str:
        return shared_daemons["unix"].target


class TestRoutedThroughTheFront(TransportTests):
    @pytest.fixture
    def target(self, front: DaemonProcess) -> str:
        return front.target


class TestForwardedByTheFront(TransportTests):
    """One Read to the front's address, as grpcurl or an older client sends it."""

    @pytest.fixture
    def target(self, front: DaemonProcess) -> str:
        return front.target

    @pytest.fixture
    def client(self) -> None:
        return None  # no client: a bare channel per read

    def read(self, client: Any, target: str, keymap: dict[str, Any],
             samples: list[tuple[str, int]], cutoff: bool = False,
             all_masks: bool = False) -> Any:
        request = messages.read_request(samples, keymap=keymap, annotation_cutoff=cutoff,
                                       all_masks=all_masks)
        with grpc.insecure_channel(target) as ch:
            try:
                reply = ch.unary_unary(SERVICE_PATH + "Read")(request, timeout=30)
            except grpc.RpcError as exc:
                raise from_rpc_error(exc, target) from None
        return read_result(reply)
