"""Whether the warm path's compiled loops are there to test."""

from __future__ import annotations

import os

import pytest


def need_kernel() -> None:
    """Skip, saying why, where the compiled loops are not built; fail instead with
    EPITEST_KERNEL=required (CI builds them)."""
    from episerve_server.core import kernel

    if not kernel.BUILT:
        why = "episerve_server.core._kernel is not built (no C compiler at install)"
        if os.environ.get("EPITEST_KERNEL") == "required":
            pytest.fail(why)
        pytest.skip(why)
