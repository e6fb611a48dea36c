"""Every chunk reader, and the stores a daemon reads through, pass the one reader suite
(``tests/support/readers.py``): the sharded, keyed (v3 and v2) and fallback readers on a
local root, the same under ``FaultStore`` (faults off, except in the test that turns them
on) and under ``LatencyStore``, and the sharded, keyed and fallback readers on S3 (moto)."""

from __future__ import annotations

import atexit
import logging
from pathlib import Path
from typing import ClassVar

import pytest

from episerve_server.core.counters import Stats
from episerve_server.storage.latency import LatencyStore
from episerve_server.storage.readers import FallbackReader, KeyedReader, ShardedReader
from episerve_server.storage.store import METADATA_NAMES, CountingStore, open_root
from tests.support.faultstore import FaultStore
from tests.support.readers import FALLBACK, SPARSE, ReaderTests


class TestShardedReader(ReaderTests):
    layout = "sharded"
    reader_class = ShardedReader


class TestKeyedReader(ReaderTests):
    layout = "unsharded"
    reader_class = KeyedReader


class TestKeyedReaderV2(ReaderTests):
    layout = "v2"
    reader_class = KeyedReader


class TestFallbackReader(ReaderTests):
    layout = "fallback"
    reader_class = FallbackReader


class UnderFaultStore(ReaderTests):
    """The reader over ``FaultStore`` with no orders: every answer passes through as is."""

    def open_store(self, root: Path, stats: Stats) -> CountingStore:
        store = open_root(str(root), stats=stats)
        return store._with_store(FaultStore(store._store, str(root.parent / "no-faults.json")))


class TestShardedReaderUnderFaultStore(UnderFaultStore):
    layout = "sharded"
    reader_class = ShardedReader


class TestKeyedReaderUnderFaultStore(UnderFaultStore):
    layout = "unsharded"
    reader_class = KeyedReader


class TestShardedReaderUnderLatencyStore(ReaderTests):
    layout = "sharded"
    reader_class = ShardedReader

    def open_store(self, root: Path, stats: Stats) -> CountingStore:
        store = open_root(str(root), stats=stats)
        return store._with_store(LatencyStore(store._store, 0.001))


@pytest.mark.slow
class OnS3(ReaderTests):
    """The root uploaded to moto's S3 (one server for the module) and read through fsspec,
    as ``s3://`` roots are; each class has a bucket of its own."""

    #: One numeric array with an absent chunk, one vlen-bytes array, the fallback array.
    only = frozenset({SPARSE, "annotations", FALLBACK})
    server: ClassVar[S3Server]

    @classmethod
    def prepare(cls) -> None:
        cls.server = S3Server.shared()
        cls.server.upload(cls.bucket(), cls.root, arrays=cls.only)

    @classmethod
    def bucket(cls) -> str:
        return cls.__name__.lower()

    def open_store(self, root: Path, stats: Stats) -> CountingStore:
        del root  # always the class's bucket: a corrupt copy is published into it
        options = {"key": "testing", "secret": "testing",
                   "client_kwargs": {"endpoint_url": self.server.endpoint,
                                     "region_name": "us-east-1"}}
        return open_root(f"s3://{self.bucket()}/root", stats=stats, storage_options=options)

    def publish(self, copy: Path) -> Path:
        """Upload the objects in which the copy differs from the root over the root's."""
        self.server.upload(self.bucket(), copy, only_changed_from=self.root)
        return copy

    def unpublish(self, copy: Path) -> None:
        self.server.upload(self.bucket(), self.root, only_changed_from=copy)


class S3Server:
    """moto's S3 on loopback, started once for the test session's first S3 class."""

    _shared: ClassVar[S3Server | None] = None

    def __init__(self) -> None:
        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                   aws_access_key_id="testing",
                                   aws_secret_access_key="testing")
        atexit.register(self.server.stop)

    @classmethod
    def shared(cls) -> S3Server:
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def upload(self, bucket: str, root: Path, only_changed_from: Path | None = None,
               arrays: frozenset[str] | None = None) -> None:
        """``root``'s files as ``s3://<bucket>/root/...``: every metadata document, and the
        chunks of ``arrays`` (None: of all); with ``only_changed_from``, only the files whose
        bytes differ from that folder's."""
        if only_changed_from is None:
            self.client.create_bucket(Bucket=bucket)
        for path in sorted(root.rglob("*")):
            if not path.is_file():
                continue
            rel = path.relative_to(root)
            if arrays is not None and path.name not in METADATA_NAMES \
                    and rel.parts[1] not in arrays:
                continue
            data = path.read_bytes()
            if only_changed_from is not None and (only_changed_from / rel).read_bytes() == data:
                continue
            self.client.put_object(Bucket=bucket, Key=f"root/{rel.as_posix()}", Body=data)


class TestShardedReaderOnS3(OnS3):
    layout = "sharded"
    reader_class = ShardedReader


class TestKeyedReaderOnS3(OnS3):
    layout = "unsharded"
    reader_class = KeyedReader


class TestFallbackReaderOnS3(OnS3):
    layout = "fallback"
    reader_class = FallbackReader
