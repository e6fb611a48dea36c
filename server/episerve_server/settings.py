"""A setting declared once, and everything derived from that declaration.

A setting is a field of a frozen dataclass whose default is ``setting(...)``: its name, its
type (``kind``), its default, its help, its bounds, its ``--help`` topic and whether an
environment variable sets it. From those fields alone come the flag (``--max-batch``), the
variable (``EPISERVE_MAX_BATCH``), the help line with its default, the conversion of text to a
value and the check of a value against its bounds. ``config.ServerConfig`` is the daemon's one
such dataclass; nothing here knows its settings.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

T = TypeVar("T")
#: How a setting's text is read, and what its bounds mean.
KINDS = ("text", "choice", "whole", "port", "seconds", "size", "list", "uids", "switch")
#: Who a budget or limit belongs to when the daemon runs several processes (``--workers``):
#: ``daemon``, the whole daemon's, split evenly among the processes that read; ``process``,
#: each process's own (what it bounds is in every process: all of it, or a copy); ``request``,
#: one request's, file's or item's, the same wherever it is checked.
SCOPES = {
    "daemon": "the whole daemon's, split evenly among --workers processes",
    "process": "each --workers process has its own",
    "request": "",
}
TRUE = frozenset({"1", "true", "yes", "on"})
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True, slots=True)
class Setting:
    """What a setting's field says besides its name and default.

    ``low``/``high`` bound a number (``above``: ``low`` itself is refused; ``off``: 0 is also
    taken, meaning off) and ``why`` is said after a bound it breaks. ``says`` follows the
    default in ``--help`` (what it means). ``if_empty``, when set, refuses an explicitly empty
    value with that reason ("not given" and "given empty" differ). ``scope`` (``SCOPES``):
    whose budget it is under ``--workers``; ``split`` divides a ``daemon`` one."""

    help: str
    topic: str
    kind: str
    low: float | None = None
    high: float | None = None
    above: bool = False
    off: bool = False
    why: str = ""
    choices: tuple[str, ...] = ()
    fold_case: bool = False
    says: str = ""
    if_empty: str | None = None
    env: bool = True
    hidden: bool = False
    positional: bool = False
    scope: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.scope and self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")
        if self.scope == "daemon" and self.kind not in ("whole", "size"):
            raise ValueError(f"a daemon-wide setting is split among processes: a whole "
                             f"number or a size, not {self.kind!r}")


@dataclass(frozen=True, slots=True)
class Declared:
    """One setting as found on its dataclass."""

    name: str
    default: Any
    spec: Setting

    @property
    def flag(self) -> str:
        if self.spec.positional:
            return self.name
        dashed = self.name.replace("_", "-")
        return f"--no-{dashed}" if self.spec.kind == "switch" else f"--{dashed}"

    def variable(self, prefix: str) -> str:
        return prefix + self.name.upper()


def setting(default: T, help: str, topic: str, *, kind: str = "", secret: bool = False,
            **spec: Any) -> T:
    """A dataclass field declaring a setting. ``kind`` defaults from the default's type (a
    bool is a switch, an int whole, a float seconds, a tuple a list, a str text)."""
    kind = kind or _kind_of(default)
    meta = {"setting": Setting(help=help, topic=topic, kind=kind, **spec)}
    return field(default=default, repr=not secret, metadata=meta)


def _kind_of(default: object) -> str:
    for cls, kind in ((bool, "switch"), (int, "whole"), (float, "seconds"), (tuple, "list")):
        if isinstance(default, cls):
            return kind
    return "text"


def declared(cls: type) -> Iterator[Declared]:
    """Every setting of a settings dataclass, in declaration order."""
    for f in fields(cls):
        spec = f.metadata.get("setting")
        if not isinstance(spec, Setting):
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting()")
        yield Declared(f.name, f.default, spec)


def parse_bytes(text: str | int) -> int:
    """``"512MiB"`` -> 536870912; plain integers are bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 1048576, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def shown(item: Declared) -> str:
    """A default as ``--help`` says it: sizes in the largest binary unit that divides,
    seconds without a needless ``.0``, an empty one as ``none``."""
    default, kind = item.default, item.spec.kind
    if kind == "switch":
        return "on" if default else "off"
    if default in ("", ()):
        return "none"
    if kind == "size" and default:
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if default % size == 0:
                return f"{default // size}{unit}"
    if kind == "seconds":
        return f"{default:g}"
    return str(default)


def values(cls: type, given: Mapping[str, Any], environ: Mapping[str, str],
           prefix: str) -> dict[str, Any]:
    """Each setting's value from ``given`` (parsed flags; None: not given), else from its
    variable; unset ones are left out. Every problem is one ``ValueError`` line."""
    out: dict[str, Any] = {}
    for item in declared(cls):
        raw, where = given.get(item.name), "--" + item.name.replace("_", "-")
        if raw is None and item.spec.env:
            raw, where = environ.get(item.variable(prefix)), item.variable(prefix)
        if raw is None:
            continue
        if item.spec.if_empty is not None:
            _refuse_empty(item, where, raw)
        out[item.name] = convert(item, raw)
    return out


def _refuse_empty(item: Declared, where: str, raw: Any) -> None:
    items = raw if isinstance(raw, list) else [raw]
    if item.spec.kind == "list" and isinstance(raw, str):
        items = raw.split(",")
    if not items or any(not str(one).strip() for one in items):
        raise ValueError(f"{where} was given an empty value ({raw!r}): {item.spec.if_empty}")


def convert(item: Declared, raw: Any) -> Any:
    """A flag's or variable's text as the setting's value."""
    kind = item.spec.kind
    try:
        if kind == "size":
            return parse_bytes(raw)
        if kind in ("list", "uids"):
            items = raw if isinstance(raw, list) else str(raw).split(",")
            return tuple(p.strip() for p in items if p.strip())
        if kind == "switch":
            return str(raw).lower() in TRUE
        if kind in ("whole", "port"):
            return int(raw)
        if kind == "seconds":
            return float(raw)
        return str(raw)
    except ValueError as exc:
        raise ValueError(f"bad value for {item.name}: {raw!r} ({exc})") from exc


def check(config: object) -> None:
    """Every setting of ``config`` within its declared bounds, else one ``ValueError``."""
    for item in declared(type(config)):
        why = problem(item, getattr(config, item.name))
        if why:
            raise ValueError(why)


def problem(item: Declared, value: Any) -> str | None:
    """What is wrong with ``value`` for this setting, or None."""
    name, spec, kind = item.name, item.spec, item.spec.kind
    if kind in ("whole", "port", "size"):
        return _whole(name, spec, value)
    if kind == "seconds":
        return _seconds(name, spec, value)
    if kind == "choice" and (value.upper() if spec.fold_case else value) not in spec.choices:
        return f"{name} must be one of {', '.join(spec.choices)}, got {value!r}"
    if kind == "uids":
        bad = [uid for uid in value if not uid.isdigit()]
        return f"{name} must be numeric uids, got {bad[0]!r}" if bad else None
    if kind == "list" and spec.if_empty is not None and any(not p.strip() for p in value):
        return f"{name} was given an empty value ({value!r}): {spec.if_empty}"
    return None


#: The largest count a setting takes when it declares no bound of its own: what a 32-bit
#: field (a gRPC argument, a local-plane frame's length) carries.
MAX_WHOLE = 2**31 - 1
#: The largest size: 1 PiB, so that products of sizes and counts stay within the 64 bits
#: the kernel's ``ssize_t`` and the local plane's frame fields carry.
MAX_SIZE = 2**50


def _whole(name: str, spec: Setting, value: Any) -> str | None:
    if spec.high is None and spec.kind != "port":  # every setting has an upper bound
        high = MAX_SIZE if spec.kind == "size" else MAX_WHOLE
        if isinstance(value, int) and not isinstance(value, bool) and value > high:
            why = "products with it stay within 64 bits" if spec.kind == "size" else \
                "a 32-bit field carries it"
            return f"{name} must be at most {high} ({why}), got {value!r}"
    low = 0 if spec.low is None else int(spec.low)
    noun = {"port": "a port number", "size": "a size"}.get(spec.kind, "an integer")
    unit = " bytes" if spec.kind == "size" else ""
    why = f" ({spec.why})" if spec.why else ""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{name} must be {noun} >= {low}{unit}, got {value!r}"
    if spec.high is not None and spec.kind != "size" and not low <= value <= spec.high:
        return f"{name} must be {noun} in {low}..{int(spec.high)}{why}, got {value!r}"
    if value < low:
        return f"{name} must be {noun} >= {low}{unit}, got {value!r}"
    if spec.high is not None and value > spec.high:
        return f"{name} must be at most {int(spec.high)}{why}, got {value!r}"
    return None


def _seconds(name: str, spec: Setting, value: Any) -> str | None:
    """A duration is finite and not negative; one in an interval (0, 1] says only that;
    one with only a ceiling (``high`` without ``low``) says that past it."""
    interval = spec.high is not None and not spec.off and spec.low is not None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or (not interval and (not math.isfinite(value) or value < 0)):
        return f"{name} must be a finite number of seconds >= 0, got {value!r}"
    low = 0.0 if spec.low is None else spec.low
    why = f" ({spec.why})" if spec.why else ""
    if spec.off:
        if value and not low <= value <= (math.inf if spec.high is None else spec.high):
            return (f"{name} must be 0 (off) or between {low:g} and {spec.high:g} seconds"
                    f"{why}, got {value!r}")
        return None
    fits = value > low if spec.above else value >= low
    if interval:
        if not (fits and value <= spec.high):
            opening = "(" if spec.above else "["
            return f"{name} must be in {opening}{low:g}, {spec.high:g}] seconds, got {value!r}"
    elif not fits:
        return f"{name} must be {'>' if spec.above else '>='} {low:g} seconds, got {value!r}"
    if spec.high is not None and value > spec.high:
        return f"{name} must be at most {spec.high:g} seconds{why}, got {value!r}"
    return None


def split(config: T, n: int) -> T:
    """``config`` as one of ``n`` processes sharing the daemon runs it: each ``daemon``-scoped
    setting divided by ``n`` (rounded down; never below its lower bound, so a share of a
    budget that is on stays on, and one that is off (0) stays off)."""
    if n <= 1:
        return config
    shares: dict[str, int] = {}
    for item in declared(type(config)):
        if item.spec.scope != "daemon":
            continue
        value = getattr(config, item.name)
        floor = 0 if not value or item.spec.low is None else int(item.spec.low)
        shares[item.name] = max(floor, value // n)
    return dataclasses.replace(config, **shares)  # type: ignore[type-var]
