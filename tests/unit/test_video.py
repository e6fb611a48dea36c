"""The rank-0 video gate, its schedule and cap, the mp4 renderer and the overlay projection."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import av
import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image, ImageDraw
from torch.utils.data import DataLoader, default_collate

from episerve_client.listing import EpisodeInfo
from episerve_client.viz import (
    EpochSchedule,
    PassRenderer,
    VideoConfigError,
    VizGatedLoader,
    check_viz_config,
    render_pass,
    renders_on_epoch,
    video_loader,
    write_video,
)
from episerve_client.viz.overlay import (
    DEFAULT_FOCAL_PER_WIDTH,
    batch_overlays,
    caption,
    intrinsics,
    project,
)


class RecordingLoader(DataLoader[Any]):
    """A DataLoader that counts ``__iter__`` calls and refuses them when ``explode``."""

    def __init__(self, n: int = 10, batch_size: int = 2, explode: bool = True) -> None:
        super().__init__(list(range(n)), batch_size=batch_size)
        self.iter_calls, self.explode = 0, explode

    def __iter__(self) -> Any:
        self.iter_calls += 1
        if self.explode:
            raise AssertionError("the inner loader was iterated")
        return super().__iter__()


@pytest.fixture
def as_rank(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``as_rank(r)``: this process looks like global rank ``r`` of a process group."""

    def set_rank(rank: int) -> None:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)

    return set_rank


# -- the gate -----------------------------------------------------------------------------


def test_closed_pass_yields_nothing_and_never_iterates() -> None:
    loader = RecordingLoader()
    gate = VizGatedLoader(loader, lambda: False, max_batches=3)
    assert list(gate) == []
    assert len(gate) == 0
    assert loader.iter_calls == 0


def test_closed_on_other_ranks_without_asking_the_schedule(as_rank: Any) -> None:
    as_rank(1)
    loader = RecordingLoader()
    gate = VizGatedLoader(loader, lambda: pytest.fail("schedule asked on rank 1"), max_batches=3)
    assert list(gate) == []
    assert len(gate) == 0
    assert loader.iter_calls == 0


def test_len_creates_no_iterator() -> None:
    loader = RecordingLoader(n=10, batch_size=2)  # 5 batches
    assert len(VizGatedLoader(loader, lambda: True, max_batches=3)) == 3
    assert len(VizGatedLoader(loader, lambda: True, max_batches=8)) == 5
    assert loader.iter_calls == 0


def test_iter_decides_but_creates_the_loader_iterator_only_on_next() -> None:
    loader = RecordingLoader()
    batches = iter(VizGatedLoader(loader, lambda: True, max_batches=3))
    assert loader.iter_calls == 0
    with pytest.raises(AssertionError, match="iterated"):
        next(batches)
    assert loader.iter_calls == 1


def test_open_gate_yields_the_first_max_batches_in_order() -> None:
    loader = RecordingLoader(n=10, batch_size=2, explode=False)
    gate = VizGatedLoader(loader, lambda: True, max_batches=3)
    assert [b.tolist() for b in gate] == [[0, 1], [2, 3], [4, 5]]
    assert [b.tolist() for b in gate] == [[0, 1], [2, 3], [4, 5]]  # every pass anew


def test_falls_open_without_process_group_or_schedule() -> None:
    assert not dist.is_initialized()
    loader = RecordingLoader(n=4, batch_size=2, explode=False)
    gate = VizGatedLoader(loader, max_batches=5)
    assert len(gate) == 2
    assert len(list(gate)) == 2


def test_open_on_rank_zero_of_a_real_group(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        loader = RecordingLoader(n=4, batch_size=2, explode=False)
        assert len(list(VizGatedLoader(loader, lambda: True, max_batches=5))) == 2
        assert list(VizGatedLoader(loader, lambda: False, max_batches=5)) == []
    finally:
        dist.destroy_process_group()


def test_schedule_every_n_epochs_and_the_final_one() -> None:
    assert [e for e in range(4) if renders_on_epoch(e, every_n_epochs=2, max_epochs=4)] == [0, 2, 3]
    assert [e for e in range(3) if renders_on_epoch(e, every_n_epochs=2, max_epochs=3)] == [0, 2]
    assert [e for e in range(5) if renders_on_epoch(e, every_n_epochs=3)] == [0, 3]
    schedule = EpochSchedule(every_n_epochs=2, max_epochs=4)
    seen = []
    for epoch in range(4):
        schedule.set_epoch(epoch)
        seen.append(schedule())
    assert seen == [True, False, True, True]
    with pytest.raises(ValueError, match="every_n_epochs"):
        EpochSchedule(every_n_epochs=0)


def test_uncapped_video_setup_is_refused_before_training() -> None:
    with pytest.raises(VideoConfigError, match=r"'ep002c'.*collective.*timeout"):
        check_viz_config(["ep002c"], None)
    with pytest.raises(VideoConfigError, match="at least 1"):
        check_viz_config(["ep002c"], 0)
    check_viz_config([], None)  # no pinned episode, no video: nothing to cap
    check_viz_config(["ep002c"], 4)
    with pytest.raises(VideoConfigError, match="viz_max_batches is None"):
        VizGatedLoader(RecordingLoader(), lambda: True)
    with pytest.raises(VideoConfigError, match="viz_max_batches is None"):
        PassRenderer("unused", 0, [episode("ep002c")], max_batches=None, camera_key="c",
                     action_key="a")


def test_video_loader_bounds_its_sampler_to_the_cap() -> None:
    loader = video_loader(list(range(100)), batch_size=8, max_batches=3,  # type: ignore[arg-type]
                          collate_fn=default_collate)
    assert len(loader) == 3
    assert torch.cat(list(loader)).tolist() == list(range(24))


# -- the Lightning adapter (imported only here: Lightning takes seconds to import) ----------


@pytest.fixture(scope="module")
def adapter() -> Any:
    return pytest.importorskip("episerve_client.viz.lightning")


def trainer(epoch: int = 0, *, sanity: bool = False, fn: str = "fit", max_epochs: int = 3) -> Any:
    return SimpleNamespace(sanity_checking=sanity, state=SimpleNamespace(fn=fn),
                           current_epoch=epoch, max_epochs=max_epochs)


def test_trainer_schedule(adapter: Any) -> None:
    assert [adapter.TrainerSchedule(trainer(e), 2)() for e in range(3)] == [True, False, True]
    assert not adapter.TrainerSchedule(trainer(0, sanity=True), 2)()
    assert adapter.TrainerSchedule(trainer(1, fn="validate"), 2)()


def test_lightning_gate_reports_its_bound_even_when_closed(adapter: Any, as_rank: Any) -> None:
    as_rank(1)
    loader = RecordingLoader(n=10, batch_size=2)
    gate = adapter.LightningVizGate(loader, lambda: True, max_batches=3)
    assert len(gate) == 3
    assert list(gate) == []
    assert loader.iter_calls == 0
    with pytest.raises(VideoConfigError, match="viz_max_batches is None"):
        adapter.gate_val_loader(loader, trainer(), max_batches=None)


# Lightning 2.6's CombinedLoader flattens with a torch pytree API that torch 2.13 deprecates.
LEAFSPEC_DEPRECATED = r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"


@pytest.mark.filterwarnings(LEAFSPEC_DEPRECATED)
def test_sequential_combined_loader_never_iterates_a_closed_gate(adapter: Any) -> None:
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    video = RecordingLoader()
    gate = adapter.gate_val_loader(video, trainer(1), max_batches=3, every_n_epochs=2)
    combined = CombinedLoader([[10, 11, 12], gate], "sequential")
    combined.limits = [3, len(gate)]  # as Lightning sets them: the gate's bound, 3
    assert [(b, i) for b, _, i in combined] == [(10, 0), (11, 0), (12, 0)]
    assert video.iter_calls == 0


# -- the renderer -----------------------------------------------------------------------------


def decoded(path: Path) -> tuple[int, Fraction, tuple[int, int]]:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        n = sum(1 for _ in container.decode(stream))
        return n, stream.average_rate, (stream.width, stream.height)


def frames(n: int, size: tuple[int, int] = (32, 24), fail_at: int | None = None
           ) -> Iterator[Image.Image]:
    for i in range(n):
        if i == fail_at:
            raise RuntimeError("interrupted mid-stream")
        yield Image.new("RGB", size, (i * 9 % 256, 80, 160))


@pytest.mark.parametrize(("fps", "rate"), [(15, Fraction(15)), (12.5, Fraction(25, 2))])
def test_written_video_has_the_source_fps_and_every_frame(tmp_path: Path, fps: float,
                                                          rate: Fraction) -> None:
    path = write_video(tmp_path / "v.mp4", frames(17), fps)
    assert path == tmp_path / "v.mp4"
    assert decoded(path) == (17, rate, (32, 24))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.mp4"]


def test_odd_frames_are_padded_to_even_sizes(tmp_path: Path) -> None:
    path = write_video(tmp_path / "v.mp4", frames(3, size=(33, 23)), 30)
    assert path is not None
    assert decoded(path) == (3, Fraction(30), (34, 24))


def test_interrupted_render_leaves_no_file_and_no_temp(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="mid-stream"):
        write_video(tmp_path / "v.mp4", frames(20, fail_at=7), 30)
    assert list(tmp_path.iterdir()) == []
    # An earlier, complete video at the final path survives an interrupted re-render.
    write_video(tmp_path / "v.mp4", frames(5), 30)
    before = (tmp_path / "v.mp4").read_bytes()
    with pytest.raises(RuntimeError, match="mid-stream"):
        write_video(tmp_path / "v.mp4", frames(20, fail_at=7), 30)
    assert (tmp_path / "v.mp4").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["v.mp4"]


def test_no_frames_no_file(tmp_path: Path) -> None:
    assert write_video(tmp_path / "v.mp4", [], 30) is None
    assert list(tmp_path.iterdir()) == []


K = [[20.0, 0.0, 12.0], [0.0, 20.0, 36.0], [0.0, 0.0, 1.0]]


def episode(h: str, fps: float = 30.0, **attrs: Any) -> EpisodeInfo:
    return EpisodeInfo(h, 100, fps, "human_bimanual", {}, dict(attrs))


def batch(episodes: list[str], start: int = 0, size: tuple[int, int] = (64, 48)
          ) -> dict[str, Any]:
    """Black frames; every action window point at (0, 0, 1) m: the principal point."""
    n = len(episodes)
    actions = torch.zeros(n, 5, 63)
    actions[..., 2] = 1.0
    return {"cam": torch.zeros(n, 3, size[1], size[0]), "act": actions, "episode_hash": episodes,
            "frame_index": torch.arange(start, start + n), "annotations": [["reach"]] * n}


def test_pass_renderer_writes_one_video_per_episode_at_its_fps(tmp_path: Path) -> None:
    pinned = [episode("ep1", fps=15), episode("ep2", fps=30, intrinsics=K)]
    renderer = PassRenderer(tmp_path, 7, pinned, max_batches=3, camera_key="cam",
                            action_key="act")
    paths = render_pass([batch(["ep1"] * 4), batch(["ep1"] * 2 + ["ep2"] * 3, 4)],
                        lambda b: b["act"] + 0.01, renderer)
    assert [p.name for p in paths] == ["ep1_epoch0007.mp4", "ep2_epoch0007.mp4"]
    assert decoded(paths[0]) == (6, Fraction(15), (64, 48))
    assert decoded(paths[1]) == (3, Fraction(30), (64, 48))
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in paths]


def test_pass_renderer_interrupted_mid_episode(tmp_path: Path) -> None:
    def predict(b: Mapping[str, Any]) -> torch.Tensor:
        if int(b["frame_index"][0]) >= 4:
            raise RuntimeError("model failed")
        return b["act"]

    renderer = PassRenderer(tmp_path, 0, [episode("ep1")], max_batches=3, camera_key="cam",
                            action_key="act")
    with pytest.raises(RuntimeError, match="model failed"):
        render_pass([batch(["ep1"] * 4), batch(["ep1"] * 4, 4)], predict, renderer)
    assert list(tmp_path.iterdir()) == []


def test_pass_renderer_enforces_its_cap_and_writes_only_on_rank_zero(tmp_path: Path,
                                                                    as_rank: Any) -> None:
    renderer = PassRenderer(tmp_path, 0, [episode("ep1")], max_batches=1, camera_key="cam",
                            action_key="act")
    with pytest.raises(VideoConfigError, match="capped at max_batches=1"), renderer:
        renderer.add(batch(["ep1"]))
        renderer.add(batch(["ep1"], 1))
    assert list(tmp_path.iterdir()) == []
    as_rank(1)
    with PassRenderer(tmp_path, 0, [episode("ep1")], max_batches=1, camera_key="cam",
                      action_key="act") as other:
        other.add(batch(["ep1"]))
        other.add(batch(["ep1"], 1))  # not even counted: rank 1 renders nothing
    assert other.paths == []
    assert list(tmp_path.iterdir()) == []


# -- projection ------------------------------------------------------------------------------


def test_intrinsics_from_the_episode_or_the_default_pinhole() -> None:
    assert np.array_equal(intrinsics({"intrinsics": K}, 64, 48), np.array(K))
    f = DEFAULT_FOCAL_PER_WIDTH * 640
    default = np.array([[f, 0, 320], [0, f, 180], [0, 0, 1]])
    assert np.array_equal(intrinsics({}, 640, 360), default)
    assert np.array_equal(intrinsics({"intrinsics": np.zeros((3, 3))}, 640, 360), default)
    assert np.array_equal(intrinsics({"intrinsics": "none"}, 640, 360), default)
    uv, front = project(np.array([[0.1, -0.05, 1.0], [0.0, 0.0, 2.0], [0.1, 0.1, -1.0]]),
                        default)
    assert np.allclose(uv[:2], [[f * 0.1 + 320, 180 - f * 0.05], [320, 180]])
    assert front.tolist() == [True, True, False]


def test_overlays_project_with_the_episode_intrinsics_when_present() -> None:
    attrs = {"plain": {}, "calibrated": {"intrinsics": K}}
    images = dict(batch_overlays(batch(["plain", "calibrated"]), attrs, camera_key="cam",
                                 action_key="act", pred=None))
    plain, calibrated = (np.asarray(images[h]) for h in ("plain", "calibrated"))
    # Default pinhole: the principal point is the centre (32, 24); K puts it at (12, 36).
    for img, (u, v), (u_off, v_off) in ((plain, (32, 24), (12, 36)),
                                        (calibrated, (12, 36), (32, 24))):
        r, g, b = (int(c) for c in img[v, u])
        assert g > 100 and g > r + 50 and g > b + 50, (u, v, img[v, u])  # a green GT dot
        assert img[v_off, u_off].max() == 0  # and nothing where the other camera would put it


def test_a_caption_keeps_a_visible_gap_for_every_space() -> None:
    """The demo's sheet once read "letgoof the cup": the caption font must leave gaps
    between words clearly wider than those between letters."""
    img = Image.new("RGB", (300, 20))
    caption(ImageDraw.Draw(img), "let go of the cup", img.width)
    ink = (np.asarray(img.convert("L"))[:18] > 100).any(axis=0)
    xs = np.flatnonzero(ink)
    gaps, run = [], 0
    for lit in ink[xs[0]:xs[-1] + 1]:
        if lit:
            gaps, run = gaps + ([run] if run else []), 0
        else:
            run += 1
    assert sum(g >= 4 for g in gaps) == "let go of the cup".count(" "), gaps
