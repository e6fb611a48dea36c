"""The demo dataset: written once under a root that holds no episodes yet (``episerve
serve`` with the default root, ``episerve demo``)."""

from __future__ import annotations

from pathlib import Path

#: Episodes of the demo dataset (and the default of ``episerve make-dataset``).
DEMO_EPISODES = 24


def ensure_demo_dataset(root: str | Path, episodes: int = DEMO_EPISODES) -> Path:
    """Write the demo dataset under ``root`` unless it already holds episodes."""
    path = Path(root)
    if not any(path.glob("*.zarr")):
        from episerve_tools.synth.writer import make_dataset  # the synth extra, when needed

        print(f"writing a demo dataset of {episodes} episodes to {path}", flush=True)
        make_dataset(path, episodes=episodes, seed=0, min_frames=120, max_frames=400)
    return path
