"""The daemon's check of a keymap against an episode: the reasons and sizes it reports."""

from __future__ import annotations

from episerve_server.storage import keycheck


def test_a_declared_frame_size_is_three_positive_ints() -> None:
    size = keycheck.declared_frame_size
    assert size({"cam": {"dtype": "jpeg", "shape": [360, 640, 3]}}, "cam") == (360, 640)
    assert size({"cam": {"shape": (24, 32, 3)}}, "cam") == (24, 32)
    for bad in ([360, 640], [0, 640, 3], [True, 640, 3], [360.0, 640, 3], "360x640", None):
        assert size({"cam": {"shape": bad}}, "cam") is None, bad
    assert size({"cam": [360, 640, 3]}, "cam") is None and size({}, "cam") is None


def test_the_missing_array_reason_names_both_keys() -> None:
    assert keycheck.missing_array_reason("front", "images.front_1") == (
        "output key 'front': the episode has no array 'images.front_1'")
