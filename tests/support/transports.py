"""One conformance suite for every way a read reaches the daemon and comes back.

In the manner of the reader suite (``tests/support/readers.py``): a test class subclasses
:class:`TransportTests`, provides the ``target`` fixture (a daemon over the sharded ramp
dataset) and says which ``TRANSPORT`` the client asks for, or overrides ``read`` for a path
that is not a client's (the front answering a forwarded Read). Every test of the suite then
reads through that path and compares the answer with the planner's own, in this process,
over the same root: the planner is held to the oracle once, by ``tests/unit/test_planner.py``,
and each transport only to the planner, on a small fixed set.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from episerve_client import errors
from tests.support.daemons import sample_of
from tests.support.keymaps import BATCH, KEYMAPS
from tests.support.served import Served, assert_same_sample

#: Numeric windows with masks, LeRobot offsets with annotations cut off, camera history.
CASES = [("mecka_keypoints_k4", False), ("offsets", True), ("camera_history", False)]
CAMERA_ONLY = {"front": {"zarr_key": "images.front_1", "key_type": "camera_keys"}}


class TransportTests:
    TRANSPORT: ClassVar[str] = "grpc"

    @pytest.fixture
    def target(self) -> str:
        raise NotImplementedError

    @pytest.fixture
    def planner(self, ramp_served: dict[tuple[str, bool | str], Served]) -> Served:
        return ramp_served[("sharded", False)]

    @pytest.fixture
    def client(self, target: str, make_client: Any) -> Any:
        """The sync or the async client on ``TRANSPORT``."""
        return make_client(target, transport=self.TRANSPORT)

    def read(self, client: Any, target: str, keymap: dict[str, Any],
             samples: list[tuple[str, int]], cutoff: bool = False,
             all_masks: bool = False) -> Any:
        return client.read(keymap, samples, annotation_cutoff=cutoff, all_masks=all_masks)

    def _assert_planners(self, got: Any, planner: Served, keymap: dict[str, Any],
                         cutoff: bool, all_masks: bool = False) -> None:
        want = planner.read(keymap, BATCH, cutoff=cutoff, all_masks=all_masks)
        assert len(got) == len(want) == len(BATCH)
        for b, sample in enumerate(BATCH):
            assert_same_sample(sample_of(got, b), want.sample(b), (self.TRANSPORT, b, sample))

    @pytest.mark.parametrize(("name", "cutoff"), CASES)
    def test_a_read_is_the_planners_answer(self, name: str, cutoff: bool, target: str,
                                           planner: Served, client: Any) -> None:
        got = self.read(client, target, KEYMAPS[name], BATCH, cutoff)
        self._assert_planners(got, planner, KEYMAPS[name], cutoff)

    def test_every_mask_is_the_planners(self, target: str, planner: Served,
                                        client: Any) -> None:
        keymap = KEYMAPS["offsets"]
        got = self.read(client, target, keymap, BATCH, True, all_masks=True)
        self._assert_planners(got, planner, keymap, True, all_masks=True)

    def test_a_missing_episode_is_typed_naming_it(self, target: str, client: Any) -> None:
        with pytest.raises(errors.EpisodeNotFound) as info:
            self.read(client, target, CAMERA_ONLY, [("ep999z", 0)])
        assert "'ep999z'" in str(info.value)
