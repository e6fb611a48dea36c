"""Keymaps and batches the suites share: the bundled keymaps' content, odd rules, and a
standard batch over the ramp dataset."""

from __future__ import annotations

from typing import Any

from tests.support import ramp

CAMERA = ramp.CAMERA_KEY
MECKA = list(ramp.MECKA_KEYS)
EPISODES = {h: (total, fps) for h, _, total, fps in ramp.RAMP_DATASET}


def e(zarr_key: str, key_type: str, **fields: Any) -> dict[str, Any]:
    return {"zarr_key": zarr_key, "key_type": key_type, **fields}


KEYMAPS: dict[str, dict[str, dict[str, Any]]] = {
    # the same content as client/episerve_client/keymaps/mecka_keypoints_k4.yaml
    "mecka_keypoints_k4": {
        "observations.images.front_img_1": e(CAMERA, "camera_keys"),
        "left.action_keypoints": e("left.obs_keypoints", "action_keys", horizon=30),
        "right.action_keypoints": e("right.obs_keypoints", "action_keys", horizon=30),
        "left.action_wrist_pose": e("left.obs_wrist_pose", "proprio_keys", horizon=30),
        "right.action_wrist_pose": e("right.obs_wrist_pose", "proprio_keys", horizon=30),
        "left.obs_keypoints": e("left.obs_keypoints", "proprio_keys", history=4),
        "right.obs_keypoints": e("right.obs_keypoints", "proprio_keys", history=4),
        "left.obs_wrist_pose": e("left.obs_wrist_pose", "proprio_keys", history=4),
        "right.obs_wrist_pose": e("right.obs_wrist_pose", "proprio_keys", history=4),
        "obs_head_pose": e("obs_head_pose", "proprio_keys"),
        "annotations": e("annotations", "annotation_keys"),
    },
    # the same content as client/episerve_client/keymaps/camera_history.yaml
    "camera_history": {
        "front": e(CAMERA, "camera_keys"),
        "front_hist": e(CAMERA, "camera_keys", lag_s=1.0),
        "front_mem": e(CAMERA, "camera_keys", history=4, history_stride_s=0.5),
        "head": e("obs_head_pose", "proprio_keys", history=3, history_stride=5),
        "actions": e("left.obs_wrist_pose", "action_keys", horizon=50),
    },
    "history_one": {
        "head": e("obs_head_pose", "proprio_keys", history=1),
        "cam": e(CAMERA, "camera_keys", history=1),
        "cam_lag": e(CAMERA, "camera_keys", history=1, lag_s=0.5),
        "wrist_lag": e("left.obs_wrist_pose", "proprio_keys", history=1, lag_s=0.2),
        "kp": e("left.obs_keypoints", "metadata_keys", history=1),
    },
    "annotations": {
        "task": e("annotations", "annotation_keys"),
        "act": e("left.obs_wrist_pose", "action_keys", horizon=20),
        "act_kp": e("right.obs_keypoints", "action_keys", horizon=7),
        "prop_chunk": e("right.obs_wrist_pose", "proprio_keys", horizon=20),
        "task_again": e("annotations", "annotation_keys"),
    },
    "lag_only": {
        "head_lag": e("obs_head_pose", "proprio_keys", lag_s=0.1),
        "cam_lag": e(CAMERA, "camera_keys", lag_s=1.0),
        "kp_lag": e("left.obs_keypoints", "metadata_keys", lag_s=0.5),
        "far_lag": e("right.obs_wrist_pose", "proprio_keys", lag_s=20.0),
    },
    "two_horizons": {
        "short": e("left.obs_wrist_pose", "action_keys", horizon=5),
        "long": e("left.obs_wrist_pose", "action_keys", horizon=60),
        "longer": e("right.obs_wrist_pose", "action_keys", horizon=120),
        "hist": e("left.obs_wrist_pose", "proprio_keys", history=6, history_stride=3),
        "cam_mem": e(CAMERA, "camera_keys", history=3, history_stride=40),
    },
    # Keymap rule 6 (LeRobot's delta_timestamps): past, future, beyond both ends, duplicates,
    # ties of round() at 15 and 25 fps, and camera offsets next to an action chunk and a history
    "offsets": {
        "state": e("obs_head_pose", "proprio_keys", offsets_s=[-0.5, -0.1, -1 / 30, 0.0]),
        "act": e("left.obs_wrist_pose", "action_keys", offsets_s=[0.0, 0.1, 0.2, 0.5, 9.0]),
        "act_chunk": e("left.obs_wrist_pose", "action_keys", horizon=12),
        "kp": e("left.obs_keypoints", "metadata_keys",
                offsets_s=[-20.0, 0.0, 0.0, 20.0, 0.05, -0.05]),
        "cam": e(CAMERA, "camera_keys", offsets_s=[-1.0, -0.5, 0.0, 0.5]),
        "cam_mem": e(CAMERA, "camera_keys", history=2, history_stride=20),
        "hist": e("right.obs_wrist_pose", "proprio_keys", history=3, lag_s=0.1),
        "task": e("annotations", "annotation_keys"),
    },
}
WITH_ANNOTATIONS = {"mecka_keypoints_k4", "annotations", "offsets"}
CASES = [(name, False) for name in KEYMAPS] + [
    ("mecka_keypoints_k4", True), ("annotations", True), ("two_horizons", True),
    ("offsets", True)]


def without_annotations(keymap: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in keymap.items() if v["key_type"] != "annotation_keys"}


def standard_batch() -> list[tuple[str, int]]:
    """Both ends and the middle of every episode, episodes interleaved, some repeated."""
    samples = [(h, f) for h, (total, _) in EPISODES.items()
               for f in sorted({0, 1, total // 2, total - 2, total - 1})]
    mixed = sorted(samples, key=lambda s: (s[1] % 7, s[0]))
    return [*mixed, ("ep003d", 0), mixed[0], ("ep003d", 128), ("ep003d", 128), mixed[-1]]


BATCH = standard_batch()
