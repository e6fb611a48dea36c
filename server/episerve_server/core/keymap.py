"""The keymap: what one sample is (SPEC section 2), parsed and validated from plain dicts."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from episerve_proto.contract import KEYMAP_FIELDS, MAX_NAME_CHARS
from episerve_proto.errors import KeymapError, LimitExceeded, shown

KEY_TYPES = ("camera_keys", "proprio_keys", "action_keys", "annotation_keys", "metadata_keys")
_FIELDS = frozenset(KEYMAP_FIELDS)
MAX_WINDOW = 4096
#: Entries of one keymap (the daemon's ``--max-keymap-entries`` default).
MAX_ENTRIES = 256


class Rule(Enum):
    """Which SPEC section 2 rule an entry lands in (the first matching rule wins)."""

    ANNOTATION = 1
    HORIZON = 2
    HISTORY = 3
    LAG = 4
    FRAME = 5


@dataclass(frozen=True, slots=True)
class KeySpec:
    """One keymap entry, validated."""

    name: str
    zarr_key: str
    key_type: str
    horizon: int | None = None
    history: int | None = None
    history_stride: int = 1
    history_stride_s: float | None = None
    lag_s: float | None = None

    @property
    def rule(self) -> Rule:
        if self.key_type == "annotation_keys":
            return Rule.ANNOTATION
        if self.horizon is not None:
            return Rule.HORIZON
        if self.history is not None and (self.history > 1 or self.key_type == "camera_keys"):
            return Rule.HISTORY
        if self.lag_s is not None:
            return Rule.LAG
        return Rule.FRAME

    @property
    def length(self) -> int:
        """Rows in the window (1 for a single frame)."""
        if self.rule is Rule.HORIZON:
            return self.horizon or 1
        if self.rule is Rule.HISTORY:
            return self.history or 1
        return 1

    @property
    def time_axis(self) -> bool:
        return self.rule in (Rule.HORIZON, Rule.HISTORY)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"zarr_key": self.zarr_key, "key_type": self.key_type}
        for field in ("horizon", "history", "history_stride_s", "lag_s"):
            if getattr(self, field) is not None:
                out[field] = getattr(self, field)
        if self.history_stride != 1:
            out["history_stride"] = self.history_stride
        return out


@dataclass(frozen=True, slots=True)
class Keymap:
    """A validated keymap. Entry order is the user's order; it only decides which entry
    provides ``action_pad_mask`` and ``proprio_history_mask`` (SPEC: "the first ...")."""

    entries: tuple[KeySpec, ...]

    def __iter__(self) -> Iterator[KeySpec]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def zarr_keys(self) -> frozenset[str]:
        return frozenset(e.zarr_key for e in self.entries if e.rule is not Rule.ANNOTATION)

    @property
    def action_mask_entry(self) -> KeySpec | None:
        return next(
            (e for e in self.entries if e.key_type == "action_keys" and e.rule is Rule.HORIZON),
            None,
        )

    @property
    def proprio_mask_entry(self) -> KeySpec | None:
        return next(
            (
                e
                for e in self.entries
                if e.key_type != "camera_keys" and e.rule is Rule.HISTORY and (e.history or 0) > 1
            ),
            None,
        )

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
        reserved = {"episode_hash", "embodiment", "fps", "frame_index"} | _mask_names(entries)
        for e in entries:
            if e.name in reserved:
                raise KeymapError(f"output key {shown(e.name)} clashes with a reserved output name")
        return cls(entries)


def _mask_names(entries: tuple[KeySpec, ...]) -> set[str]:
    names = {"action_pad_mask", "proprio_history_mask"}
    names |= {f"{e.name}_mask" for e in entries if e.key_type == "camera_keys"}
    return names


def _check_length(what: str, value: str, key: str = "") -> None:
    if len(value) > MAX_NAME_CHARS:
        raise KeymapError(
            f"{what} {shown(value)} is {len(value)} characters long, over the limit of "
            f"{MAX_NAME_CHARS}", key=key)


def _parse_entry(name: object, spec: object) -> KeySpec:
    if not isinstance(name, str) or not name:
        raise KeymapError(f"output keys are non-empty strings, got {shown(name)}")
    _check_length("output key (entry name)", name)
    if not isinstance(spec, Mapping):
        raise KeymapError(
            f"output key {shown(name)}: the spec must be a mapping, got {shown(spec)}")
    unknown = set(spec) - _FIELDS
    if unknown:
        raise KeymapError(
            f"output key {shown(name)}: unknown field(s) {shown(sorted(map(str, unknown)))}; "
            f"expected some of {sorted(_FIELDS)!r}"
        )
    zarr_key = spec.get("zarr_key")
    if isinstance(zarr_key, str):
        _check_length(f"output key {shown(name)}: zarr_key", zarr_key)
    if not isinstance(zarr_key, str) or not zarr_key or "/" in zarr_key or zarr_key in {".", ".."}:
        raise KeymapError(
            f"output key {shown(name)}: zarr_key must be an array name, got {shown(zarr_key)}")
    key_type = spec.get("key_type")
    if isinstance(key_type, str):
        _check_length(f"output key {shown(name)}: key_type", key_type, zarr_key)
    if key_type not in KEY_TYPES:
        raise KeymapError(
            f"output key {shown(name)}: key_type {shown(key_type)} is not one of {KEY_TYPES!r}",
            key=zarr_key)
    return KeySpec(
        name=name,
        zarr_key=zarr_key,
        key_type=key_type,
        horizon=_count(name, spec, "horizon", minimum=1),
        history=_count(name, spec, "history", minimum=1),
        history_stride=_count(name, spec, "history_stride", minimum=1) or 1,
        history_stride_s=_seconds(name, spec, "history_stride_s"),
        lag_s=_seconds(name, spec, "lag_s"),
    )


def _count(name: str, spec: Mapping[str, Any], field: str, *, minimum: int) -> int | None:
    value = spec.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise KeymapError(
            f"output key {shown(name)}: {field} must be an integer, got {shown(value)}")
    if not minimum <= value <= MAX_WINDOW:
        raise KeymapError(
            f"output key {shown(name)}: {field} must be in [{minimum}, {MAX_WINDOW}], got {value!r}"
        )
    return value


def _seconds(name: str, spec: Mapping[str, Any], field: str) -> float | None:
    value = spec.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KeymapError(
            f"output key {shown(name)}: {field} must be a number of seconds, got {shown(value)}"
        )
    if not math.isfinite(value) or not 0 < value <= 3600:
        raise KeymapError(
            f"output key {shown(name)}: {field} must be in (0, 3600] seconds "
            f"(omit it for none), got {value!r}"
        )
    return float(value)
