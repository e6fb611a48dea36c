import hashlib
import json
from typing import Any

import pytest

from episerve_client.data.manifest import FORMAT, Manifest, nesting
from episerve_client.errors import InvalidArgument
from episerve_proto.contract import MAX_EPISODE_FRAMES, MAX_MANIFEST_FRAMES


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


def _file(tmp_path, text: str):
    path = tmp_path / "m.json"
    path.write_text(text)
    return path


def _saved(tmp_path, entries: list[list[Any]]):
    """A manifest file with ``entries`` and the digest they would have (so only the bound
    under test can refuse it)."""
    body = json.dumps(entries, separators=(",", ":"))
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    return _file(tmp_path, json.dumps({"format": FORMAT, "digest": digest, "episodes": entries}))


@pytest.mark.parametrize(("total", "needle"), [
    (2**63, str(2**63)), (10**12, str(10**12)), (MAX_EPISODE_FRAMES + 1, "total_frames")])
def test_total_frames_over_the_bound_is_refused_naming_episode_and_value(
        tmp_path, total: int, needle: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        Manifest.load(_saved(tmp_path, [["ep", total]]))
    assert needle in str(info.value) and "'ep'" in str(info.value)
    assert "total_frames" in str(info.value) and info.value.episode == "ep"
    with pytest.raises(InvalidArgument, match="total_frames"):
        Manifest.of([("ep", total)])


def test_lengths_that_would_overflow_int64_are_refused_not_wrapped(tmp_path) -> None:
    # Before: accepted, with a negative len and locate(0) past the end.
    entries = [["a", 2**62], ["b", 2**62], ["c", 2**62]]
    with pytest.raises(InvalidArgument, match=r"'a'.*total_frames"):
        Manifest.load(_saved(tmp_path, entries))
    many = [[f"e{k:05d}", MAX_EPISODE_FRAMES] for k in range(11)]
    with pytest.raises(InvalidArgument) as info:
        Manifest.load(_saved(tmp_path, many))
    assert str(MAX_MANIFEST_FRAMES) in str(info.value) and info.value.episode == "e00010"
    at_bound = Manifest.of((f"e{k:05d}", MAX_EPISODE_FRAMES) for k in range(10))
    assert len(at_bound) == MAX_MANIFEST_FRAMES
    assert at_bound.locate(len(at_bound) - 1) == ("e00009", MAX_EPISODE_FRAMES - 1)


def test_deeply_nested_json_is_refused_before_parsing(tmp_path) -> None:
    depth = 200_000
    with pytest.raises(InvalidArgument) as info:
        Manifest.load(_file(tmp_path, "[" * depth + "]" * depth))
    assert f"{depth} levels" in str(info.value)
    # brackets inside strings do not count
    assert nesting('{"a": "[[[[[[[[[[[[", "b": [[1]], "c": "\\"]]]]"}') == 3


def test_a_manifest_without_its_digest_or_with_a_wrong_one_does_not_load(tmp_path) -> None:
    raw = Manifest.of([("a", 2), ("b", 3)]).to_dict()
    del raw["digest"]
    with pytest.raises(InvalidArgument, match=r"'digest'.*None"):
        Manifest.load(_file(tmp_path, json.dumps(raw)))
    for bad in ("", "0123", 12, "zzzzzzzzzzzzzzzz"):
        raw["digest"] = bad
        with pytest.raises(InvalidArgument, match="'digest'"):
            Manifest.from_dict(raw)
    raw["digest"] = "0" * 16
    with pytest.raises(InvalidArgument, match="does not match"):
        Manifest.from_dict(raw)


@pytest.mark.parametrize("entry", [["", 3], ["x" * 300, 3], ["a", 1.5], ["a", True],
                                   ["a", "3"], ["a"], "a"])
def test_malformed_entries_are_refused_naming_the_value(tmp_path, entry: Any) -> None:
    with pytest.raises(InvalidArgument):
        Manifest.load(_saved(tmp_path, [entry]))
