"""A settings dataclass as an ``argparse`` parser laid out for a reader: the flags grouped by
topic, in declaration order, each with its default and the variable it is also read from.

Everything comes from the declarations (``settings.declared``); the only thing listed here is
the topics themselves, in the order ``--help`` shows them.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from episerve_server.settings import SCOPES, Declared, declared, shown

USAGE = "episerve serve [ROOT] [--FLAG VALUE ...]"
#: Topic title and what it covers, in the order shown. A setting names its topic.
TOPICS: tuple[tuple[str, str], ...] = (
    ("listening", "where the daemon listens and how it treats connections"),
    ("data", "what is served and how storage is read"),
    ("cache", "memory kept to serve reads faster"),
    ("limits", "what one request, one file or all clients together may take"),
    ("security", "who may read"),
    ("observability", "logs, metrics and health"),
)


class _Parser(argparse.ArgumentParser):
    """Bad flags are one ``ValueError`` line, like every other refused setting."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"{message} (see {self.prog} --help)")


def parser(cls: type, *, prog: str, description: str, prefix: str) -> argparse.ArgumentParser:
    """The parser of every setting of ``cls``; a value not given parses as None."""
    p = _Parser(prog=prog, description=description, usage=USAGE, argument_default=None,
                epilog=f"Every flag can also be set in the environment as {prefix}<FLAG> "
                       f"(--cache-bytes as {prefix}CACHE_BYTES=4GiB); a flag given on the "
                       f"command line wins. An unknown {prefix}* variable is reported at "
                       "start-up.")
    groups = {title: p.add_argument_group(title, about) for title, about in TOPICS}
    for item in declared(cls):
        if item.spec.topic not in groups:
            raise ValueError(f"{cls.__name__}.{item.name}: topic must be one of "
                             f"{', '.join(groups)}, got {item.spec.topic!r}")
        groups[item.spec.topic].add_argument(item.flag, **_how(item, prefix))
    return p


def help_of(item: Declared, prefix: str) -> str:
    """The help line of a setting: its text, its default (and what that means), whose it is
    under ``--workers`` (a budget), its variable."""
    default = shown(item) + (f": {item.spec.says}" if item.spec.says else "")
    scope = SCOPES.get(item.spec.scope, "")
    whose = f"; {scope}" if scope else ""
    env = f" [{item.variable(prefix)}]" if item.spec.env else ""
    return f"{item.spec.help} (default {default}{whose}){env}"


def _how(item: Declared, prefix: str) -> dict[str, Any]:
    how: dict[str, Any] = {
        "help": argparse.SUPPRESS if item.spec.hidden else help_of(item, prefix)}
    kind = item.spec.kind
    if item.spec.positional:
        how["nargs"] = "?"
    else:
        how["dest"] = item.name
    if kind == "switch":
        how.update(action="store_const", const=not item.default)
    elif kind in ("list", "uids"):
        how["action"] = "append"
    elif kind in ("whole", "port"):
        how["type"] = int
    elif kind == "seconds":
        how["type"] = float
    return how
