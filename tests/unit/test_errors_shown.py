"""What a user reads when a call fails: the error's class as documented
(``episerve_client.errors.*``) and a traceback that ends at their own line, without the
frames of the client's machinery."""

from __future__ import annotations

import pickle
import traceback
from pathlib import Path

import pytest

from episerve_client import Client, WindowDataset, errors, keymap_from_delta_timestamps

HERE = Path(__file__).resolve()
ERRORS_PY = Path(errors.__file__).resolve()


def _frames(exc: BaseException) -> list[Path]:
    return [Path(f.filename).resolve() for f in traceback.extract_tb(exc.__traceback__)]


def _only_ours(exc: BaseException) -> None:
    """The traceback holds this test's frame and the one line that re-raises, nothing of
    the client below it."""
    frames = _frames(exc)
    assert frames[0] == HERE and set(frames[1:]) <= {ERRORS_PY}, frames
    assert len(frames) <= 2, frames


def test_a_typed_error_shows_as_episerve_client_errors_and_still_pickles() -> None:
    err = errors.Unavailable("gone", target="unix:///x")
    shown = traceback.format_exception_only(err)[-1]
    assert shown.startswith("episerve_client.errors.Unavailable: gone"), shown
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is errors.Unavailable and again.target == "unix:///x"


def test_a_client_call_that_fails_shows_only_the_callers_frame(tmp_path: Path) -> None:
    client = Client(f"unix://{tmp_path}/none.sock")
    with pytest.raises(errors.Unavailable) as failed:
        client.list_episodes()
    _only_ours(failed.value)
    assert "does not exist" in str(failed.value)
    client.close()


def test_a_dataset_with_a_bad_keymap_shows_only_the_callers_frame(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("k:\n  zarr_key: a\n  key_type: [unclosed\n")
    with pytest.raises(errors.KeymapError) as failed:
        WindowDataset(f"unix://{tmp_path}/none.sock", str(bad))
    _only_ours(failed.value)
    assert str(bad) in str(failed.value) and "line 4" in str(failed.value)


def test_a_keymap_helper_that_refuses_shows_only_the_callers_frame() -> None:
    with pytest.raises(errors.KeymapError) as failed:
        keymap_from_delta_timestamps({"action": [0.0, float("nan")]},
                                     {"action": ("a", "action_keys")})
    _only_ours(failed.value)
