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


def test_listed_names_whole_names_and_counts_the_rest() -> None:
    from episerve_proto.errors import listed

    names = [f"observation.key_{i:03d}" for i in range(40)]
    text = listed(names)
    assert text.startswith("'observation.key_000', 'observation.key_001', ")
    assert text.endswith("'observation.key_011' and 28 more")
    assert listed(["a", "b"]) == "'a', 'b'" and listed([]) == "none"


def test_both_result_classes_hold_every_field_of_the_answer_table() -> None:
    """The daemon's ``BatchResult`` and the client's ``ReadResult`` are the answer's field
    table (``episerve_proto.answer_fields``) in Python: a field described there and
    missing from either class (or the reverse) fails here, and the client's merge of
    several daemons' parts walks the table's per-sample fields."""
    import dataclasses

    from episerve_client.read_answer import ReadResult
    from episerve_proto.answer_fields import KINDS
    from episerve_server.core.result import BatchResult

    for cls in (BatchResult, ReadResult):
        assert {f.name for f in dataclasses.fields(cls)} == set(KINDS), cls
