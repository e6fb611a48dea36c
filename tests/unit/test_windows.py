"""Window rules (docs/KEYMAP.md) and the fetcher's merge rule, as pure functions."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from episerve_server.core.keymap import Keymap, KeySpec
from episerve_server.core.windows import frames, window
from episerve_server.plan.fetcher import Need, _runs
from episerve_server.plan.locate import PACK
from tests.support import oracle
from tests.support.oracle import merge_intervals, row_runs
from tests.support.profiles import scaled
from tests.support.strategies import window_fields


def spec(**fields: Any) -> KeySpec:
    fields.setdefault("zarr_key", "k")
    fields.setdefault("key_type", "proprio_keys")
    return Keymap.parse({"out": fields}).entries[0]


def rows_of(s: KeySpec, frame: list[int], total: list[int] | int, fps: list[float] | float = 30,
            cutoff: list[int] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    f = np.asarray(frame, np.int64)
    t = np.broadcast_to(np.asarray(total, np.int64), f.shape).copy()
    r = np.broadcast_to(np.asarray(fps, np.float64), f.shape).copy()
    c = None if cutoff is None else np.asarray(cutoff, np.int64)
    w = window(s, f, t, r, c)
    return w.rows, w.mask


# -- the merge rule: the documented vectors --------------------------------------------------

@pytest.mark.parametrize(("intervals", "chunk", "groups"), [
    ([(57, 61), (60, 160)], 100, [(57, 160)]),
    ([(0, 1), (150, 151)], 100, [(0, 151)]),
    ([(0, 1), (250, 251)], 100, [(0, 1), (250, 251)]),
    ([(99, 100), (100, 101)], 100, [(99, 101)]),
    ([(57, 58), (60, 61)], 1, [(57, 58), (60, 61)]),
    ([(59, 60), (60, 61)], 1, [(59, 61)]),
    ([(10, 20), (15, 25)], 1, [(10, 25)]),
])
def test_merge_rule_vectors(intervals: list[tuple[int, int]], chunk: int,
                            groups: list[tuple[int, int]]) -> None:
    assert merge_intervals(intervals, chunk) == groups
    assert merge_intervals(list(reversed(intervals)), chunk) == groups


def test_merge_rule_edges() -> None:
    assert merge_intervals([], 100) == []
    # the group's end is the larger end, even when a later interval ends earlier
    assert merge_intervals([(0, 300), (10, 20)], 100) == [(0, 300)]
    # folding is transitive through a chain of adjacent chunks
    assert merge_intervals([(0, 1), (150, 151), (250, 251), (450, 451)], 100) == [
        (0, 251), (450, 451)]
    # one frame chunks: adjacent frames merge, a gap of one frame does not
    assert merge_intervals([(3, 4), (4, 5), (6, 7)], 1) == [(3, 5), (6, 7)]


def test_row_runs_examples() -> None:
    assert row_runs([5, 1, 2, 3, 3, 9]) == [(1, 4), (5, 6), (9, 10)]
    assert row_runs([]) == []


def planner_runs(rows_by_episode: list[list[int]], chunk: int) -> list[tuple[int, int, int]]:
    """The planner's store runs over every touched chunk (the cache off), as
    (episode position, first chunk, last chunk), from the fetcher's ``_runs`` itself."""
    packed = np.unique(np.concatenate([
        np.asarray(rows, np.int64) // chunk + e * PACK
        for e, rows in enumerate(rows_by_episode)]))
    return _episode_runs(packed, list(range(len(packed))))


def _episode_runs(packed: np.ndarray, missing: list[int]) -> list[tuple[int, int, int]]:
    readers: list[Any] = [object() for _ in range(int(packed.max()) // int(PACK) + 1)]
    needs = [Need(readers[int(packed[j]) // int(PACK)], int(packed[j]) % int(PACK))
             for j in missing]
    return [(readers.index(r), c0, c1) for r, c0, c1 in _runs(needs)]


rows_strategy = st.lists(st.integers(0, 2000), min_size=1, max_size=60)


@settings(max_examples=scaled(200), deadline=None)
@given(rows=st.lists(rows_strategy, min_size=1, max_size=3),
       chunk=st.sampled_from([1, 2, 7, 33, 100]))
def test_planner_runs_are_the_literal_merged_groups(rows: list[list[int]], chunk: int) -> None:
    want = [(e, s // chunk, (end - 1) // chunk)
            for e, r in enumerate(rows) for s, end in merge_intervals(row_runs(r), chunk)]
    assert planner_runs(rows, chunk) == want


def test_planner_runs_skip_cached_chunks() -> None:
    packed = np.array([3, 4, 5, 9, PACK + 10, PACK + 11], np.int64)
    assert _episode_runs(packed, [0, 2, 3, 4, 5]) == [(0, 3, 3), (0, 5, 5), (0, 9, 9),
                                                      (1, 10, 11)]


@settings(max_examples=scaled(200), deadline=None)
@given(intervals=st.lists(st.tuples(st.integers(0, 1500), st.integers(1, 150)),
                          min_size=1, max_size=30),
       chunk=st.sampled_from([1, 3, 100]))
def test_merged_groups_cover_exactly_the_touched_chunks(intervals: list[tuple[int, int]],
                                                         chunk: int) -> None:
    iv = [(s, s + n) for s, n in intervals]
    groups = merge_intervals(iv, chunk)
    rows = {r for s, e in iv for r in range(s, e)}
    # every row lies in exactly one group, and groups are sorted and disjoint
    for r in rows:
        assert sum(s <= r < e for s, e in groups) == 1
    assert all(e1 <= s2 for (_, e1), (s2, _) in itertools.pairwise(groups))
    # groups never touch a chunk no window touches: their chunks are exactly rows // chunk
    group_chunks = {c for s, e in groups for c in range(s // chunk, (e - 1) // chunk + 1)}
    assert group_chunks == {r // chunk for r in rows}
    # two groups are never in the same or adjacent chunks (else they would have merged)
    for (_, e1), (s2, _) in itertools.pairwise(groups):
        assert s2 // chunk > (e1 - 1) // chunk + 1


# -- frames() ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("seconds", "fps", "expected"), [
    (1.0, 30, 30), (1.0, 15, 15), (0.01, 30, 1), (1 / 60, 30, 1), (0.05, 30, 2),
    (0.25, 30, 8), (0.75, 30, 22), (0.5, 15, 8), (0.5, 25, 12), (0.1, 30, 3), (2.5, 30, 75),
])
def test_frames_rounds_half_to_even_and_is_at_least_one(seconds: float, fps: int,
                                                        expected: int) -> None:
    assert frames(seconds, np.array([fps], np.float64)).tolist() == [expected]


@settings(max_examples=scaled(200), deadline=None)
@given(seconds=st.floats(0.001, 100, allow_nan=False), fps=st.integers(1, 240))
def test_frames_equals_python_round(seconds: float, fps: int) -> None:
    assert frames(seconds, np.array([fps], np.float64))[0] == max(1, round(seconds * fps))


# -- window() per rule --------------------------------------------------------------------------

def test_horizon_window_clamps_at_the_end_and_masks_padding() -> None:
    rows, mask = rows_of(spec(horizon=4, key_type="action_keys"), [0, 5, 8, 9], 10)
    assert rows.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8], [8, 9, 9, 9], [9, 9, 9, 9]]
    assert mask is not None
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]


def test_horizon_window_stops_at_the_cutoff_before_padding() -> None:
    rows, mask = rows_of(spec(horizon=4, key_type="action_keys"), [0, 5, 8], 10,
                         cutoff=[2, 10, 9])
    assert rows.tolist() == [[0, 1, 1, 1], [5, 6, 7, 8], [8, 8, 8, 8]]
    assert mask is not None
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_horizon_longer_than_the_episode() -> None:
    rows, mask = rows_of(spec(horizon=6), [1], 3)
    assert rows.tolist() == [[1, 2, 2, 2, 2, 2]]
    assert mask is not None
    assert mask.tolist() == [[1, 1, 0, 0, 0, 0]]


def test_history_window_repeats_the_oldest_real_row() -> None:
    rows, mask = rows_of(spec(history=4), [0, 1, 2, 3, 10], 20)
    assert rows.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 2], [0, 1, 2, 3],
                             [7, 8, 9, 10]]
    assert mask is not None
    assert mask.tolist() == [[0, 0, 0, 1], [0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1],
                             [1, 1, 1, 1]]


def test_history_with_stride_fills_with_the_oldest_index_not_zero() -> None:
    rows, mask = rows_of(spec(history=3, history_stride=3), [4, 1, 9], 20)
    assert rows.tolist() == [[1, 1, 4], [1, 1, 1], [3, 6, 9]]
    assert mask is not None
    assert mask.tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1]]


def test_history_with_lag_and_nothing_real_is_all_zero() -> None:
    s = spec(history=3, lag_s=0.1)  # lag = 3 frames at 30 fps
    rows, mask = rows_of(s, [2, 5, 20], 30)
    assert rows.tolist() == [[0, 0, 0], [0, 1, 2], [15, 16, 17]]
    assert mask is not None
    assert mask.tolist() == [[0, 0, 0], [1, 1, 1], [1, 1, 1]]


def test_history_stride_seconds_depends_on_fps() -> None:
    s = spec(history=2, history_stride_s=0.5, key_type="camera_keys")
    rows, _ = rows_of(s, [40, 40, 40], 100, fps=[30, 15, 25])
    # 0.5 s is 15 frames at 30 fps, round(7.5) = 8 at 15 fps, round(12.5) = 12 at 25 fps
    assert rows.tolist() == [[25, 40], [32, 40], [28, 40]]


def test_offsets_read_past_and_future_frames_in_the_order_given() -> None:
    s = spec(offsets_s=[-0.1, 0.0, 0.1, 1 / 30, -1 / 30])  # -3, 0, +3, +1, -1 frames at 30
    rows, mask = rows_of(s, [10, 50], 100)
    assert rows.tolist() == [[7, 10, 13, 11, 9], [47, 50, 53, 51, 49]]
    assert mask is not None
    assert mask.all()


def test_offsets_clamp_beyond_both_ends_and_mask_the_unclamped_outside() -> None:
    s = spec(offsets_s=[-1.0, -0.1, 0.0, 0.1, 1.0])  # -30, -3, 0, +3, +30 frames
    rows, mask = rows_of(s, [0, 2, 3, 97, 99], 100)
    assert rows.tolist() == [[0, 0, 0, 3, 30], [0, 0, 2, 5, 32], [0, 0, 3, 6, 33],
                             [67, 94, 97, 99, 99], [69, 96, 99, 99, 99]]
    assert mask is not None
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1],
                             [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]


def test_offsets_keep_duplicates_and_one_frame_episodes() -> None:
    s = spec(offsets_s=[0.0, 0.0, -5.0, 5.0, 0.0])
    rows, mask = rows_of(s, [0], 1)
    assert rows.tolist() == [[0, 0, 0, 0, 0]]
    assert mask is not None
    assert mask.tolist() == [[1, 1, 0, 0, 1]]


def test_offsets_round_half_to_even_per_fps() -> None:
    # 0.5 s: 7.5 frames at 15 fps rounds to 8, 12.5 at 25 fps to 12; -0.5 s at 15 fps to -8;
    # 1/60 s at 30 fps is 0.5 frames: 0 (no max(1, ...) as for lag_s); 0.05 s at 30: 1.5 -> 2
    s = spec(offsets_s=[0.5, -0.5, 1 / 60, 0.05])
    rows, _ = rows_of(s, [50, 50, 50], 200, fps=[15, 25, 30])
    assert rows.tolist() == [[58, 42, 50, 51], [62, 38, 50, 51], [65, 35, 50, 52]]
    for o in (0.5, -0.5, 1 / 60, 0.05):
        for fps in (15, 25, 30):
            assert rows_of(spec(offsets_s=[o]), [50], 200, fps=fps)[0][0, 0] == 50 + round(o * fps)


def test_camera_offsets_have_a_time_axis() -> None:
    s = spec(offsets_s=[-2.0, 0.0], key_type="camera_keys")
    assert s.time_axis and s.length == 2
    rows, mask = rows_of(s, [10, 70], 80)
    assert rows.tolist() == [[0, 10], [10, 70]]
    assert mask is not None
    assert mask.tolist() == [[0, 1], [1, 1]]


def test_camera_history_one_keeps_a_time_axis() -> None:
    rows, mask = rows_of(spec(history=1, key_type="camera_keys"), [0, 7], 10)
    assert rows.tolist() == [[0], [7]]
    assert mask is not None
    assert mask.tolist() == [[1], [1]]
    rows, mask = rows_of(spec(history=1, lag_s=1.0, key_type="camera_keys"), [10, 40], 50)
    assert rows.tolist() == [[0], [10]]
    assert mask is not None
    assert mask.tolist() == [[0], [1]]


def test_lag_window_clamps_at_zero_and_depends_on_fps() -> None:
    rows, mask = rows_of(spec(lag_s=1.0), [0, 29, 30, 100, 100], 200,
                         fps=[30, 30, 30, 30, 15])
    assert rows.tolist() == [[0], [0], [0], [70], [85]]
    assert mask is None


def test_single_frame_window_has_no_mask() -> None:
    for s in (spec(), spec(history=1), spec(key_type="camera_keys")):
        rows, mask = rows_of(s, [0, 3, 9], 10)
        assert rows.tolist() == [[0], [3], [9]]
        assert mask is None


# -- window() against the oracle's literal index rules ------------------------------------------

seconds = st.sampled_from([0.02, 1 / 30, 0.1, 0.25, 0.5, 1.0, 2.5])


@st.composite
def entry_fields(draw: st.DrawFn) -> dict[str, Any]:
    key_type = draw(st.sampled_from(["camera_keys", "proprio_keys", "action_keys",
                                     "metadata_keys"]))
    return {"zarr_key": "k", "key_type": key_type, **draw(window_fields(
        key_type, horizons=st.integers(1, 40), histories=st.integers(1, 8),
        strides=st.integers(1, 9), seconds=seconds))}


@settings(max_examples=scaled(300), deadline=None)
@given(fields=entry_fields(), data=st.data())
def test_window_matches_the_oracle_index_rules(fields: dict[str, Any], data: st.DataObject) -> None:
    s = spec(**fields)
    n = data.draw(st.integers(1, 8))
    total = data.draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    frame = [data.draw(st.integers(0, t - 1)) for t in total]
    fps = data.draw(st.lists(st.sampled_from([10, 15, 25, 30, 60]), min_size=n, max_size=n))
    use_cut = data.draw(st.booleans())
    cut = [data.draw(st.integers(i + 1, t + 20)) for i, t in zip(frame, total)] if use_cut \
        else None
    rows, mask = rows_of(s, frame, total, fps, cut)
    for b in range(n):
        want_rows, want_mask = oracle.entry_indices(fields, frame[b], total[b], fps[b],
                                              cut[b] if cut else None)
        assert rows[b].tolist() == want_rows, (b, fields)
        assert s.time_axis == (want_mask is not None), fields
        if want_mask is None:
            assert mask is None
        else:
            assert mask is not None
            assert mask[b].astype(float).tolist() == want_mask, (b, fields)
        assert rows.shape == (n, s.length)
