"""Bounds at open: absurd lengths, shapes and chunk sizes, non-finite numbers and deep JSON
make an episode broken (or one array a problem) with a reason naming the key and the value,
never an overflow, a recursion error or a wrong row later; annotations are parsed bounded."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from episerve_proto.errors import BrokenEpisodeError, DataLossError
from episerve_server.core.spans import MAX_SPANS
from tests.support import crafted, ramp

KP = "left.obs_keypoints"
READ = {
    "k": {"zarr_key": KP, "key_type": "action_keys", "horizon": 4},
    "h": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys", "history": 3},
}
HEAD = {"h": {"zarr_key": "obs_head_pose", "key_type": "proprio_keys"}}
TEXT = {"t": {"zarr_key": "annotations", "key_type": "annotation_keys"}}


def _shape(shape: list[int], chunks: list[int]) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["shape"] = shape
        doc["chunk_grid"]["configuration"]["chunk_shape"] = chunks
        doc.pop("dimension_names", None)

    return edit


# episode -> (what to do to it, what its reason must name)
BROKEN_AT_OPEN: dict[str, tuple[Callable[[Path, str], None], tuple[str, ...]]] = {
    "frames2p40": (lambda r, h: crafted.edit_attrs(r, h, lambda a: a.update(
        total_frames=2**40)), ("'total_frames'", str(2**40))),
    "frames2p31": (lambda r, h: crafted.edit_attrs(r, h, lambda a: a.update(
        total_frames=2**31)), ("'total_frames'", str(2**31))),
    "fpsinf": (lambda r, h: crafted.edit_attrs(r, h, lambda a: a.update(fps=float("inf"))),
               ("'fps'", "inf")),
    "fpsnan": (lambda r, h: crafted.edit_attrs(r, h, lambda a: a.update(fps=float("nan"))),
               ("'fps'", "nan")),
    "deepgroup": (lambda r, h: (r / f"{h}.zarr" / "zarr.json").write_text(
        '{"zarr_format": 3, "node_type": "group", "attributes": {"x": '
        + crafted.deep_json(100_000) + "}}"), ("RecursionError",)),
}
# episode -> (edit of left.obs_keypoints' zarr.json, what the key's problem must name)
ARRAY_PROBLEMS: dict[str, tuple[Callable[[dict[str, Any]], None], tuple[str, ...]]] = {
    "rows2p40": (_shape([2**40, 63], [100, 63]), (str(2**40), "rows")),
    "rows10p30": (_shape([10**30, 63], [100, 63]), ("rows",)),
    "chunk2p31": (_shape([300, 63], [2**31, 63]), (str(2**31),)),
    "chunkzero": (_shape([300, 63], [0, 63]), ("chunk",)),
    "ndim9": (_shape([300, 63, 1, 1, 1, 1, 1, 1, 1], [100, 63, 1, 1, 1, 1, 1, 1, 1]),
              ("9 dimensions",)),
    "feature2p25": (_shape([300, 2**13, 2**12], [1, 2**13, 2**12]),
                    (str(2**25), "values per row")),
    "negative": (_shape([-300, 63], [100, 63]), ("-300",)),
    "deeparray": (lambda d: d.update(attributes={"x": json.loads(crafted.deep_json(500))}),
                  ()),
}


def _deep_array(root: Path, h: str) -> None:
    (root / f"{h}.zarr" / KP / "zarr.json").write_text(
        '{"zarr_format": 3, "node_type": "array", "shape": ' + crafted.deep_json(100_000) + "}")


@pytest.fixture(scope="module")
def bounds_served(tmp_path_factory: pytest.TempPathFactory, serve: Callable[..., Any]) -> Any:
    root = tmp_path_factory.mktemp("bounds")
    ramp.write_ramp_episode(root, "a", episode_no=0, total_frames=120, layout="unsharded")
    ramp.write_ramp_episode(root, "b", episode_no=1, total_frames=150, layout="unsharded")
    for n, (h, (make, _)) in enumerate(BROKEN_AT_OPEN.items()):
        ramp.write_ramp_episode(root, h, episode_no=n + 2, total_frames=30, layout="unsharded")
        make(root, h)
    for n, (h, (edit, _)) in enumerate(ARRAY_PROBLEMS.items()):
        ramp.write_ramp_episode(root, h, episode_no=n, total_frames=120, layout="unsharded")
        crafted.edit_array(root, h, KP, edit)
    ramp.write_ramp_episode(root, "deeparrayjson", episode_no=3, total_frames=120,
                            layout="unsharded")
    _deep_array(root, "deeparrayjson")
    return serve(root, 1 << 20)


@pytest.mark.parametrize("episode", sorted(BROKEN_AT_OPEN))
def test_absurd_episode_metadata_is_broken_with_a_reason(episode: str,
                                                         bounds_served: Any) -> None:
    reason = bounds_served.catalog.broken[episode]
    for needle in BROKEN_AT_OPEN[episode][1]:
        assert needle in reason, reason
    assert len(reason) < 2000


@pytest.mark.parametrize("episode", [*sorted(ARRAY_PROBLEMS), "deeparrayjson"])
def test_absurd_array_metadata_is_a_problem_of_that_key(episode: str,
                                                        bounds_served: Any) -> None:
    served = bounds_served
    if episode == "deeparray":  # deep, but parseable attributes: the array is fine
        assert served.catalog.broken_listing().get(episode) is None
        return
    reason = served.catalog.broken_listing()[episode]
    assert f"{KP!r}" in reason, reason
    needles = ARRAY_PROBLEMS[episode][1] if episode in ARRAY_PROBLEMS else ("RecursionError",)
    for needle in needles:
        assert needle in reason, reason
    assert len(reason) < 2000
    with pytest.raises(BrokenEpisodeError) as info:
        served.read(READ, [("a", 3), (episode, 3)])
    assert (info.value.episode, info.value.key) == (episode, KP)
    no = list(ARRAY_PROBLEMS).index(episode) if episode in ARRAY_PROBLEMS else 3
    head = served.read(HEAD, [(episode, 7), ("b", 7)]).arrays["h"]
    assert np.array_equal(head, np.stack([ramp.ramp_row(no, "obs_head_pose", 7),
                                          ramp.ramp_row(1, "obs_head_pose", 7)]))


def test_neighbours_of_broken_episodes_read_the_right_rows(bounds_served: Any,
                                                           matches_oracle: Any) -> None:
    samples = [("a", 0), ("b", 149), ("a", 119), ("b", 60), ("a", 60)]
    result = bounds_served.read(READ, samples)
    for n, (h, i) in enumerate(samples):
        no, total = (0, 120) if h == "a" else (1, 150)
        rows = [min(i + k, total - 1) for k in range(4)]
        assert np.array_equal(result.arrays["k"][n], np.stack([ramp.ramp_row(no, KP, r)
                                                               for r in rows]))
    matches_oracle(bounds_served, result, READ, samples)
    healthy = {e.hash for e in bounds_served.catalog.healthy()}
    assert healthy == {"a", "b", "deeparray"}


# -- annotations -----------------------------------------------------------------------------

def _set_annotations(root: Path, h: str, items: list[bytes], chunk: int = 1) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        group = zarr.open_group(root / f"{h}.zarr", mode="a")
        del group["annotations"]
        array = group.create_array("annotations", shape=(len(items),), chunks=(chunk,),
                                   dtype=zarr.dtype.VariableLengthBytes(), compressors=None)
        data = np.empty(len(items), dtype=object)
        data[:] = items
        array[...] = data


def _span(text: str, start: Any, end: Any) -> bytes:
    return json.dumps({"text": text, "start_idx": start, "end_idx": end}).encode()


ANNOTATIONS: dict[str, tuple[list[bytes], int, str]] = {
    "deep": ([_span("ok", 0, 5), crafted.deep_json(100_000).encode()], 1,
             "element 1 is JSON nested too deeply"),
    "deepobject": ([b'{"text": ' + crafted.deep_json(100_000).encode() + b"}"], 1,
                   "element 0 is JSON nested too deeply"),
    "list": ([_span("ok", 0, 5), _span("ok", 1, 5), b"[1, 2]"], 1,
             "element 2 is not an annotation"),
    "infinite": ([b'{"text": "x", "start_idx": 0, "end_idx": 1e400}'], 1,
                 "element 0 is not an annotation"),
    "toomany": ([b""] * (MAX_SPANS + 1), MAX_SPANS + 1, f"more than {MAX_SPANS}"),
}


@pytest.fixture(scope="module")
def annotated(tmp_path_factory: pytest.TempPathFactory, serve: Callable[..., Any]) -> Any:
    root = tmp_path_factory.mktemp("annotations")
    ramp.write_ramp_episode(root, "good", episode_no=0, total_frames=40)
    ramp.write_ramp_episode(root, "huge", episode_no=1, total_frames=40)
    _set_annotations(root, "huge", [_span("far", 3, 10**30), _span("neg", -(10**30), 9)])
    for n, (h, (items, chunk, _)) in enumerate(ANNOTATIONS.items()):
        ramp.write_ramp_episode(root, h, episode_no=n + 2, total_frames=40)
        _set_annotations(root, h, items, chunk)
    return serve(root, 0)


@pytest.mark.parametrize("episode", sorted(ANNOTATIONS))
def test_hostile_annotations_are_data_loss(episode: str, annotated: Any) -> None:
    for cutoff in (False, True):
        with pytest.raises(DataLossError) as info:
            if cutoff:
                annotated.read(READ, [("good", 1), (episode, 1)], cutoff=True)
            else:
                annotated.read(TEXT, [("good", 1), (episode, 1)])
        assert (info.value.episode, info.value.key) == (episode, "annotations")
        message = str(info.value)
        assert f"{episode!r}" in message and "'annotations'" in message
        assert ANNOTATIONS[episode][2] in message, message
        assert len(message) < 2000
    assert annotated.read(TEXT, [("good", 30)]).texts["t"] == [["whole", "place"]]


def test_huge_span_bounds_are_clamped_not_overflowed(annotated: Any) -> None:
    result = annotated.read(TEXT, [("huge", 2), ("huge", 5), ("good", 30)])
    assert result.texts["t"] == [[], ["far"], ["whole", "place"]]
    chunk = annotated.read(READ, [("huge", 5), ("huge", 38)], cutoff=True).arrays["k"]
    assert np.array_equal(chunk[1], np.stack([ramp.ramp_row(1, KP, r) for r in (38, 39, 39, 39)]))
    assert np.array_equal(chunk[0], np.stack([ramp.ramp_row(1, KP, r) for r in (5, 6, 7, 8)]))


def test_a_variable_length_chunk_of_two_billion_elements_is_a_problem_of_its_key(
        tmp_path: Path) -> None:
    """Its fill chunk would be a list of 2^31 items (16 GB) at the first read: refused at
    open, naming the key and the count (before: MemoryError, outside the typed errors)."""
    import asyncio

    from episerve_server.core.counters import Stats
    from episerve_server.storage.catalog import Catalog
    from episerve_server.storage.store import open_root

    ramp.write_ramp_episode(tmp_path, "v", episode_no=0, total_frames=30, layout="unsharded")

    def edit(doc: dict[str, Any]) -> None:
        doc["chunk_grid"]["configuration"]["chunk_shape"] = [2**31]

    crafted.edit_array(tmp_path, "v", "annotations", edit)
    catalog = Catalog(open_root(str(tmp_path), stats=Stats()))
    asyncio.run(catalog.scan())
    reason = catalog.broken_listing()["v"]
    assert "'annotations'" in reason and str(2**31) in reason, reason
    assert "variable-length" in reason, reason
