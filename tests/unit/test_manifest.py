import json

import pytest

from episerve_client.data.manifest import Manifest
from episerve_client.errors import InvalidArgument


def test_index_round_trip_and_digest(tmp_path) -> None:
    m = Manifest.of([("b", 3), ("a", 2)])
    assert m.hashes == ("a", "b")
    assert len(m) == 5
    assert [m.locate(g) for g in range(5)] == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2)]
    with pytest.raises(IndexError):
        m.locate(5)
    path = m.save(tmp_path / "m.json")
    again = Manifest.load(path)
    assert again == m and again.digest == m.digest
    assert Manifest.of([("a", 2), ("b", 4)]).digest != m.digest


def test_a_tampered_or_malformed_file_is_refused(tmp_path) -> None:
    raw = Manifest.of([("a", 2), ("b", 3)]).to_dict()
    raw["episodes"][0][1] = 9
    (tmp_path / "m.json").write_text(json.dumps(raw))
    with pytest.raises(InvalidArgument, match="digest"):
        Manifest.load(tmp_path / "m.json")
    with pytest.raises(InvalidArgument, match="twice"):
        Manifest((("a", 1), ("a", 1)))
    with pytest.raises(InvalidArgument, match="total_frames"):
        Manifest.of([("a", 0)])
    with pytest.raises(InvalidArgument, match="not an episerve manifest"):
        Manifest.from_dict({"episodes": []})


def test_subset_names_a_missing_episode() -> None:
    m = Manifest.of([("a", 2), ("b", 3), ("c", 1)])
    assert m.subset(["c", "a"]).hashes == ("a", "c")
    with pytest.raises(InvalidArgument, match="'z'"):
        m.subset(["z"])


def test_an_oversized_or_missing_file_is_refused(tmp_path, monkeypatch) -> None:
    from episerve_client.data import manifest as module

    path = Manifest.of([("a", 2)]).save(tmp_path / "m.json")
    monkeypatch.setattr(module, "MAX_MANIFEST_BYTES", 16)
    with pytest.raises(InvalidArgument, match=r"is \d+ bytes, more than the 16 a") as info:
        Manifest.load(path)
    assert "not JSON" not in str(info.value)
    with pytest.raises(InvalidArgument, match="cannot read"):
        Manifest.load(tmp_path / "nope.json")
