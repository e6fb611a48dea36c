"""The server's only contact with the generated protobuf classes: bytes in, bytes out."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError, Message

from episerve_proto.contract import WINDOW_FIELDS
from episerve_proto.errors import InvalidArgument
from episerve_proto.v1 import episerve_pb2 as pb
from episerve_server.core.keymap import Keymap
from episerve_server.storage.catalog import Episode


@dataclass(frozen=True, slots=True)
class ReadCall:
    keymap: Keymap | None
    keymap_id: str
    samples: list[tuple[str, int]]
    annotation_cutoff: bool
    max_response_bytes: int


def _parse(message: Message, data: bytes, what: str) -> Any:
    try:
        message.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise InvalidArgument(f"the {what} request is not a valid protobuf message ({exc})") \
            from exc
    return message


def parse_empty(data: bytes, what: str) -> None:
    _parse(pb.ListEpisodesRequest(), data, what)


def parse_register(data: bytes) -> Keymap:
    req = _parse(pb.RegisterKeymapRequest(), data, "RegisterKeymap")
    return keymap_from_pb(req.keymap)


def parse_read(data: bytes) -> ReadCall:
    req = _parse(pb.ReadRequest(), data, "Read")
    if len(req.episodes) != len(req.frames):
        raise InvalidArgument(
            f"episodes and frames must pair up: got {len(req.episodes)} episodes "
            f"and {len(req.frames)} frames"
        )
    ref = req.WhichOneof("keymap_ref")
    if ref is None:
        raise InvalidArgument("a Read needs a keymap or a keymap_id")
    return ReadCall(
        keymap=keymap_from_pb(req.keymap) if ref == "keymap" else None,
        keymap_id=req.keymap_id,
        samples=list(zip(req.episodes, req.frames)),
        annotation_cutoff=req.annotation_cutoff,
        max_response_bytes=max(0, req.max_response_bytes),
    )


def keymap_from_pb(msg: Any) -> Keymap:
    raw: dict[str, dict[str, Any]] = {}
    for entry in msg.entries:
        if entry.name in raw:
            raise InvalidArgument(f"output key {entry.name!r} appears twice in the keymap")
        spec: dict[str, Any] = {"zarr_key": entry.zarr_key, "key_type": entry.key_type}
        for name in WINDOW_FIELDS:
            if entry.HasField(name):
                spec[name] = getattr(entry, name)
        raw[entry.name] = spec
    return Keymap.parse(raw)


def keymap_id(keymap: Keymap) -> str:
    """A content hash: the same keymap has the same id on every daemon and after restarts."""
    canon = json.dumps([[e.name, e.as_dict()] for e in keymap], sort_keys=True)
    return "km-" + hashlib.sha256(canon.encode()).hexdigest()[:32]


def encode_keymap_id(kid: str) -> bytes:
    return pb.RegisterKeymapResponse(keymap_id=kid).SerializeToString()  # type: ignore[no-any-return]


def encode_listing(episodes: Iterable[Episode], broken: dict[str, str]) -> bytes:
    msg = pb.ListEpisodesResponse()
    for e in episodes:
        attrs = {k: v for k, v in e.attrs.items() if k != "features"}
        msg.episodes.add(
            hash=e.hash, total_frames=e.total_frames, fps=e.fps, embodiment=e.embodiment,
            features_json=json.dumps(e.features, default=str),
            attrs_json=json.dumps(attrs, default=str), arrays=sorted(e.readers),
        )
    for h, reason in broken.items():
        msg.broken.add(hash=h, reason=reason)
    return msg.SerializeToString()  # type: ignore[no-any-return]


def encode_stats(snapshot: dict[str, Any]) -> bytes:
    msg = pb.GetStatsResponse()
    for name, value in snapshot.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            msg.counters[name] = int(value)
    for ep, counters in snapshot.get("episodes", {}).items():
        msg.episodes[ep].chunks_fetched = counters["chunks_fetched"]
        msg.episodes[ep].read_rpcs = counters["read_rpcs"]
    return msg.SerializeToString()  # type: ignore[no-any-return]
