"""The hand-written contract agrees with the proto it describes."""

from __future__ import annotations

from episerve_proto import contract
from episerve_proto.v1 import episerve_pb2 as pb


def test_service_name_and_methods_match_the_proto() -> None:
    service = pb.DESCRIPTOR.services_by_name["EpiServe"]
    assert service.full_name == contract.SERVICE_NAME
    assert tuple(m.name for m in service.methods) == contract.METHODS
    assert f"/{service.full_name}/" == contract.SERVICE_PATH


def test_keymap_fields_match_the_proto() -> None:
    fields = [f.name for f in pb.KeySpec.DESCRIPTOR.fields]
    assert fields[0] == "name"
    assert tuple(fields[1:]) == contract.KEYMAP_FIELDS
    optional = tuple(f.name for f in pb.KeySpec.DESCRIPTOR.fields if f.has_presence)
    assert optional == contract.WINDOW_FIELDS
    repeated = tuple(f.name for f in pb.KeySpec.DESCRIPTOR.fields if f.is_repeated)
    assert repeated == contract.LIST_FIELDS


def test_the_keepalive_interval_leaves_room() -> None:
    assert contract.CLIENT_KEEPALIVE_MS >= 2 * contract.MIN_PING_INTERVAL_MS


def test_a_declared_frame_size_is_three_positive_ints() -> None:
    size = contract.declared_frame_size
    assert size({"cam": {"dtype": "jpeg", "shape": [360, 640, 3]}}, "cam") == (360, 640)
    assert size({"cam": {"shape": (24, 32, 3)}}, "cam") == (24, 32)
    for bad in ([360, 640], [0, 640, 3], [True, 640, 3], [360.0, 640, 3], "360x640", None):
        assert size({"cam": {"shape": bad}}, "cam") is None, bad
    assert size({"cam": [360, 640, 3]}, "cam") is None and size({}, "cam") is None


def test_the_missing_array_reason_names_both_keys() -> None:
    assert contract.missing_array_reason("front", "images.front_1") == (
        "output key 'front': the episode has no array 'images.front_1'")
