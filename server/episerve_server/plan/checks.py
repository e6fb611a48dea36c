"""What a batch is checked against before anything is built: an episode's arrays against
the keymap, the answer's size, and the byte budget charged as frames arrive."""

from __future__ import annotations

import math

from episerve_proto.errors import BrokenEpisodeError, KeymapError
from episerve_server.core.keymap import Keymap, KeySpec, Rule
from episerve_server.plan.assemble import Batch
from episerve_server.plan.options import too_big
from episerve_server.storage.episode import Episode


def check_keys(keymap: Keymap, episode: Episode) -> None:
    for e in keymap:
        reader = episode.readers.get(e.zarr_key)
        why = episode.why_not(e.zarr_key) if reader is None else None
        if why is not None:  # the data is broken, not the keymap
            raise BrokenEpisodeError(
                f"output key {e.name!r}: episode {episode.hash!r} cannot serve zarr_key "
                f"{e.zarr_key!r}: {why}",
                episode=episode.hash, key=e.zarr_key,
            )
        if reader is None:
            why = "it has no such array"
            raise KeymapError(
                f"output key {e.name!r}: episode {episode.hash!r} cannot serve zarr_key "
                f"{e.zarr_key!r} ({why})", episode=episode.hash, key=e.zarr_key,
            )
        if e.rule is Rule.ANNOTATION and not reader.info.is_bytes:
            raise KeymapError(
                f"output key {e.name!r}: annotation_keys needs an array of JSON annotations, "
                f"but {e.zarr_key!r} in episode {episode.hash!r} holds numbers",
                episode=episode.hash, key=e.zarr_key,
            )


def output_bytes(keymap: Keymap, batch: Batch, all_masks: bool = False) -> int:
    """Bytes of the numeric outputs and frame indexes (and with ``all_masks``, of the
    ``_is_pad`` masks and total_frames), known before any window is built."""
    total = 8 * len(batch.ep) if all_masks else 0
    for e in keymap:
        if e.rule is Rule.ANNOTATION:
            continue
        info = batch.episodes[0].readers[e.zarr_key].info
        total += len(batch.ep) * entry_bytes(e, row_bytes(tuple(info.feature), info.is_bytes),
                                             all_masks)
    return total


def row_bytes(feature: tuple[int, ...], is_bytes: bool) -> int:
    """One output row's bytes: a float32 feature, or a frame's int32 index."""
    return 4 if is_bytes else 4 * math.prod(feature)


def entry_bytes(e: KeySpec, per_row: int, all_masks: bool) -> int:
    """One sample's bytes of entry ``e`` (rows of ``per_row`` bytes; with ``all_masks``, a
    byte per windowed row for its ``_is_pad`` mask)."""
    return e.length * (per_row + (1 if all_masks and e.time_axis else 0))


class Budget:
    """The response byte limit, charged with the numeric outputs (known before fetching)
    and then with each frame's bytes as they arrive, so a batch of huge frames is refused
    early instead of after everything was loaded."""

    def __init__(self, limit: int, numeric_bytes: int, batch: int) -> None:
        self.limit, self.used, self.batch = limit, numeric_bytes, batch

    def add(self, nbytes: int) -> None:
        self.used += nbytes
        if self.limit and self.used > self.limit:
            raise too_big(self.used, self.limit, self.batch, at_least=True)
