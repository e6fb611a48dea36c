"""The smoke set's picks out of parametrized suites that otherwise run in the slow tier."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest


def smoke_first(cases: Iterable[Any]) -> list[Any]:
    """``cases`` for ``parametrize``, the first of them also in the default run (``smoke``)."""
    first, *rest = cases
    values = first if isinstance(first, tuple) else (first,)
    return [pytest.param(*values, marks=pytest.mark.smoke), *rest]
