"""The keymap: what one sample is (docs/KEYMAP.md), parsed and validated from plain dicts.

Parsing is strict (docs/KEYMAP.md): an unknown field, a field that does not apply to the
entry's rule, or a value of the wrong type is a ``KeymapError`` naming the entry and the field.
Each entry is checked by :func:`episerve_proto.keyspec.checked_entry`, the code the client
runs before sending, so both sides say the same; the checks of the keymap as a whole (its
size, reserved output names) are the daemon's alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from episerve_proto.contract import (
    ACTION_KEYS,
    ACTION_MASK,
    ANNOTATION_KEYS,
    CAMERA_KEYS,
    CAMERA_MASK_SUFFIX,
    IS_PAD_SUFFIX,
    PROPRIO_MASK,
    TOTAL_FRAMES,
)
from episerve_proto.errors import KeymapError, LimitExceeded, shown
from episerve_proto.keyspec import EntryFields, checked_entry

#: Entries of one keymap (the daemon's ``--max-keymap-entries`` default).
MAX_ENTRIES = 256


class Rule(Enum):
    """Which window rule (docs/KEYMAP.md) an entry lands in (the first matching rule wins; rule 6,
    ``offsets_s``, is checked right after rule 1)."""

    ANNOTATION = 1
    HORIZON = 2
    HISTORY = 3
    LAG = 4
    FRAME = 5
    OFFSETS = 6


@dataclass(frozen=True, slots=True)
class KeySpec(EntryFields):
    """One keymap entry, validated (``keyspec.checked_entry`` makes it), with what the
    planner asks of it on every batch derived once. ``history_stride`` is 1 when not given."""

    rule: Rule = dataclasses.field(init=False, compare=False, repr=False)
    length: int = dataclasses.field(init=False, compare=False, repr=False)  # rows in the window
    # A windowed output: (W, *feature) per sample, with an ``_is_pad`` mask on request.
    time_axis: bool = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.history_stride is None:
            object.__setattr__(self, "history_stride", 1)
        rule = self._rule()
        object.__setattr__(self, "rule", rule)
        object.__setattr__(self, "length", self._length(rule))
        object.__setattr__(self, "time_axis",
                           rule in (Rule.HORIZON, Rule.HISTORY, Rule.OFFSETS))

    def _rule(self) -> Rule:
        if self.key_type == ANNOTATION_KEYS:
            return Rule.ANNOTATION
        if self.offsets_s is not None:
            return Rule.OFFSETS
        if self.horizon is not None:
            return Rule.HORIZON
        if self.history is not None and (self.history > 1 or self.key_type == CAMERA_KEYS):
            return Rule.HISTORY
        if self.lag_s is not None:
            return Rule.LAG
        return Rule.FRAME

    def _length(self, rule: Rule) -> int:
        if rule is Rule.HORIZON:
            return self.horizon or 1
        if rule is Rule.HISTORY:
            return self.history or 1
        if rule is Rule.OFFSETS:
            return len(self.offsets_s or ())
        return 1

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"zarr_key": self.zarr_key, "key_type": self.key_type}
        for name in ("horizon", "history", "history_stride_s", "lag_s"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.history_stride not in (None, 1):
            out["history_stride"] = self.history_stride
        if self.offsets_s is not None:
            out["offsets_s"] = list(self.offsets_s)
        return out


@dataclass(frozen=True, slots=True)
class Keymap:
    """A validated keymap. Entry order is the user's order; it only decides which entry
    provides ``action_pad_mask`` and ``proprio_history_mask`` (the first one in keymap order)."""

    entries: tuple[KeySpec, ...]
    # derived when made: the keys of windowed (not annotation) reads, and so on
    zarr_keys: frozenset[str] = dataclasses.field(init=False, compare=False, repr=False)
    annotation_keys: frozenset[str] = dataclasses.field(init=False, compare=False, repr=False)
    action_mask_entry: KeySpec | None = dataclasses.field(init=False, compare=False, repr=False)
    proprio_mask_entry: KeySpec | None = dataclasses.field(init=False, compare=False, repr=False)
    # A keymap is a dict key on every batch (the keymap plans): its hash is worked out once.
    _hash: int = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        entries = self.entries
        object.__setattr__(self, "_hash", hash(entries))
        object.__setattr__(self, "zarr_keys", frozenset(
            e.zarr_key for e in entries if e.rule is not Rule.ANNOTATION))
        object.__setattr__(self, "annotation_keys", frozenset(
            e.zarr_key for e in entries if e.rule is Rule.ANNOTATION))
        object.__setattr__(self, "action_mask_entry", next(
            (e for e in entries if e.key_type == ACTION_KEYS and e.rule is Rule.HORIZON),
            None))
        object.__setattr__(self, "proprio_mask_entry", next(
            (e for e in entries
             if e.key_type != CAMERA_KEYS and e.rule is Rule.HISTORY and (e.history or 0) > 1),
            None))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        # made again from its entries: a string's hash differs from process to process
        return (Keymap, (self.entries,))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not Keymap:
            return NotImplemented
        return self._hash == other._hash and self.entries == other.entries

    def __iter__(self) -> Iterator[KeySpec]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {e.name: e.as_dict() for e in self.entries}

    @classmethod
    def parse(cls, raw: Mapping[str, Any], *, max_entries: int = MAX_ENTRIES) -> Keymap:
        """Validate a keymap of at most ``max_entries`` entries; names are at most
        ``contract.MAX_NAME_CHARS`` characters."""
        if not isinstance(raw, Mapping) or not raw:
            raise KeymapError(f"a keymap is a non-empty mapping of output keys, got {shown(raw)}")
        if len(raw) > max_entries:
            raise LimitExceeded(
                f"keymap.entries: the keymap has {len(raw)} entries, over the limit of "
                f"{max_entries} (--max-keymap-entries)")
        entries = tuple(_parse_entry(name, spec) for name, spec in raw.items())
        reserved = _reserved_names(entries)
        for e in entries:
            if e.name in reserved:
                raise KeymapError(
                    f"output key {shown(e.name)} clashes with a reserved output name "
                    f"({reserved[e.name]}); rename the entry", key=e.zarr_key)
        return cls(entries)


def _reserved_names(entries: tuple[KeySpec, ...]) -> dict[str, str]:
    """Every name the daemon may add to a sample, and what adds it."""
    names = {n: "a sample field" for n in ("episode_hash", "embodiment", "fps", "frame_index")}
    names[TOTAL_FRAMES] = "a sample field with masks='all'"
    names[ACTION_MASK] = names[PROPRIO_MASK] = "a shared mask"
    for e in entries:
        if e.key_type == CAMERA_KEYS:
            names[e.name + CAMERA_MASK_SUFFIX] = f"the mask of camera output {e.name!r}"
        if e.time_axis:
            names[f"{e.name}{IS_PAD_SUFFIX}"] = f"the masks='all' mask of output {e.name!r}"
    return names


def _parse_entry(name: object, spec: object) -> KeySpec:
    return checked_entry(name, spec, KeySpec)
