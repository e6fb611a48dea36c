"""Which optional extra a missing module comes from, so a command can say what to install
instead of showing a ``ModuleNotFoundError`` traceback."""

from __future__ import annotations

#: Top-level modules of the optional dependencies, with the extras that install them.
MODULE_EXTRAS: dict[str, tuple[str, ...]] = {
    "uvloop": ("server",),
    "zarr": ("server", "synth"),
    "numcodecs": ("server", "synth"),
    "grpc_health": ("server",),
    "grpc_reflection": ("server",),
    "prometheus_client": ("server",),
    "pyarrow": ("server",),
    "av": ("server", "video"),
    "simplejpeg": ("synth", "client"),
    "torch": ("client",),
    "PIL": ("client",),
    "s3fs": ("s3",),
    "lightning": ("lightning",),
    "matplotlib": ("bench",),
}
#: The extras each ``episerve`` command needs, besides the base install.
COMMAND_EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("server",),
    "make-dataset": ("synth",),
    "demo": ("server", "synth", "client"),
    "loadtest": (),
    "stats": (),
    "check": ("server",),
}


def missing_extra(command: str, exc: ModuleNotFoundError) -> str | None:
    """One line naming the extra to install for ``exc``, or None when the missing module is
    not one of episerve's optional dependencies (a real bug, left to its traceback)."""
    module = (exc.name or "").split(".")[0]
    provides = MODULE_EXTRAS.get(module)
    if provides is None:
        return None
    needed = COMMAND_EXTRAS.get(command, ())
    extras = [e for e in needed if e in provides] or [provides[0]]
    if command == "demo":  # the demo runs everything: install all it needs at once
        extras = list(needed)
    spec = ",".join(extras)
    which = f"the {extras[0]!r} extra" if len(extras) == 1 else \
        f"the {', '.join(map(repr, extras))} extras"
    return (f"episerve {command}: the Python module {module!r} is not installed; this "
            f"command needs {which}: pip install 'episerve[{spec}]' (from a clone: "
            f"pip install -e '.[{spec}]')")
