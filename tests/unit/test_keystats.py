"""The statistics merge: exact against numpy over the concatenated values, however the
values are split into episodes and whichever episodes are added to a set's tails later."""

from __future__ import annotations

import numpy as np
import pytest

from episerve_server.statistics import moments as ks


def _stats(parts: list[np.ndarray], grow_from: int) -> ks.KeyStats:
    """Statistics of ``parts`` (each (F, T) float32); the first ``grow_from`` parts make
    tails first, and the rest are added to them, as when episodes are added to a root."""
    n = sum(p.shape[1] for p in parts)
    features = parts[0].shape[0]
    start = None
    if grow_from:
        first = ks.TailBuilder(features, ks.tail_room(sum(p.shape[1] for p in parts[:grow_from])))
        for p in parts[:grow_from]:
            first.add(p)
        start = first.finish()
    if start is not None and start.covers(n):
        builder = ks.TailBuilder(features, start.room, start)
        rest = parts[grow_from:]
    else:
        builder, rest = ks.TailBuilder(features, ks.tail_room(n)), parts
    for p in rest:
        builder.add(p)
    moments = ks.combine([ks.Moments.of(p) for p in parts])
    return ks.key_stats("k", (features,), len(parts), moments, builder.finish())


def _check(got: ks.KeyStats, x: np.ndarray) -> None:
    with np.errstate(invalid="ignore"):
        want = {"min": x.min(1), "max": x.max(1), "q01": np.percentile(x, 1, axis=1),
                "q99": np.percentile(x, 99, axis=1), "mean": x.mean(1), "std": x.std(1)}
    for name in ("min", "max", "q01", "q99"):
        np.testing.assert_array_equal(getattr(got, name), want[name], err_msg=name)
    for name in ("mean", "std"):
        np.testing.assert_allclose(getattr(got, name), want[name], rtol=1e-11, atol=1e-12,
                                   err_msg=name)
    assert got.count == x.shape[1]


@pytest.mark.parametrize("seed", range(40))
def test_exact_over_any_split(seed: int) -> None:
    rng = np.random.default_rng(seed)
    features = int(rng.integers(1, 5))
    parts = [rng.normal(size=(features, int(rng.integers(1, 400)))).astype(np.float32)
             for _ in range(int(rng.integers(1, 15)))]
    if seed % 3 == 0:  # many ties
        parts = [np.round(p * 2) for p in parts]
    grow_from = int(rng.integers(0, len(parts)))
    _check(_stats(parts, grow_from), np.concatenate(parts, axis=1).astype(np.float64))


def test_folds_past_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ks, "FOLD_VALUES", 64)  # fold after every few parts
    rng = np.random.default_rng(1)
    parts = [rng.exponential(size=(2, 300)).astype(np.float32) for _ in range(30)]
    _check(_stats(parts, 10), np.concatenate(parts, axis=1).astype(np.float64))


def test_one_row_and_nan() -> None:
    one = [np.array([[5.0]], np.float32)]
    _check(_stats(one, 0), np.array([[5.0]]))
    parts = [np.array([[1, 2, 3], [1, np.nan, 3]], np.float32),
             np.array([[4, 5], [6, 7]], np.float32)]
    got = _stats(parts, 1)
    assert not np.isnan(got.q99[0]) and all(np.isnan(getattr(got, n)[1]) for n in
                                            ("mean", "std", "min", "max", "q01", "q99"))
    _check(got, np.concatenate(parts, axis=1).astype(np.float64))


def test_tails_need_rebuilding_once_the_set_outgrows_them() -> None:
    room = ks.tail_room(1000)
    tails = ks.Tails(1000, np.zeros((1, room[0]), np.float32),
                     np.zeros((1, room[1]), np.float32), room)
    assert tails.covers(1100)
    assert not tails.covers(100_000)


def test_a_key_stats_request_parses_with_its_keys_and_episodes() -> None:
    """The request's bytes as the daemon reads them: keys and episodes kept in order, a
    too-long episode id refused by its position, too many keys refused."""
    from episerve_proto.errors import InvalidEpisodeId, LimitExceeded
    from episerve_server.rpc.wire.messages import MAX_NAME_CHARS, parse_key_stats, pb

    data = pb.KeyStatsRequest(keys=["a", "b"], episodes=["e1", "e2"]).SerializeToString()
    call = parse_key_stats(data, max_keys=4)
    assert call.keys == ["a", "b"] and call.episodes == ["e1", "e2"]
    long_id = "x" * (MAX_NAME_CHARS + 1)
    data = pb.KeyStatsRequest(keys=["a"], episodes=["e1", long_id]).SerializeToString()
    with pytest.raises(InvalidEpisodeId, match=r"episodes\[1\]"):
        parse_key_stats(data, max_keys=4)
    with pytest.raises(LimitExceeded, match="3 keys"):
        parse_key_stats(pb.KeyStatsRequest(keys=["a", "b", "c"]).SerializeToString(), 2)
