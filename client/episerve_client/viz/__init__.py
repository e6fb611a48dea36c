"""Validation video on rank 0 only: the gate, the renderer, the mp4 writer.

Import from here: ``from episerve_client.viz import VizGatedLoader, PassRenderer, ...``. The
Lightning adapter is ``episerve_client.viz.lightning`` (it needs the ``lightning`` extra).
"""

from __future__ import annotations

from episerve_client.viz.gate import (
    EpochSchedule,
    VideoConfigError,
    VizGatedLoader,
    check_viz_config,
    global_rank,
    renders_on_epoch,
    video_loader,
)
from episerve_client.viz.mp4 import VideoWriter, write_video
from episerve_client.viz.render import PassRenderer, render_pass, video_path

__all__ = [
    "EpochSchedule", "PassRenderer", "VideoConfigError", "VideoWriter", "VizGatedLoader",
    "check_viz_config", "global_rank", "render_pass", "renders_on_epoch", "video_loader",
    "video_path", "write_video",
]
