"""GetKeyStats through a real daemon: exact against numpy over the same rows, cached per
(episode, key), invalidated by a rewrite, and every refusal a typed error."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from episerve_client import Client, errors
from episerve_tools.launch import DaemonProcess
from episerve_tools.synth.writer import write_episode
from tests.support import ramp

pytestmark = pytest.mark.slow

KEYS = list(ramp.MECKA_KEYS)
PAD_VALUE = 1e9  # written into the padded tails: a statistic that counts them is far off


def write_noisy(root: Path, episode: str, total: int, seed: int) -> None:
    """An episode of random floats (one key 2-D per row), its padded tails set to PAD_VALUE."""
    rng = np.random.default_rng(seed)
    numeric = {"noise": rng.normal(3.0, 2.0, (total, 3)).astype(np.float32),
               "grid": rng.uniform(-1, 1, (total, 2, 2)).astype(np.float32)}
    write_episode(root, episode, total_frames=total, fps=30, embodiment="robot",
                  numeric=numeric, jpeg={ramp.CAMERA_KEY: [ramp.frame_jpeg(0, 0)] * total},
                  annotations=ramp.default_annotations(total))
    group = zarr.open_group(str(root / f"{episode}.zarr"), mode="r+")
    for key in numeric:
        arr = group[key]
        if arr.shape[0] > total:
            arr[total:] = PAD_VALUE


def oracle(root: Path, episodes: Sequence[str], key: str) -> dict[str, np.ndarray]:
    """numpy over the real rows, read with plain zarr, as float32 values in float64."""
    rows = []
    for h in episodes:
        group = zarr.open_group(str(root / f"{h}.zarr"), mode="r")
        total = group.attrs["total_frames"]
        rows.append(np.asarray(group[key][:total], np.float32))
    x = np.concatenate(rows).astype(np.float64)
    return {"mean": x.mean(0), "std": x.std(0), "min": x.min(0), "max": x.max(0),
            "q01": np.percentile(x, 1, axis=0), "q99": np.percentile(x, 99, axis=0),
            "count": np.array(len(x))}


def assert_matches(got: Any, want: dict[str, np.ndarray], episodes: int) -> None:
    assert got.count == int(want["count"]) and got.episodes == episodes
    for name in ("min", "max", "q01", "q99"):  # order statistics: bit for bit
        assert getattr(got, name).dtype == np.float64
        np.testing.assert_array_equal(getattr(got, name), want[name], err_msg=name)
    scale = float(np.abs(want["max"]).max() + np.abs(want["min"]).max())
    for name in ("mean", "std"):  # sums in another order: equal to float64 rounding
        np.testing.assert_allclose(getattr(got, name), want[name], rtol=1e-12,
                                   atol=1e-12 * scale, err_msg=name)


def _write_root(path: Path) -> Path:
    ramp.write_ramp_dataset(path)
    for k, total in enumerate((150, 33, 401)):
        write_noisy(path, f"noisy{k}", total, seed=k)
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return _write_root(tmp_path / "root")


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for the tests that change nothing."""
    d = DaemonProcess(_write_root(tmp_path_factory.mktemp("stats") / "root"), "--rescan-s", "0")
    yield d
    d.stop(timeout_s=15)


def test_exact_against_numpy(root: Path, start_daemon: Callable[..., DaemonProcess],
                             make_client: Callable[..., Any]) -> None:
    d = start_daemon(root)
    client = make_client(d.target)
    ramps = [h for h, *_ in ramp.RAMP_DATASET]
    got = client.key_stats(KEYS, episodes=ramps)
    assert list(got) == KEYS
    for key in KEYS:
        assert got[key].mean.shape == ramp.MECKA_KEYS[key]
        assert_matches(got[key], oracle(root, ramps, key), len(ramps))
    noisy = ["noisy0", "noisy1", "noisy2"]
    got = client.key_stats(["noise", "grid"], episodes=noisy)
    assert got["grid"].q99.shape == (2, 2)
    for key in ("noise", "grid"):
        assert_matches(got[key], oracle(root, noisy, key), 3)
        assert float(got[key].max.max()) < PAD_VALUE  # the padded tails are not counted
    sub = client.key_stats(["noise"], episodes=["noisy2", "noisy1"])["noise"]
    assert_matches(sub, oracle(root, ["noisy1", "noisy2"], "noise"), 2)


def test_adding_an_episode_computes_only_it(root: Path,
                                            start_daemon: Callable[..., DaemonProcess]) -> None:
    for h, *_ in ramp.RAMP_DATASET:  # a root of noisy episodes only
        shutil.rmtree(root / f"{h}.zarr")
    d = start_daemon(root, "--cache-bytes", "0")
    with Client(d.target) as client:
        first = client.key_stats(["noise", "grid"])
        before = client.stats()
        assert before["key_stats_parts_computed"] == 2 * 3
        assert_matches(first["noise"], oracle(root, ["noisy0", "noisy1", "noisy2"], "noise"), 3)
        write_noisy(root, "noisy3", 260, seed=7)  # picked up by the next call's rescan
        again = client.key_stats(["noise", "grid"])
        after = client.stats()
        assert after["key_stats_parts_computed"] - before["key_stats_parts_computed"] == 2
        fetched = {h: after["episodes"].get(h, {}).get("chunks_fetched", 0)
                   - before["episodes"].get(h, {}).get("chunks_fetched", 0)
                   for h in ("noisy0", "noisy1", "noisy2", "noisy3")}
        assert fetched == {"noisy0": 0, "noisy1": 0, "noisy2": 0, "noisy3": 2 * 3}
        everyone = ["noisy0", "noisy1", "noisy2", "noisy3"]
        for key in ("noise", "grid"):
            assert_matches(again[key], oracle(root, everyone, key), 4)
        # asked again: nothing is read at all
        client.key_stats(["noise", "grid"])
        assert client.stats()["chunks_fetched"] == after["chunks_fetched"]
        # a subset no tails were built for: merged from the cached parts, nothing read
        sub = client.key_stats(["noise", "grid"], episodes=["noisy0", "noisy3"])
        last = client.stats()
        assert last["key_stats_parts_cached"] - after["key_stats_parts_cached"] == 2 * 2
        assert last["key_stats_parts_computed"] == after["key_stats_parts_computed"]
        assert last["chunks_fetched"] == after["chunks_fetched"]
        assert_matches(sub["grid"], oracle(root, ["noisy0", "noisy3"], "grid"), 2)


def test_a_rewritten_episode_is_computed_again(root: Path,
                                               start_daemon: Callable[..., DaemonProcess]) -> None:
    d = start_daemon(root)
    noisy = ["noisy0", "noisy1"]
    with Client(d.target) as client:
        client.key_stats(["noise"], episodes=noisy)
        shutil.rmtree(root / "noisy1.zarr")
        client.list_episodes()  # the rescan drops it (and its statistics)
        with pytest.raises(errors.EpisodeNotFound) as info:
            client.key_stats(["noise"], episodes=noisy)
        assert info.value.episode == "noisy1"
        write_noisy(root, "noisy1", 90, seed=99)
        client.list_episodes()
        got = client.key_stats(["noise"], episodes=noisy)["noise"]
        assert_matches(got, oracle(root, noisy, "noise"), 2)


@pytest.mark.parametrize(("keys", "episodes", "error", "key", "says"), [
    ([ramp.CAMERA_KEY], ["ep000a"], errors.InvalidArgument, ramp.CAMERA_KEY, "not numbers"),
    (["annotations"], ["ep000a"], errors.InvalidArgument, "annotations", "not numbers"),
    (["noise"], ["ep000a"], errors.InvalidArgument, "noise", "has no array 'noise'"),
    (["noise", "noise"], [], errors.InvalidArgument, "noise", "listed twice"),
    ([f"k{i}" for i in range(257)], [], errors.LimitExceeded, "", "over the limit of 256"),
    (["noise"], ["nope"], errors.EpisodeNotFound, "", "'nope'"),
    (["noise"], ["../x"], errors.InvalidEpisodeId, "", "'../x'"),
    (["noise"], ["noisy0", "noisy0"], errors.InvalidArgument, "", "listed twice"),
])
def test_refusals_are_typed(shared: DaemonProcess, keys: list[str], episodes: list[str],
                            error: type[Exception], key: str, says: str) -> None:
    with Client(shared.target) as client:
        with pytest.raises(error) as info:
            client.key_stats(keys, episodes=episodes)
        assert says in str(info.value)
        assert isinstance(info.value, errors.EpiserveError)
        if key:
            assert info.value.key == key
        assert client.key_stats(["noise"], episodes=["noisy0"])["noise"].count == 150


def test_client_refuses_a_string_of_keys() -> None:
    client = Client("127.0.0.1:1")
    with pytest.raises(errors.InvalidArgument, match="list of zarr key names"):
        client.key_stats("left.obs_keypoints")  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgument, match="at least one key"):
        client.key_stats([])


def test_stats_command(root: Path, start_daemon: Callable[..., DaemonProcess],
                       tmp_path: Path) -> None:
    d = start_daemon(root)
    out = tmp_path / "stats.json"
    keymap = Path(__file__).parents[2] / "client/episerve_client/keymaps/mecka_keypoints_k4.yaml"
    ramps = [h for h, *_ in ramp.RAMP_DATASET]
    args = [sys.executable, "-m", "episerve_tools.cli", "stats", d.target, "--keymap",
            str(keymap), "--json", str(out)]
    for h in ramps:
        args += ["--episode", h]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert sorted(doc["keys"]) == sorted(KEYS)
    with Client(d.target) as client:
        want = client.key_stats(KEYS, episodes=ramps)
    for key in KEYS:
        assert doc["keys"][key] == want[key].as_dict()
    assert "left.obs_keypoints[62]" in done.stdout and "q99" in done.stdout
    assert "[1/5]" in done.stderr
    # A reader that has gone (`| head` done) before the table: the file is written all the
    # same, and no traceback.
    out.unlink()
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as head:
        assert head.stdout is not None and head.stderr is not None
        head.stdout.close()
        errors = head.stderr.read().decode()
        assert head.wait(120) == 0, errors
    assert "Traceback" not in errors and "BrokenPipeError" not in errors, errors
    assert sorted(json.loads(out.read_text())["keys"]) == sorted(KEYS)
    bad = subprocess.run([*args[:4], d.target, "--keys", ramp.CAMERA_KEY],
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 1 and "InvalidArgument" in bad.stderr


def test_readme_stats_command_runs(root: Path, tmp_path: Path) -> None:
    readme = (Path(__file__).parents[2] / "docs" / "GUIDE.md").read_text()
    lines = [line for line in readme.splitlines() if line.startswith("episerve stats ")]
    assert lines
    for ep in ("noisy0", "noisy1", "noisy2"):  # the keymap's keys are in every episode left
        shutil.rmtree(root / f"{ep}.zarr")
    with DaemonProcess(root, "--rescan-s", "0", unix=tmp_path / "episerve.sock"):
        for line in lines:
            args = shlex.split(line.replace("/tmp/", f"{tmp_path}/"))
            done = subprocess.run([sys.executable, "-m", "episerve_tools.cli", *args[1:]],
                                  cwd=Path(__file__).parents[2], capture_output=True,
                                  text=True, timeout=120, check=False)
            assert done.returncode == 0, done.stderr
            doc = json.loads((tmp_path / "stats.json").read_text())
            assert sorted(doc["keys"]) == sorted(KEYS)


@pytest.mark.parametrize("cut", ["BLOCK_BYTES", "BLOCK_CHUNKS"])
@pytest.mark.parametrize("budget", [1, 2**30])
def test_long_episodes_in_blocks_and_a_tiny_budget(root: Path, budget: int, cut: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """In process: episodes read in blocks of one chunk (cut by their bytes, or by their
    count of chunks), parts kept or not by the budget."""
    import asyncio

    from episerve_server.config import ServerConfig
    from episerve_server.statistics import key_statistics
    from episerve_server.wiring import build_read_core

    monkeypatch.setattr(key_statistics, cut, 1)
    core = build_read_core(ServerConfig(root=str(root), stats_cache_bytes=budget))
    noisy = ["noisy0", "noisy1", "noisy2"]

    async def run() -> list[Any]:
        await core.catalog.scan()
        first = await core.key_stats.compute(["noise", "grid"], noisy)
        sub = await core.key_stats.compute(["grid"], ["noisy2", "noisy0"])
        return [*first, *sub]

    noise, grid, sub = asyncio.run(run())
    assert_matches(noise, oracle(root, noisy, "noise"), 3)
    assert_matches(grid, oracle(root, noisy, "grid"), 3)
    assert_matches(sub, oracle(root, ["noisy0", "noisy2"], "grid"), 2)
    counters = core.key_stats.counters()
    assert counters["key_stats_cache_bytes"] <= budget
    assert counters["key_stats_parts_computed"] == (8 if budget == 1 else 6)


def test_dataset_stats_cover_its_manifest_by_output_key(
        root: Path, start_daemon: Callable[..., DaemonProcess]) -> None:
    from episerve_client import WindowDataset, channel
    from episerve_client.data import Manifest

    grpc_before = set(channel._GRPC_PIDS)

    keymap = {"noise_out": {"zarr_key": "noise", "key_type": "proprio_keys", "history": 2},
              "grid_out": {"zarr_key": "grid", "key_type": "action_keys", "horizon": 3}}
    target = start_daemon(root).target
    full = WindowDataset(target, keymap, episodes=["noisy0", "noisy1", "noisy2"])
    part = WindowDataset(target, keymap,
                         manifest=Manifest.of([("noisy0", 150), ("noisy2", 401)]))
    got = part.stats()
    assert sorted(got) == ["grid_out", "noise_out"]
    assert_matches(got["noise_out"], oracle(root, ["noisy0", "noisy2"], "noise"), 2)
    assert_matches(got["grid_out"], oracle(root, ["noisy0", "noisy2"], "grid"), 2)
    assert_matches(full.stats(["grid_out"])["grid_out"],
                   oracle(root, ["noisy0", "noisy1", "noisy2"], "grid"), 3)
    with pytest.raises(errors.InvalidArgument, match="'nope'"):
        part.stats(["nope"])
    # asked from a child process: stats() starts no gRPC in this process
    assert set(channel._GRPC_PIDS) == grpc_before



def test_a_misspelt_key_is_answered_with_the_arrays_named_whole(shared: DaemonProcess) -> None:
    with Client(shared.target) as client, pytest.raises(errors.InvalidArgument) as info:
        client.key_stats(["left.obs_keypoint"], episodes=["ep000a"])
    message = str(info.value)
    assert "did you mean 'left.obs_keypoints'?" in message
    assert "...'" not in message and "chars)" not in message  # no name cut in the middle
    count, names = message.split("; its ")[1].split(" arrays are ")
    shown_names = names.split(" and ")[0].split(", ")
    assert len(shown_names) == min(int(count), 12) and "'left.obs_keypoints'" in names
    assert all(n.startswith("'") and n.endswith("'") for n in shown_names), names
