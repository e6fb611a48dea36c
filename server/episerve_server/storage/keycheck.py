"""A keymap checked against every served episode (``RegisterKeymap`` with ``check_episodes``).

What building a dataset needs to know about each episode, so that the client does not fetch
every episode's arrays and features: whether it lacks one of the keymap's zarr keys (the
first missing one, in keymap order, as the client's own check named it), and, for each JPEG
zarr key of the keymap, the frame size the episode's ``features`` declare, grouped by size.
Broken episodes are not checked: the listing already names them with their reason.

This is the only check of a keymap against episodes: building a ``WindowDataset`` asks
for it through ``RegisterKeymap`` and refuses a daemon that does not make it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from episerve_proto.contract import did_you_mean
from episerve_server.core.keymap import Keymap, Rule
from episerve_server.storage.episode import Episode


@dataclass(frozen=True, slots=True)
class KeyProblem:
    episode: str
    reason: str
    key: str  # the zarr key the episode lacks


@dataclass(frozen=True, slots=True)
class KeymapCheck:
    episodes: int  # episodes checked
    problems: list[KeyProblem]  # in the order of the episodes given
    #: ``(zarr key, height, width)`` -> the episodes that declare that size, in order.
    frame_sizes: dict[tuple[str, int, int], list[str]]


def merged(parts: Sequence[KeymapCheck]) -> KeymapCheck:
    """One check from checks of consecutive slices of the episodes, in order."""
    sizes: dict[tuple[str, int, int], list[str]] = {}
    for part in parts:
        for size, hashes in part.frame_sizes.items():
            sizes.setdefault(size, []).extend(hashes)
    return KeymapCheck(sum(p.episodes for p in parts),
                       [q for p in parts for q in p.problems], sizes)


def check_keymap(keymap: Keymap, episodes: Sequence[Episode]) -> KeymapCheck:
    """Check ``keymap`` against each of ``episodes`` (the catalog's healthy ones)."""
    keys = [(e.name, e.zarr_key) for e in keymap]
    # Camera outputs are the entries whose array holds bytes (annotations are read apart).
    framed = list(dict.fromkeys(e.zarr_key for e in keymap if e.rule is not Rule.ANNOTATION))
    problems: list[KeyProblem] = []
    sizes: dict[tuple[str, int, int], list[str]] = {}
    for ep in episodes:
        readers = ep.readers
        missing = next(((n, k) for n, k in keys if k not in readers), None)
        if missing is not None:
            why = ep.why_not(missing[1])
            reason = f"output key {missing[0]!r}: {why}" if why else \
                missing_array_reason(*missing, readers)
            problems.append(KeyProblem(ep.hash, reason, missing[1]))
            continue
        features = ep.features
        for key in framed:
            if not readers[key].info.is_bytes:
                continue
            size = declared_frame_size(features, key)
            if size is not None:
                sizes.setdefault((key, *size), []).append(ep.hash)
    return KeymapCheck(len(episodes), problems, sizes)


def missing_array_reason(output_key: str, zarr_key: str, arrays: Iterable[str] = ()) -> str:
    """Why an episode cannot serve a keymap entry whose zarr key it lacks, with the nearest
    of the episode's ``arrays`` as a "did you mean"."""
    return (f"output key {output_key!r}: the episode has no array {zarr_key!r}"
            f"{did_you_mean(zarr_key, sorted(arrays))}")


def declared_frame_size(features: Mapping[str, Any], key: str) -> tuple[int, int] | None:
    """``(H, W)`` of a ``{dtype: jpeg, shape: [H, W, 3]}`` entry of an episode's ``features``;
    None when the key declares no shape of three positive ints. Reported per episode
    (``RegisterKeymapResponse.frame_sizes``); the client checks frames against it."""
    spec = features.get(key)
    shape = spec.get("shape") if isinstance(spec, Mapping) else None
    if not isinstance(shape, list | tuple) or len(shape) != 3:
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        return None
    return int(shape[0]), int(shape[1])
