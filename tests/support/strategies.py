"""Hypothesis strategies for keymap entries that the strict parser accepts (docs/KEYMAP.md):
one window rule per entry, with only the fields that apply to it."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

SECONDS = st.sampled_from([0.02, 1 / 30, 0.1, 0.25, 0.5, 1.0, 2.5])
#: Offsets around the frame: past, future, ties at common rates, far beyond both ends.
OFFSET = st.one_of(
    st.sampled_from([0.0, -1 / 30, 1 / 30, -0.1, 0.1, 0.05, -0.05, 1 / 60, -1 / 60, 0.5, -0.5,
                     2.5, -2.5, 20.0, -20.0]),
    st.floats(-12.0, 12.0, allow_nan=False))
OFFSETS = st.lists(OFFSET, min_size=1, max_size=12)


@st.composite
def window_fields(draw: st.DrawFn, key_type: str, *, horizons: Any = None,
                  histories: Any = None, strides: Any = None, seconds: Any = SECONDS,
                  offsets: Any = OFFSETS) -> dict[str, Any]:
    """The window fields of one valid entry of ``key_type`` (none for annotation_keys)."""
    horizons = st.integers(1, 100) if horizons is None else horizons
    histories = st.integers(1, 10) if histories is None else histories
    strides = st.integers(1, 10) if strides is None else strides
    if key_type == "annotation_keys":
        return {}
    rules = ["frame", "lag", "history", "offsets"]
    if key_type != "camera_keys":
        rules.append("horizon")
    rule = draw(st.sampled_from(rules))
    fields: dict[str, Any] = {}
    if rule == "horizon":
        fields["horizon"] = draw(horizons)
    elif rule == "offsets":
        fields["offsets_s"] = draw(offsets)
    elif rule == "history":
        fields["history"] = draw(histories)
        stride = draw(st.sampled_from(["none", "frames", "seconds"]))
        if stride == "frames":
            fields["history_stride"] = draw(strides)
        elif stride == "seconds":
            fields["history_stride_s"] = draw(seconds)
        if draw(st.booleans()):
            fields["lag_s"] = draw(seconds)
    elif rule == "lag":
        fields["lag_s"] = draw(seconds)
        if draw(st.integers(0, 3)) == 0:
            fields["history"] = 1
    elif draw(st.integers(0, 3)) == 0:
        fields["history"] = 1
    return fields
