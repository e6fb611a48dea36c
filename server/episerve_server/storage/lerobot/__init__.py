"""LeRobot v3 datasets (parquet data, mp4 videos, ``meta/``) behind the same catalog and
planner as zarr episodes: :class:`~.source.LeRobotSource` opens each episode with chunk
readers of its own (:mod:`.readers`), over files kept open by :mod:`.files`."""
