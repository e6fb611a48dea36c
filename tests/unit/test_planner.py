"""The batch read planner against the per-entry oracle, its chunk accounting and its errors.

docs/KEYMAP.md (what a sample is) and docs/ARCHITECTURE.md (how a batch is read). Every value the
planner returns is compared with ``tests/oracle.py``, which reads entry by entry through
zarr's plain API; the chunk counts are compared with windows computed from the window rules.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import yaml
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zarr.codecs import (
    BloscCodec,
    BytesCodec,
    Crc32cCodec,
    GzipCodec,
    ShardingCodec,
    ZstdCodec,
)

from episerve_proto.errors import (
    DataLossError,
    EpiserveError,
    EpisodeNotFound,
    FrameOutOfRange,
    InvalidArgument,
    InvalidEpisodeId,
    KeymapError,
    ResponseTooLarge,
    ShortArrayError,
)
from episerve_server.core.keymap import Keymap
from episerve_server.core.result import BatchResult
from episerve_server.plan.options import ReadOptions
from episerve_server.storage.latency import LatencyStore
from tests.support import oracle, ramp
from tests.support.differential import same_result
from tests.support.keymaps import (
    BATCH,
    CAMERA,
    CASES,
    EPISODES,
    KEYMAPS,
    MECKA,
    e,
    without_annotations,
)
from tests.support.profiles import scaled
from tests.support.served import DATASETS
from tests.support.served import LAYOUTS as NUMERIC_LAYOUTS
from tests.support.strategies import window_fields


def test_keymap_constants_match_the_packaged_yaml() -> None:
    directory = Path(__file__).resolve().parents[2] / "client" / "episerve_client" / "keymaps"
    for name in ("mecka_keypoints_k4", "camera_history"):
        path = directory / f"{name}.yaml"
        assert yaml.safe_load(path.read_text()) == KEYMAPS[name], path


# -- planner == oracle ---------------------------------------------------------------------------

@pytest.mark.parametrize("cached", [False, True, "tiny"], ids=["nocache", "cache", "tiny"])
@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize(("name", "cutoff"), CASES)
def test_planner_matches_oracle(name: str, cutoff: bool, dataset: str, cached: Any,
                                ramp_served: dict[Any, Any], ramp_roots: dict[str, Path],
                                matches_oracle: Any) -> None:
    served = ramp_served[dataset, cached]
    keymap = KEYMAPS[name]
    result = served.read(keymap, BATCH, cutoff=cutoff)
    matches_oracle(served, result, keymap, BATCH, cutoff, reference=ramp_roots["sharded"])


@pytest.mark.parametrize("cached", [False, "tiny"], ids=["nocache", "tiny"])
@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("cutoff", [False, True])
@pytest.mark.parametrize("name", ["offsets", "mecka_keypoints_k4", "camera_history",
                                  "two_horizons", "history_one"])
def test_all_masks_match_oracle(name: str, cutoff: bool, dataset: str, cached: Any,
                                ramp_served: dict[Any, Any], ramp_roots: dict[str, Path],
                                matches_oracle: Any) -> None:
    """masks="all": ``<output>_is_pad`` for every window and total_frames, per the oracle."""
    served = ramp_served[dataset, cached]
    keymap = KEYMAPS[name]
    result = served.read(keymap, BATCH, cutoff=cutoff, all_masks=True)
    matches_oracle(served, result, keymap, BATCH, cutoff, reference=ramp_roots["sharded"],
                   all_masks=True)


def test_a_read_needing_more_decoded_chunks_than_allowed_is_refused_before_fetching(
        ramp_served: dict[Any, Any], monkeypatch: pytest.MonkeyPatch,
        matches_oracle: Any) -> None:
    """The numeric chunks a read needs decoded at once are bounded whatever few rows its
    answer takes: past the bound, LimitExceeded names the episode and key holding most,
    and nothing is fetched; a read within it is served as before."""
    from episerve_proto.errors import LimitExceeded
    from episerve_server.plan import fetcher

    served = ramp_served["unsharded", False]  # no cache: every chunk is a miss
    keymap = {"kp": e("left.obs_keypoints", "proprio_keys")}
    samples = [("ep000a", 0), ("ep003d", 0), ("ep003d", 150), ("ep003d", 250)]
    one = served.catalog.episodes["ep003d"].readers["left.obs_keypoints"].info.decoded_bound
    monkeypatch.setattr(fetcher, "MAX_READ_DECODED_BYTES", 3 * one)
    fetched = served.stats.chunks_fetched
    with pytest.raises(LimitExceeded) as refused:
        served.read(keymap, samples)
    assert (refused.value.episode, refused.value.key) == ("ep003d", "left.obs_keypoints")
    assert "3 chunks of" in str(refused.value) and "fewer samples" in str(refused.value)
    assert served.stats.chunks_fetched == fetched
    result = served.read(keymap, samples[1:])
    matches_oracle(served, result, keymap, samples[1:])


def test_offsets_is_pad_follows_the_unclamped_frames(ramp_served: dict[Any, Any]) -> None:
    """Guards the comparison above: offsets beyond both ends are padding, duplicates stay."""
    served = ramp_served["sharded", False]
    keymap = {"kp": e("left.obs_keypoints", "metadata_keys", offsets_s=[-1.0, 0.0, 0.0, 1.0]),
              "act": e("left.obs_wrist_pose", "action_keys", horizon=4)}
    result = served.read(keymap, [("ep000a", 0), ("ep000a", 36), ("ep003d", 100)],
                         all_masks=True, cutoff=True)
    assert result.arrays["kp_is_pad"].tolist() == [[True, False, False, False],
                                                   [False, False, False, True],
                                                   [False, False, False, False]]
    assert result.arrays["kp"].shape == (3, 4, 63)
    assert np.array_equal(result.arrays["kp"][:, 1], result.arrays["kp"][:, 2])
    assert result.arrays["act_is_pad"].tolist()[1] == [False, True, True, True]
    assert result.total_frames is not None and result.total_frames.tolist() == [37, 37, 257]
    assert set(result.arrays) == {"kp", "kp_is_pad", "act", "act_is_pad", "action_pad_mask"}
    plain = served.read(keymap, [("ep000a", 0)])
    assert set(plain.arrays) == {"kp", "act", "action_pad_mask"} and plain.total_frames is None


def test_oracle_agrees_across_layouts(ramp_roots: dict[str, Path], oracle_memo: Any,
                                      same_sample: Any) -> None:
    """What lets the tests above share one oracle read per sample across the ramp roots."""
    samples = [("ep000a", 36), ("ep001b", 0), ("ep002c", 100), ("ep003d", 128)]
    for name in ("mecka_keypoints_k4", "camera_history"):
        for h, f in samples:
            want = oracle_memo(ramp_roots["sharded"], h, f, KEYMAPS[name], True)
            for dataset in DATASETS[1:]:
                got = oracle_memo(ramp_roots[dataset], h, f, KEYMAPS[name], True)
                same_sample(got, want, (dataset, h, f))


def test_cutoff_changes_the_action_chunk(ramp_served: dict[Any, Any]) -> None:
    """Guards the comparison above: the cutoff cases really differ from the plain ones."""
    served = ramp_served["sharded", False]
    # frame 80 is in "whole" [0, 257), "reach" [0, 85) and "grasp" [64, 128): "grasp" is
    # listed last and decides, so nothing is cut ("reach" would leave 5 real rows)
    samples = [("ep003d", 80)]
    on = served.read(KEYMAPS["annotations"], samples, cutoff=True).sample(0)
    off = served.read(KEYMAPS["annotations"], samples, cutoff=False).sample(0)
    assert on["action_pad_mask"].sum() == 20
    assert off["action_pad_mask"].sum() == 20
    samples = [("ep003d", 120)]  # "grasp" ends at 128: 8 real rows of 20
    on = served.read(KEYMAPS["annotations"], samples, cutoff=True).sample(0)
    off = served.read(KEYMAPS["annotations"], samples, cutoff=False).sample(0)
    assert on["action_pad_mask"].tolist() == [1.0] * 8 + [0.0] * 12
    assert off["action_pad_mask"].tolist() == [1.0] * 20
    assert np.array_equal(on["act"][8:], np.repeat(on["act"][7:8], 12, axis=0))
    # proprio_keys are never cut, whatever their window
    assert np.array_equal(on["prop_chunk"], off["prop_chunk"])
    assert on["task"] == off["task"] == ["whole", "grasp"]


# -- random keymaps and batches ------------------------------------------------------------------

SECONDS = st.sampled_from([0.02, 1 / 30, 0.1, 0.25, 0.5, 1.0, 2.5, 9.0])
WINDOW_TYPES = ["camera_keys", "proprio_keys", "action_keys", "metadata_keys"]


@st.composite
def random_keymaps(draw: st.DrawFn, annotations: bool = True) -> dict[str, dict[str, Any]]:
    keymap: dict[str, dict[str, Any]] = {}
    types = [*WINDOW_TYPES, "annotation_keys"] if annotations else WINDOW_TYPES
    for j in range(draw(st.integers(1, 6))):
        key_type = draw(st.sampled_from(types))
        if key_type == "annotation_keys":
            fields: dict[str, Any] = e("annotations", key_type)
        elif key_type == "camera_keys":
            fields = e(draw(st.sampled_from([CAMERA, *MECKA])), key_type)
        else:
            fields = e(draw(st.sampled_from([*MECKA, CAMERA])), key_type)
        fields.update(draw(window_fields(
            key_type, horizons=st.integers(1, 130), histories=st.integers(1, 9),
            strides=st.integers(1, 40), seconds=SECONDS)))
        keymap[f"k{j}"] = fields
    return keymap


@st.composite
def random_batches(draw: st.DrawFn) -> list[tuple[str, int]]:
    samples = []
    for _ in range(draw(st.integers(1, 8))):
        h = draw(st.sampled_from(sorted(EPISODES)))
        total = EPISODES[h][0]
        frame = draw(st.one_of(st.sampled_from([0, 1, total - 2, total - 1]),
                               st.integers(0, total - 1)))
        samples.append((h, frame))
    return samples


@settings(max_examples=scaled(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keymap=random_keymaps(), samples=random_batches(), cutoff=st.booleans(),
       dataset=st.sampled_from(DATASETS), cached=st.sampled_from([False, True, "tiny"]),
       all_masks=st.booleans())
def test_random_keymaps_match_oracle(keymap: dict[str, dict[str, Any]],
                                     samples: list[tuple[str, int]], cutoff: bool,
                                     dataset: str, cached: Any, all_masks: bool,
                                     ramp_served: dict[Any, Any],
                                     matches_oracle: Any) -> None:
    served = ramp_served[dataset, cached]
    result = served.read(keymap, samples, cutoff=cutoff, all_masks=all_masks)
    matches_oracle(served, result, keymap, samples, cutoff, all_masks=all_masks)


# -- chunk accounting ----------------------------------------------------------------------------

_CHUNK_ROWS: dict[tuple[str, str, str], int] = {}


def chunk_rows(root: Path, episode: str, key: str) -> int:
    """The inner chunk length as zarr itself reports it."""
    memo = (str(root), episode, key)
    if memo not in _CHUNK_ROWS:
        _CHUNK_ROWS[memo] = int(zarr.open_array(root / f"{episode}.zarr" / key, mode="r").chunks[0])
    return _CHUNK_ROWS[memo]


def entry_rows(fields: dict[str, Any], i: int, total: int, fps: int) -> list[int]:
    """The rows one entry reads at frame i, from the window rules as the oracle spells them."""
    return list(oracle.entry_indices(fields, i, total, fps, None)[0])


def expected_chunks(root: Path, keymap: dict[str, dict[str, Any]],
                    samples: list[tuple[str, int]]) -> Counter[str]:
    """Per episode: the distinct (zarr key, chunk) pairs the batch's windows touch."""
    touched = set()
    for h, i in samples:
        total, fps = EPISODES[h]
        for fields in keymap.values():
            if oracle.entry_rule(fields) == oracle.RULE_ANNOTATION:
                continue
            key = fields["zarr_key"]
            c = chunk_rows(root, h, key)
            touched |= {(h, key, row // c) for row in entry_rows(fields, i, total, fps)}
    return Counter(h for h, _, _ in touched)


def fetched(stats: Any) -> dict[str, int]:
    return {h: c.chunks_fetched for h, c in stats.episodes.items()}


def delta(after: dict[str, int], before: dict[str, int]) -> Counter[str]:
    return Counter({h: n - before.get(h, 0) for h, n in after.items() if n != before.get(h, 0)})


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("name", ["mecka_keypoints_k4", "camera_history", "two_horizons",
                                  "lag_only", "history_one", "offsets"])
def test_cache_off_fetches_exactly_the_touched_chunks(name: str, dataset: str,
                                                      ramp_roots: dict[str, Path],
                                                      serve: Callable[..., Any]) -> None:
    served = serve(ramp_roots[dataset], 0)
    keymap = without_annotations(KEYMAPS[name])
    served.read(keymap, BATCH)
    want = expected_chunks(served.root, keymap, BATCH)
    assert delta(fetched(served.stats), {}) == want
    assert served.stats.chunks_fetched == sum(want.values())
    # the same batch again, with the cache off, fetches the same chunks once more
    served.read(keymap, BATCH)
    assert served.stats.chunks_fetched == 2 * sum(want.values())


def literal_groups(root: Path, keymap: dict[str, dict[str, Any]],
                   samples: list[tuple[str, int]]) -> dict[tuple[str, str], list[tuple[int, int]]]:
    """Per (episode, zarr key): the merged groups of the merge rule, by the literal rule over
    every window of the batch (each window as its runs of consecutive rows)."""
    intervals: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for h, i in samples:
        total, fps = EPISODES[h]
        for fields in keymap.values():
            if oracle.entry_rule(fields) != oracle.RULE_ANNOTATION:
                rows = entry_rows(fields, i, total, fps)
                intervals.setdefault((h, fields["zarr_key"]), []).extend(oracle.row_runs(rows))
    return {(h, key): oracle.merge_intervals(iv, chunk_rows(root, h, key))
            for (h, key), iv in intervals.items()}


@pytest.mark.parametrize("layout", NUMERIC_LAYOUTS)
@pytest.mark.parametrize("name", ["mecka_keypoints_k4", "camera_history", "two_horizons",
                                  "lag_only", "offsets"])
def test_cache_off_store_calls_are_the_literal_merged_groups(name: str, layout: str,
                                                             ramp_roots: dict[str, Path],
                                                             serve: Callable[..., Any]) -> None:
    """With the cache off, the planner fetches each chunk of each merged group once, and
    nothing else: one ranged read per group in a shard, one object per chunk otherwise."""
    served = serve(ramp_roots[layout], 0)
    keymap = without_annotations(KEYMAPS[name])
    groups = literal_groups(served.root, keymap, BATCH)
    chunks = {(h, key, c) for (h, key), gs in groups.items()
              for start, end in gs
              for c in range((start) // chunk_rows(served.root, h, key),
                             (end - 1) // chunk_rows(served.root, h, key) + 1)}
    served.read(keymap, BATCH)
    assert served.stats.chunks_fetched == len(chunks)
    assert delta(fetched(served.stats), {}) == Counter(h for h, _, _ in chunks)
    n_groups = sum(len(gs) for gs in groups.values())
    assert served.stats.store_reads == (n_groups if layout == "sharded" else len(chunks))
    assert n_groups < len(chunks)  # the batch does merge: the counts tell the layouts apart


@settings(max_examples=scaled(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keymap=random_keymaps(annotations=False), samples=random_batches(),
       dataset=st.sampled_from(DATASETS))
def test_random_reads_fetch_the_union_of_their_windows(keymap: dict[str, dict[str, Any]],
                                                       samples: list[tuple[str, int]],
                                                       dataset: str,
                                                       ramp_served: dict[Any, Any]) -> None:
    served = ramp_served[dataset, False]
    before = fetched(served.stats)
    served.read(keymap, samples)
    assert delta(fetched(served.stats), before) == expected_chunks(served.root, keymap, samples)


@pytest.mark.parametrize("dataset", DATASETS)
def test_far_apart_jpeg_frames_fetch_two_chunks_not_the_gap(dataset: str,
                                                            ramp_roots: dict[str, Path],
                                                            serve: Callable[..., Any]) -> None:
    served = serve(ramp_roots[dataset], 0)
    keymap = {"cam": e(CAMERA, "camera_keys")}
    result = served.read(keymap, [("ep003d", 3), ("ep003d", 90), ("ep003d", 3)])
    assert served.stats.episodes["ep003d"].chunks_fetched == 2
    assert served.stats.chunks_fetched == 2
    assert set(served.stats.episodes) == {"ep003d"}
    frame_bytes = len(ramp.frame_jpeg(3, 3)) + len(ramp.frame_jpeg(3, 90))
    assert served.stats.bytes_fetched <= frame_bytes + 64
    assert result.frames[CAMERA] == [ramp.frame_jpeg(3, 3), ramp.frame_jpeg(3, 90)]
    # a strided camera memory reads its K frames, never the rows between them
    served.read({"mem": e(CAMERA, "camera_keys", history=4, history_stride=30)},
                [("ep003d", 200)])
    assert served.stats.episodes["ep003d"].chunks_fetched == 2 + 4


@pytest.mark.parametrize("dataset", DATASETS)
def test_cache_on_second_read_fetches_nothing(dataset: str, ramp_roots: dict[str, Path],
                                              serve: Callable[..., Any],
                                              matches_oracle: Any) -> None:
    """With the cache on, an identical second read is served from it entirely."""
    served = serve(ramp_roots[dataset], 64 << 20)
    keymap = KEYMAPS["mecka_keypoints_k4"]
    served.read(keymap, BATCH, cutoff=True)
    first = served.stats.snapshot()
    assert first["chunks_fetched"] > 0
    assert first["cache_misses"] > 0
    assert first["cache_hits"] == 0
    result = served.read(keymap, BATCH, cutoff=True)
    second = served.stats.snapshot()
    assert second["chunks_fetched"] == first["chunks_fetched"]
    assert second["store_reads"] == first["store_reads"]
    assert second["episodes"] == {h: {**c, "read_rpcs": c["read_rpcs"] + 1}
                                  for h, c in first["episodes"].items()}
    assert second["cache_misses"] == first["cache_misses"]
    assert second["cache_hits"] - first["cache_hits"] == first["cache_misses"]
    matches_oracle(served, result, keymap, BATCH, True, reference=ramp_roots["sharded"])


@pytest.mark.parametrize("cache_bytes", [0, 48 << 10, 64 << 20])
def test_concurrent_reads_match_oracle_and_read_each_shard_index_once(
        cache_bytes: int, ramp_roots: dict[str, Path], serve: Callable[..., Any],
        matches_oracle: Any) -> None:
    served = serve(ramp_roots["sharded"], cache_bytes)
    store = served.catalog.store
    store._store = LatencyStore(store._store, 0.002)  # so that the reads interleave
    before = served.stats.metadata_requests
    keymap = KEYMAPS["mecka_keypoints_k4"]
    batches = [BATCH[k::4] for k in range(4)]

    async def together() -> list[Any]:
        options = ReadOptions(annotation_cutoff=True)
        return await asyncio.gather(*(served.planner.read(Keymap.parse(keymap), b, options)
                                      for b in batches))

    for b, result in zip(batches, served.run(together())):
        matches_oracle(served, result, keymap, b, True)
    # one shard per array here: 6 window arrays + annotations per episode, each index once
    episodes = {h for b in batches for h, _ in b}
    assert served.stats.metadata_requests - before == 7 * len(episodes)


# -- metadata ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cache_bytes", [0, 64 << 20])
@pytest.mark.parametrize("dataset", DATASETS)
def test_no_metadata_requests_after_warm_up(dataset: str, cache_bytes: int,
                                            ramp_roots: dict[str, Path],
                                            serve: Callable[..., Any]) -> None:
    served = serve(ramp_roots[dataset], cache_bytes)
    assert served.stats.metadata_requests > 0  # opening the catalog reads metadata
    warm = [(h, 0) for h in EPISODES]
    served.read(KEYMAPS["mecka_keypoints_k4"], warm, cutoff=True)
    metadata, reads = served.stats.metadata_requests, served.stats.store_reads
    for frames in ([1, 5, 9, 2], [20, 99, 100, 256], [36, 50, 14, 130]):
        samples = [(h, min(f, EPISODES[h][0] - 1)) for h, f in zip(EPISODES, frames)]
        for name in ("mecka_keypoints_k4", "camera_history", "two_horizons"):
            served.read(KEYMAPS[name], samples, cutoff=True)
    assert served.stats.metadata_requests == metadata
    # the later frames lie in chunks the warm-up did not touch: they were really read
    assert served.stats.store_reads > reads


def _asked_exists(served: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys ``served``'s store is asked ``exists`` about from now on (the counters do
    not see them)."""
    store = served.catalog.store
    asked: list[str] = []
    real_exists = store.exists

    async def exists(key: str) -> bool:
        asked.append(key)
        return bool(await real_exists(key))

    monkeypatch.setattr(store, "exists", exists)
    return asked


@pytest.mark.parametrize("layout", NUMERIC_LAYOUTS)
def test_absent_chunks_make_no_metadata_hops_after_warm_up(
        layout: str, extras_served: dict[str, Any], serve: Callable[..., Any],
        monkeypatch: pytest.MonkeyPatch, matches_oracle: Any) -> None:
    """Rows 100..199 of ``x.sparse`` are all fill value, so zarr never wrote that chunk.

    Reading it is an ordinary read: after warm-up it must not ask the store about metadata
    (an opened store makes none) -- not even an ``exists`` on the group's zarr.json, which
    costs a HEAD
    request on object storage and which the counters do not see.
    """
    served = serve(extras_served[layout].root, 0)
    asked = _asked_exists(served, monkeypatch)
    keymap = {"s": e("x.sparse", "proprio_keys"), "c": e("x.sparse", "action_keys", horizon=9)}
    served.read(keymap, [("xb", 50), ("xb", 150)])  # warm-up
    asked.clear()
    metadata = served.stats.metadata_requests
    samples = [("xb", 120), ("xb", 195)]
    result = served.read(keymap, samples)
    matches_oracle(served, result, keymap, samples)
    assert served.stats.metadata_requests == metadata
    assert asked == []


def test_the_fill_chunks_a_reader_remembers_are_bounded(
        extras_served: dict[str, Any], serve: Callable[..., Any],
        monkeypatch: pytest.MonkeyPatch, matches_oracle: Any) -> None:
    """A reader remembers at most ``MAX_ABSENT`` chunks it found to be fill (an array can
    declare 10^8 chunks and hold none); past that, a batch that meets one checks that the
    episode is still there, and the answer is the same."""

    from episerve_server.plan import fetcher

    monkeypatch.setattr(fetcher, "MAX_ABSENT", 0)
    served = serve(extras_served["sharded"].root, 0)
    asked = _asked_exists(served, monkeypatch)
    keymap = {"s": e("x.sparse", "proprio_keys")}
    for frame in (150, 120, 195):
        asked.clear()
        result = served.read(keymap, [("xb", frame)])
        matches_oracle(served, result, keymap, [("xb", frame)])
        assert asked, frame  # not remembered: checked again
    assert served.catalog.episodes["xb"].readers["x.sparse"].absent == set()


# -- isolation -----------------------------------------------------------------------------------

def numeric_outputs(sample: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    return ((k, v) for k, v in sample.items() if isinstance(v, np.ndarray))


@pytest.mark.parametrize("dataset", ["sharded", "mixed"])
def test_no_two_outputs_share_memory(dataset: str, ramp_served: dict[Any, Any]) -> None:
    served = ramp_served[dataset, True]
    keymap = {**KEYMAPS["mecka_keypoints_k4"], **KEYMAPS["camera_history"],
              **{f"o.{k}": v for k, v in KEYMAPS["offsets"].items()},
              "same_as_head": e("obs_head_pose", "proprio_keys")}
    samples = [("ep003d", 5), ("ep003d", 5), ("ep000a", 36), ("ep003d", 6)]
    for k in range(4):  # the second read comes from the cache; then with all the masks
        result = served.read(keymap, samples, cutoff=True, all_masks=k >= 2)
        arrays = list(result.arrays.items())
        for (n1, a1), (n2, a2) in itertools.combinations(arrays, 2):
            assert not np.shares_memory(a1, a2), (n1, n2)
        for name, arr in arrays:
            assert arr.flags.writeable, name
            assert arr.dtype == (np.bool_ if name.endswith("_is_pad") else np.float32), name
        outs = [(b, k, v) for b in range(len(samples)) for k, v in
                numeric_outputs(result.sample(b))]
        outs += [(-1, k, v) for k, v in arrays]
        for (b1, k1, v1), (b2, k2, v2) in itertools.combinations(outs, 2):
            assert not np.shares_memory(v1, v2), (b1, k1, b2, k2)


@pytest.mark.parametrize("dataset", ["sharded", "unsharded", "v2", "mixed"])
def test_writing_into_outputs_changes_nothing_else(dataset: str, ramp_served: dict[Any, Any],
                                                   ramp_roots: dict[str, Path],
                                                   matches_oracle: Any) -> None:
    served = ramp_served[dataset, True]
    keymap = KEYMAPS["mecka_keypoints_k4"]
    samples = [("ep003d", 40), ("ep003d", 41), ("ep001b", 99), ("ep003d", 40)]
    first = served.read(keymap, samples, cutoff=True)
    second = served.read(keymap, samples, cutoff=True)
    keep = {k: v.copy() for k, v in second.arrays.items()}
    for arr in first.arrays.values():
        arr[...] = -7.0
    for texts in first.texts.values():
        for t in texts:
            t.append("scribble")
    for frames in first.frames.values():
        frames[:] = [b"x"] * len(frames)
    for k, v in second.arrays.items():
        assert np.array_equal(v, keep[k]), k
    sample = second.sample(0)
    for _, arr in numeric_outputs(sample):
        arr += 1000.0
    reference = ramp_roots["sharded"]
    matches_oracle(served, second, keymap, samples, True, reference=reference)
    third = served.read(keymap, samples, cutoff=True)
    matches_oracle(served, third, keymap, samples, True, reference=reference)


@pytest.mark.parametrize("name", ["mecka_keypoints_k4", "camera_history", "lag_only",
                                  "history_one"])
def test_result_does_not_depend_on_entry_order(name: str, ramp_served: dict[Any, Any],
                                               ramp_roots: dict[str, Path],
                                               matches_oracle: Any) -> None:
    served = ramp_served["mixed", False]
    keymap = KEYMAPS[name]
    items = list(keymap.items())
    orders = [items[::-1]] + [random.Random(seed).sample(items, len(items)) for seed in range(2)]
    batch = BATCH[::3]
    reference = [served.read(keymap, batch, cutoff=True).sample(b) for b in range(len(batch))]
    for order in orders:
        shuffled = dict(order)
        assert list(shuffled) != list(keymap)
        result = served.read(shuffled, batch, cutoff=True)
        matches_oracle(served, result, shuffled, batch, True, reference=ramp_roots["sharded"])
        for b in range(len(batch)):
            got = result.sample(b)
            assert set(got) == set(reference[b])
            for k, v in reference[b].items():
                if isinstance(v, np.ndarray):
                    assert np.array_equal(got[k], v), (b, k)
                else:
                    assert got[k] == v, (b, k)


# -- more layouts, dtypes and feature shapes -----------------------------------------------------

def _add_array(group: zarr.Group, name: str, data: np.ndarray, layout: str,
               chunks: tuple[int, ...], shards: tuple[int, ...] | None = None,
               **extra: Any) -> None:
    kwargs: dict[str, Any] = {"shape": data.shape, "dtype": data.dtype, "chunks": chunks}
    if data.dtype != object:
        kwargs["fill_value"] = 0
    if layout == "v2":
        kwargs["compressors"] = None if data.dtype == object else numcodecs.Zstd(level=1)
    else:
        if layout == "sharded" and shards is not None:
            kwargs["shards"] = shards
        kwargs["compressors"] = None if data.dtype == object else [ZstdCodec(level=1)]
    kwargs.update(extra)
    if data.dtype == object:
        kwargs["dtype"] = zarr.dtype.VariableLengthBytes()
    group.create_array(name, **kwargs)[...] = data


def write_extras_episode(root: Path, h: str, no: int, total: int, layout: str,
                         annotations: list[dict[str, Any]] | None) -> None:
    t = np.arange(total)
    sparse = (t[:, None] * 1000 + np.arange(4) + 1).astype(np.float32)
    sparse[(t >= 100) & (t < 200)] = 0.0  # a whole chunk of fill value: never written
    numeric = {
        "x.int32": ramp.ramp_values(total, (3,), "int32", offset=no * 100),
        "x.f64": ramp.ramp_values(total, (2, 3), "float64", offset=0.5),
        "x.u8": ((t[:, None] * 7 + np.arange(5)) % 256).astype(np.uint8),
        "x.bool": (t[:, None] + np.arange(2)) % 3 == 0,
        "x.scalar": (t * 2 + 0.25).astype(np.float32),
        "x.sparse": sparse,
    }
    ramp.write_ramp_episode(root, h, episode_no=no, total_frames=total, layout=layout,
                            annotations=annotations, extra_numeric=numeric)
    group = zarr.open_group(root / f"{h}.zarr", mode="r+")
    big_endian = (t[:, None] * 10 + np.arange(4)).astype(">i2")
    if layout == "v2":
        _add_array(group, "x.be", big_endian, layout, (50, 4))
    else:
        _add_array(group, "x.be", big_endian, layout, (50, 4), (100, 4),
                   serializer=BytesCodec(endian="big"))
    # chunked across the feature axis too: read through zarr's own getitem
    _add_array(group, "x.fallback", ramp.ramp_values(total, (6,), offset=7), layout,
               (50, 2), (100, 6))
    # several shards per array, the last one partial
    _add_array(group, "x.multishard", ramp.ramp_values(total, (3,), offset=9), layout,
               (20, 3), (60, 3))
    start = ramp.ramp_values(total, (3,), offset=11)
    if layout == "sharded":
        codec = ShardingCodec(chunk_shape=(25, 3), codecs=[BytesCodec(), ZstdCodec()],
                              index_location="start")
        _add_array(group, "x.start", start, "unsharded", (100, 3), serializer=codec,
                   compressors=None)
    else:
        _add_array(group, "x.start", start, layout, (25, 3))
    side = np.empty(total, dtype=object)
    side[:] = [ramp.frame_jpeg(no + 10, i) for i in range(total)]
    _add_array(group, "images.side", side, layout, (1,), (total,))
    v2 = layout == "v2"
    zstd: Any = numcodecs.Zstd(level=1) if v2 else [ZstdCodec(level=1)]
    _add_array(group, "images.zstd", side, layout, (1,), (total,), compressors=zstd)
    # other codecs, no codec, a checksum, other chunk key encodings, Fortran order
    codecs: dict[str, Any] = {
        "x.raw": None,
        "x.blosc": numcodecs.Blosc(cname="lz4") if v2 else [BloscCodec(cname="lz4")],
        "x.gzip": numcodecs.GZip(level=1) if v2 else [GzipCodec(level=1)],
        "x.crc": numcodecs.Zstd(level=1) if v2 else [ZstdCodec(level=1), Crc32cCodec()],
    }
    for n, (name, compressors) in enumerate(codecs.items()):
        values = ramp.ramp_values(total, (2, 2), offset=20 + n)
        _add_array(group, name, values, layout, (30, 2, 2), (90, 2, 2), compressors=compressors)
    encoding = {"name": "v2", "separator": "/" if v2 else "."}
    _add_array(group, "x.keyenc", ramp.ramp_values(total, (3,), offset=30), layout, (40, 3),
               (120, 3), chunk_key_encoding=encoding)
    _add_array(group, "x.forder", ramp.ramp_values(total, (3,), offset=31), layout, (40, 3),
               **({"order": "F"} if v2 else {}))


EXTRAS_KEYMAP = {
    "i32": e("x.int32", "proprio_keys", history=3, history_stride=2),
    "f64": e("x.f64", "action_keys", horizon=12),
    "u8": e("x.u8", "metadata_keys"),
    "be": e("x.be", "proprio_keys", lag_s=0.5),
    "be_chunk": e("x.be", "action_keys", horizon=70),
    "bool": e("x.bool", "proprio_keys", history=2),
    "scalar": e("x.scalar", "action_keys", horizon=5),
    "sparse": e("x.sparse", "action_keys", horizon=150),
    "sparse_now": e("x.sparse", "proprio_keys"),
    "fallback": e("x.fallback", "proprio_keys", history=4, history_stride=20),
    "fallback_chunk": e("x.fallback", "action_keys", horizon=70),
    "multi": e("x.multishard", "action_keys", horizon=90),
    "multi_lag": e("x.multishard", "proprio_keys", lag_s=2.0),
    "start": e("x.start", "action_keys", horizon=40),
    "start_hist": e("x.start", "proprio_keys", history=5, history_stride=30),
    "side": e("images.side", "camera_keys", history=3, history_stride=10),
    "front": e(CAMERA, "camera_keys"),
    "zstd_cam": e("images.zstd", "camera_keys", lag_s=0.3),
    "zstd_mem": e("images.zstd", "camera_keys", history=2, history_stride_s=1.0),
    "raw": e("x.raw", "action_keys", horizon=35),
    "blosc": e("x.blosc", "proprio_keys", history=5, history_stride=7),
    "gzip": e("x.gzip", "action_keys", horizon=31),
    "crc": e("x.crc", "proprio_keys", lag_s=1.0),
    "keyenc": e("x.keyenc", "action_keys", horizon=45),
    "forder": e("x.forder", "proprio_keys", history=3, history_stride=41),
    "text": e("annotations", "annotation_keys"),
}
EXTRAS_BATCH = [("xb", f) for f in (0, 1, 99, 100, 128, 199, 200, 208, 209)] + [
    ("xa", f) for f in (0, 1, 18, 35, 36)] + [("xb", 100), ("xa", 0), ("xb", 60)]


@pytest.fixture(scope="module")
def extras_served(tmp_path_factory: pytest.TempPathFactory,
                  serve: Callable[..., Any]) -> dict[str, Any]:
    out = {}
    for layout in NUMERIC_LAYOUTS:
        root = tmp_path_factory.mktemp(f"extras_{layout}")
        write_extras_episode(root, "xa", 0, 37, layout, annotations=[])
        write_extras_episode(root, "xb", 1, 210, layout, annotations=None)
        out[layout] = serve(root, 1 << 20)
    return out


#: A few of ``EXTRAS_BATCH``'s edges for the default tier (the oracle reads each entry on
#: its own, ~0.1 s a sample): both episodes' first and last frames, a chunk boundary.
EXTRAS_EDGES = [("xb", 0), ("xb", 209), ("xb", 100), ("xa", 0), ("xa", 36)]


def _odd_layout_matches_oracle(served: Any, samples: list[tuple[str, int]], cutoff: bool,
                               matches_oracle: Any) -> BatchResult:
    assert served.catalog.broken_listing() == {}
    cold = served.read(EXTRAS_KEYMAP, samples, cutoff=cutoff)
    matches_oracle(served, cold, EXTRAS_KEYMAP, samples, cutoff)
    # from the cache: the same answer, compared whole (the oracle once is enough)
    hits = served.stats.cache_hits
    result = served.read(EXTRAS_KEYMAP, samples, cutoff=cutoff)
    assert served.stats.cache_hits > hits
    same_result(cold, result)
    return result


# every odd layout, each with the annotation cutoff (the sharded one also without)
ODD_LAYOUTS = [("sharded", False), ("sharded", True), ("unsharded", True), ("v2", True)]


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "cutoff"), ODD_LAYOUTS)
def test_dtypes_shapes_and_odd_layouts_match_oracle(layout: str, cutoff: bool,
                                                    extras_served: dict[str, Any],
                                                    matches_oracle: Any) -> None:
    result = _odd_layout_matches_oracle(extras_served[layout], EXTRAS_BATCH, cutoff,
                                        matches_oracle)
    sample = result.sample(0)
    assert sample["f64"].shape == (12, 2, 3)
    assert sample["scalar"].shape == (5,)
    assert sample["side"] == [ramp.frame_jpeg(11, 0)] * 3


@pytest.mark.parametrize(("layout", "cutoff"), ODD_LAYOUTS)
def test_odd_layouts_match_oracle_at_the_edges(layout: str, cutoff: bool,
                                               extras_served: dict[str, Any],
                                               matches_oracle: Any) -> None:
    """The default tier's share of the test above: every case, a few edge frames."""
    result = _odd_layout_matches_oracle(extras_served[layout], EXTRAS_EDGES, cutoff,
                                        matches_oracle)
    assert result.sample(0)["f64"].shape == (12, 2, 3)


def test_scalar_feature_without_time_axis(extras_served: dict[str, Any],
                                          matches_oracle: Any) -> None:
    """A (T,) array read as a single frame: a 0-d float32 array per sample, like the oracle."""
    served = extras_served["sharded"]
    keymap = {"now": e("x.scalar", "proprio_keys"), "lag": e("x.scalar", "proprio_keys",
                                                             lag_s=0.1)}
    samples = [("xb", 7), ("xa", 36)]
    result = served.read(keymap, samples)
    assert result.arrays["now"].tolist() == [14.25, 72.25]
    assert result.arrays["lag"].tolist() == [8.25, 66.25]
    matches_oracle(served, result, keymap, samples)


# -- errors --------------------------------------------------------------------------------------

SINGLE = {"w": e("left.obs_wrist_pose", "proprio_keys")}


def test_frame_out_of_range(ramp_served: dict[Any, Any]) -> None:
    served = ramp_served["sharded", True]
    for frame in (-1, 37, 38, 10**9):
        with pytest.raises(FrameOutOfRange) as info:
            served.read(SINGLE, [("ep000a", 0), ("ep000a", frame)])
        assert "'ep000a'" in str(info.value)
        assert repr(frame) in str(info.value)
        assert isinstance(info.value, IndexError)
    with pytest.raises(FrameOutOfRange):
        served.read(SINGLE, [("ep000a", True)])
    result = served.read(SINGLE, [("ep000a", np.int64(36))])
    assert result.sample(0)["frame_index"] == 36


def test_unknown_episode_and_missing_key(ramp_served: dict[Any, Any]) -> None:
    served = ramp_served["sharded", True]
    with pytest.raises(EpisodeNotFound, match="'nosuch'"):
        served.read(SINGLE, [("ep000a", 0), ("nosuch", 0)])
    keymap = {**SINGLE, "bad": e("left.obs_fingers", "proprio_keys")}
    with pytest.raises(KeymapError) as info:
        served.read(keymap, [("ep003d", 0)])
    message = str(info.value)
    assert "'bad'" in message
    assert "'left.obs_fingers'" in message
    assert "'ep003d'" in message
    with pytest.raises(InvalidArgument):
        served.run(served.planner.read(Keymap.parse(SINGLE), [], ReadOptions()))
    for bad in ("..", "../ep000a", "/etc", "ep000a/../ep001b", "x\x00", "\uff0e\uff0e"):
        with pytest.raises(InvalidEpisodeId):
            served.read(SINGLE, [(bad, 0)])
    assert served.read(SINGLE, [("ep000a", 3)]).sample(0)["frame_index"] == 3


@pytest.fixture(scope="module", params=NUMERIC_LAYOUTS)
def short_served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 serve: Callable[..., Any]) -> Any:
    """Episode "shorty" (T=150) whose wrist pose holds 120 rows and camera 120 frames."""
    layout = request.param
    root = tmp_path_factory.mktemp(f"short_{layout}")
    ramp.write_ramp_episode(root, "fine", episode_no=1, total_frames=150, layout=layout)
    ramp.write_ramp_episode(root, "shorty", episode_no=4, total_frames=150, layout=layout)
    group = zarr.open_group(root / "shorty.zarr", mode="r+")
    del group["left.obs_wrist_pose"]
    del group[CAMERA]
    wrist = ramp.ramp_values(120, (7,), offset=ramp.ramp_offset(4, "left.obs_wrist_pose"))
    _add_array(group, "left.obs_wrist_pose", wrist, layout, (100, 7), (200, 7))
    frames = np.empty(120, dtype=object)
    frames[:] = [ramp.frame_jpeg(4, i) for i in range(120)]
    _add_array(group, CAMERA, frames, layout, (1,), (120,))
    return serve(root, 1 << 20)


@pytest.mark.parametrize(("keymap", "frame", "key"), [
    (SINGLE, 130, "left.obs_wrist_pose"),
    (SINGLE, 149, "left.obs_wrist_pose"),
    ({"a": e("left.obs_wrist_pose", "action_keys", horizon=30)}, 100, "left.obs_wrist_pose"),
    ({"c": e(CAMERA, "camera_keys")}, 125, CAMERA),
    ({"c": e(CAMERA, "camera_keys", history=3, history_stride=10)}, 140, CAMERA),
])
def test_short_array_names_episode_and_key(keymap: dict[str, Any], frame: int, key: str,
                                           short_served: Any, matches_oracle: Any) -> None:
    served = short_served
    samples = [("fine", 149), ("shorty", frame)]

    def batches() -> Iterator[Any]:  # as a DataLoader would consume it
        yield served.read(keymap, samples)

    ok = [("shorty", 10), ("shorty", 90), ("fine", 149)]
    served.read(keymap, ok)  # cached: the short read then meets the kernel's check
    with pytest.raises(ShortArrayError) as info:
        list(batches())
    assert not isinstance(info.value, StopIteration)
    message = str(info.value)
    assert "'shorty'" in message
    assert repr(key) in message
    assert info.value.episode == "shorty"
    assert info.value.key == key
    # windows inside the stored rows still read, and other episodes are untouched
    matches_oracle(served, served.read(keymap, ok), keymap, ok)
    reason = served.catalog.broken_listing()["shorty"]
    assert repr(key) in reason
    assert "120" in reason


def _corrupt_chunk(array_dir: Path, layout: str, chunk: int, ndim: int) -> None:
    """Overwrite every byte of one inner chunk with garbage, in place."""
    garbage = b"\xde\xad\xbe\xef"
    tail = "/".join(["0"] * (ndim - 1))
    if layout == "sharded":
        shard = array_dir / "c" / "0" / tail
        meta = zarr.open_array(array_dir, mode="r")
        per_shard = meta.shards[0] // meta.chunks[0]
        blob = bytearray(shard.read_bytes())
        index = np.frombuffer(bytes(blob[-(16 * per_shard + 4):-4]), "<u8").reshape(-1, 2)
        offset, length = (int(v) for v in index[chunk])
        assert offset > 0
        assert offset + length < len(blob) - 16 * per_shard
        blob[offset:offset + length] = (garbage * length)[:length]
        shard.write_bytes(bytes(blob))
        return
    path = array_dir / "c" / str(chunk) / tail if layout == "unsharded" else \
        array_dir / ".".join([str(chunk), *["0"] * (ndim - 1)])
    size = path.stat().st_size
    path.write_bytes((garbage * size)[:size])


@pytest.mark.parametrize("layout", NUMERIC_LAYOUTS)
def test_corrupt_chunk_is_data_loss(layout: str, tmp_path: Path, serve: Callable[..., Any],
                                    matches_oracle: Any) -> None:
    for h, no, total, fps in ramp.RAMP_DATASET[::3]:
        ramp.write_ramp_episode(tmp_path, h, episode_no=no, total_frames=total, fps=fps,
                                layout=layout)
    _corrupt_chunk(tmp_path / "ep003d.zarr" / "left.obs_keypoints", layout, 1, 2)
    served = serve(tmp_path, 1 << 20)
    kp = {"kp": e("left.obs_keypoints", "proprio_keys")}
    chunked = {"kp": e("left.obs_keypoints", "action_keys", horizon=30)}
    for keymap, frame in ((kp, 150), (chunked, 90), (kp, 150)):
        with pytest.raises(DataLossError) as info:
            served.read(keymap, [("ep000a", 3), ("ep003d", frame)])
        assert "'ep003d'" in str(info.value)
        assert "'left.obs_keypoints'" in str(info.value)
        assert info.value.key == "left.obs_keypoints"
    ok = [("ep003d", 50), ("ep003d", 250), ("ep000a", 36)]
    for keymap in (kp, KEYMAPS["camera_history"]):
        matches_oracle(served, served.read(keymap, ok), keymap, ok)


def test_truncated_shard_is_data_loss(tmp_path: Path, serve: Callable[..., Any]) -> None:
    ramp.write_ramp_episode(tmp_path, "ep", episode_no=0, total_frames=257)
    shard = tmp_path / "ep.zarr" / "obs_head_pose" / "c" / "0" / "0"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    served = serve(tmp_path, 0)
    with pytest.raises(DataLossError) as info:
        served.read({"h": e("obs_head_pose", "proprio_keys")}, [("ep", 5)])
    assert "'ep'" in str(info.value)
    assert "'obs_head_pose'" in str(info.value)


def test_batch_whose_episodes_disagree_on_a_feature_shape(tmp_path: Path,
                                                          serve: Callable[..., Any]) -> None:
    """Episodes whose arrays have different feature shapes cannot share a batch column: the
    read must fail with a domain error naming the key, not a raw numpy exception."""
    ramp.write_ramp_episode(tmp_path, "seven", episode_no=0, total_frames=50)
    ramp.write_ramp_episode(tmp_path, "four", episode_no=1, total_frames=50,
                            extra_numeric={"obs_head_pose": ramp.ramp_values(50, (4,))})
    served = serve(tmp_path, 0)
    keymap = {"h": e("obs_head_pose", "proprio_keys")}
    assert served.read(keymap, [("seven", 1)]).sample(0)["h"].shape == (7,)
    assert served.read(keymap, [("four", 1)]).sample(0)["h"].shape == (4,)
    with pytest.raises(EpiserveError) as info:
        served.read(keymap, [("seven", 1), ("four", 1)])
    assert "'obs_head_pose'" in str(info.value)


def test_frames_count_toward_the_response_limit_as_they_arrive(
        ramp_served: dict[Any, Any]) -> None:
    """JPEG sizes are unknown before fetching: the limit is charged as frames arrive, and
    frames already in the cache count too."""
    served = ramp_served["sharded", True]
    keymap = {"cam": e(CAMERA, "camera_keys")}
    samples = [("ep003d", f) for f in range(0, 200, 5)]
    frame_bytes = sum(len(ramp.frame_jpeg(3, f)) for _, f in samples)
    numeric = 4 * len(samples)  # one int32 frame index per sample
    tight = ReadOptions(max_response_bytes=numeric + frame_bytes // 2)
    with pytest.raises(ResponseTooLarge, match="at least") as info:
        served.run(served.planner.read(Keymap.parse(keymap), samples, tight))
    assert "split the batch" in str(info.value)
    # now every frame is cached (or about to be): a second try is refused from the cache
    served.read(keymap, samples)
    fetched = served.stats.chunks_fetched
    with pytest.raises(ResponseTooLarge, match="at least"):
        served.run(served.planner.read(Keymap.parse(keymap), samples, tight))
    assert served.stats.chunks_fetched == fetched
    roomy = ReadOptions(max_response_bytes=numeric + frame_bytes + 1024)
    result = served.run(served.planner.read(Keymap.parse(keymap), samples, roomy))
    assert len(result.frames[CAMERA]) == len(samples)
