"""What names an episode and times its frames, the same on both sides of the wire: the
daemon's opened ``Episode`` and the client's listed ``EpisodeInfo`` both start with these
fields (``ListEpisodes`` carries them from one to the other)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EpisodeFacts:
    hash: str  # the episode's id: its folder name under the root
    total_frames: int  # T, the number of frames
    fps: float
    embodiment: str
