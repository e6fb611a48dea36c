"""Hypothesis profiles for the test tiers, and example counts scaled by the loaded profile.

``dev`` (the default tier, ``make test``) runs a tenth of the examples; ``ci`` (the slow tier,
``make test-slow``) runs Hypothesis's own default of 100 and every decorator's count as it
is written. The profile comes from ``EPITEST_HYPOTHESIS`` (``dev`` when unset), or from
pytest's ``--hypothesis-profile`` option, which wins.
"""

from __future__ import annotations

import os

from hypothesis import settings

#: Hypothesis's own default: a ``ci`` run keeps every count as written.
CI_EXAMPLES = 100
PROFILES = {"dev": CI_EXAMPLES // 10, "ci": CI_EXAMPLES}
#: Not ``EPISERVE_*``: the daemons a test starts inherit its environment, and ``episerve
#: serve`` warns of every ``EPISERVE_`` variable that names no setting of its own.
ENV = "EPITEST_HYPOTHESIS"


def register() -> str:
    """Registers both profiles and loads the one ``EPITEST_HYPOTHESIS`` names."""
    for name, examples in PROFILES.items():
        settings.register_profile(name, max_examples=examples)
    name = os.environ.get(ENV, "dev")
    if name not in PROFILES:
        raise ValueError(f"{ENV}={name!r}: the profiles are {', '.join(PROFILES)}")
    settings.load_profile(name)
    return name


def scaled(examples: int) -> int:
    """``examples`` under ``ci``; the same share of it under the loaded profile (at least 5).

    For a decorator's ``max_examples``: a test that needs more (or fewer) than the profile's
    count keeps its ratio to the other tests whichever profile runs it.
    """
    share = settings.default.max_examples / CI_EXAMPLES
    return max(min(examples, 5), round(examples * share))
