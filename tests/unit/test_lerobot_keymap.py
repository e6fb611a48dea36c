"""keymap_from_lerobot: the keymap of a LeRobot v3 root from its own info.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from episerve_client import keymap_from_lerobot
from episerve_client.errors import KeymapError
from tests.support import lerobot as lr


def test_the_keymap_follows_the_datasets_features(tmp_path: Path) -> None:
    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(3,)))
    km = keymap_from_lerobot(root, {"action": [0.0, 0.1], "observation.images.top": [-0.1, 0]})
    assert km["action"] == {"zarr_key": "action", "key_type": "action_keys",
                            "offsets_s": [0.0, 0.1]}
    assert km["observation.images.top"] == {"zarr_key": "observation.images.top",
                                            "key_type": "camera_keys", "offsets_s": [-0.1, 0.0]}
    assert km["observation.images.wrist"]["key_type"] == "camera_keys"
    assert km["observation.state"] == {"zarr_key": "observation.state",
                                       "key_type": "proprio_keys"}
    assert km["task"] == {"zarr_key": "task", "key_type": "annotation_keys"}
    # LeRobot's bookkeeping columns (timestamp, frame_index, ...) are left out: a keymap may
    # not name an output frame_index, and each sample carries its own
    assert set(km) == {"action", "observation.images.top", "observation.images.wrist",
                       "observation.state", "task"}
    assert set(keymap_from_lerobot(root, features=["action", "task"])) == {"action", "task"}


def test_unknown_names_and_unreadable_info_are_keymap_errors(tmp_path: Path) -> None:
    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(3,), cameras=()))
    with pytest.raises(KeymapError, match="did you mean 'action'"):
        keymap_from_lerobot(root, features=["actoin"])
    with pytest.raises(KeymapError, match=r"'observation\.images\.top'"):
        keymap_from_lerobot(root, {"observation.images.top": [0.0]})  # no such feature
    with pytest.raises(KeymapError, match="may not window 'task'"):
        keymap_from_lerobot(root, {"task": [0.0]})


def test_a_wrong_delta_timestamps_name_is_told_in_this_functions_own_terms(
        tmp_path: Path) -> None:
    root = lr.write(tmp_path / "ds", lr.Layout(lengths=(3,), cameras=()))
    with pytest.raises(KeymapError) as typo:
        keymap_from_lerobot(root, {"actoin": [0.0, 0.1]})
    message = str(typo.value)
    assert "delta_timestamps names 'actoin'" in message and "did you mean 'action'" in message
    assert "keys" not in message.replace("keys=", "")  # this function takes no keys argument
    with pytest.raises(KeymapError, match="features= leaves it out"):
        keymap_from_lerobot(root, {"action": [0.0]}, features=["task"])
    (root / "meta/info.json").write_text(json.dumps([1, 2]))
    with pytest.raises(KeymapError, match="must hold a JSON object"):
        keymap_from_lerobot(root)
    with pytest.raises(KeymapError, match="cannot read"):
        keymap_from_lerobot(tmp_path / "nowhere")
