"""Keymaps as users keep them: a YAML file's path, or the name of a keymap that comes with
the client (from any folder); a file that is not YAML, or not a mapping, is a
``KeymapError`` naming the file (and the line and column)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from episerve_client._base import bundled_keymaps, load_keymap
from episerve_client.errors import KeymapError

REPO = Path(__file__).resolve().parents[2]


def test_a_bundled_keymap_is_named_from_any_folder(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert set(bundled_keymaps()) >= {"mecka_keypoints_k4", "camera_history"}
    by_name = load_keymap("mecka_keypoints_k4")
    on_disk = yaml.safe_load(
        (REPO / "client/episerve_client/keymaps/mecka_keypoints_k4.yaml").read_text())
    assert dict(by_name) == on_disk


def test_an_unknown_name_lists_the_bundled_ones(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KeymapError) as info:
        load_keymap("mecka_keypoints_k5")
    text = str(info.value)
    assert "no keymap named 'mecka_keypoints_k5'" in text and "'mecka_keypoints_k4'" in text
    with pytest.raises(KeymapError, match=r"does not exist .*can be named instead"):
        load_keymap("keymaps/mine.yaml")


def test_malformed_yaml_names_the_file_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("obs:\n  zarr_key: left.obs_keypoints\n  key_type: [proprio_keys\n")
    with pytest.raises(KeymapError) as info:
        load_keymap(bad)
    text = str(info.value)
    assert repr(str(bad)) in text and "is not valid YAML, line 4, column 1" in text
    assert "<unicode string>" not in text


def test_a_file_that_is_not_a_mapping_names_the_file(tmp_path: Path) -> None:
    listed = tmp_path / "list.yaml"
    listed.write_text("- obs\n- act\n")
    with pytest.raises(KeymapError, match=r"holds list .*expected a non-empty mapping"):
        load_keymap(listed)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(KeymapError, match="holds NoneType None"):
        load_keymap(empty)
