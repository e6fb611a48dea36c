"""Write the synthetic episodes as a Diffusion Policy replay buffer (``episerve make-dataset
--layout replay``): one zarr format 2 group, as Diffusion Policy's ``ReplayBuffer`` writes it,
so the replay-buffer examples of the docs run on data this project makes.

- ``data/state`` (T, 14) float32: the two wrist poses; ``data/action`` the next frame's
  (the last frame repeats its own); both Blosc lz4, chunks of ``NUMERIC_CHUNK`` rows that
  do not line up with episodes;
- ``data/img`` (T, H, W, 3) uint8, one frame a chunk, JPEG 2000 (imagecodecs' codec, as
  Diffusion Policy stores camera frames);
- ``meta/episode_ends`` int64, the exclusive end row of each episode;
- the group's attribute ``fps``.

An ``out`` ending in ``.zip`` is written as a folder beside it and then zipped (members
stored, as zarr's ``ZipStore`` writes them). Episode ``i`` is the scene and motion of
episode ``i`` of the other layouts for the same ``seed``, rendered at ``size``.
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from episerve_tools.synth.scene import CAMERA_KEY, synth_episode

STATE_KEYS = ("left.obs_wrist_pose", "right.obs_wrist_pose")
NUMERIC_CHUNK = 1000
#: The frame size Diffusion Policy's image policies train on.
SIZE = (96, 96)


def write_replay_root(out: str | Path, *, episodes: int, seed: int = 0,
                      min_frames: int = 120, max_frames: int = 700, fps: int = 10,
                      size: tuple[int, int] = SIZE, progress: bool = True) -> Path:
    """Write ``episodes`` synthetic episodes as a replay buffer at ``out`` (a ``.zarr``
    folder, or a ``.zip`` file); returns it."""
    import numcodecs
    import simplejpeg
    import zarr
    from imagecodecs.numcodecs import Jpeg2k
    from tqdm import tqdm

    target = Path(out)
    folder = target.with_suffix("") if target.suffix == ".zip" else target
    if folder.exists():
        shutil.rmtree(folder)
    root = zarr.open_group(str(folder), mode="w", zarr_format=2)
    root.attrs["fps"] = fps
    data, meta = root.require_group("data"), root.require_group("meta")
    blosc = numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.NOSHUFFLE)
    h, w = size
    arrays: dict[str, Any] = {
        "state": data.create_array("state", shape=(0, 14), chunks=(NUMERIC_CHUNK, 14),
                                   dtype=np.float32, compressors=blosc, fill_value=0),
        "action": data.create_array("action", shape=(0, 14), chunks=(NUMERIC_CHUNK, 14),
                                    dtype=np.float32, compressors=blosc, fill_value=0),
        "img": data.create_array("img", shape=(0, h, w, 3), chunks=(1, h, w, 3),
                                 dtype=np.uint8, compressors=Jpeg2k(level=50),
                                 fill_value=0),
    }
    ends: list[int] = []
    total = 0
    for ep in tqdm(range(episodes), unit="episode", desc="writing", disable=not progress):
        rng = np.random.default_rng([seed, ep])
        n = int(rng.integers(min_frames, max_frames + 1))
        synth = synth_episode(rng, n, width=w, height=h, fps=fps)
        state = np.concatenate([synth.numeric[k] for k in STATE_KEYS], axis=1)
        values = {
            "state": state.astype(np.float32),
            "action": np.concatenate([state[1:], state[-1:]]).astype(np.float32),
            "img": np.stack([simplejpeg.decode_jpeg(j, colorspace="RGB")
                             for j in synth.jpeg[CAMERA_KEY]]),
        }
        for key, arr in arrays.items():
            arr.resize((total + n, *arr.shape[1:]))
            arr[total:total + n] = values[key]
        total += n
        ends.append(total)
    meta.create_array("episode_ends", data=np.array(ends, np.int64), compressors=None)
    return target if target == folder else zip_folder(folder, target)


def zip_folder(folder: Path, out: Path) -> Path:
    """A folder buffer as one zip file at ``out`` (members stored, as zarr's ``ZipStore``
    writes them); the folder is removed."""
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        for file in sorted(folder.rglob("*")):
            if file.is_file():
                zf.write(file, file.relative_to(folder).as_posix())
    shutil.rmtree(folder)
    return out
