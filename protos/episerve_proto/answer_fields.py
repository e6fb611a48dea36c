"""The Read answer, described once for every side that writes, walks or merges it: the
daemon's encoder (``episerve_server.rpc.wire.encode``), the front's merge
(``episerve_server.rpc.wire.forward``) and the client's wire walk and reader
(``episerve_client.answer_wire``, ``episerve_client.read_answer``).

Every number comes from the generated descriptor, never typed by hand. Each field of
``ReadResponse`` has a kind, which says how it is written and walked: a per-sample field is
one value per sample (``strings``, ``varints``, ``float32``); a column field is a repeated
message, one per output (``tensors``, ``images``, ``frames``, ``texts``). A field added to
``ReadResponse`` in ``episerve.proto`` without a kind here stops the import, so no side
can miss it. The bulk of an answer (each tensor's data, each image column's index, each
frame: in that order) is what the local plane sends apart from the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from episerve_proto.v1 import episerve_pb2 as pb

#: How each field of ``ReadResponse`` is written: the one place a new field is described.
KINDS = {
    "episodes": "strings",
    "frame_index": "varints",
    "fps": "float32",
    "embodiments": "strings",
    "arrays": "tensors",
    "images": "images",
    "frames": "frames",
    "texts": "texts",
    "total_frames": "varints",  # only with all_masks
}
PER_SAMPLE_KINDS = frozenset({"strings", "varints", "float32"})
#: Per-sample fields an answer may leave out (empty): the rest have one value per sample.
OPTIONAL = frozenset({"total_frames"})


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    number: int
    kind: str

    @property
    def per_sample(self) -> bool:
        return self.kind in PER_SAMPLE_KINDS


def numbers(message: Any) -> dict[str, int]:
    """A message's field numbers by name, from its descriptor."""
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


def _response() -> tuple[Field, ...]:
    fields = pb.ReadResponse.DESCRIPTOR.fields
    unknown = sorted({f.name for f in fields} - set(KINDS))
    if unknown or len(fields) != len(KINDS):
        raise ImportError(f"ReadResponse fields {unknown or sorted(KINDS)} have no kind in "
                          "episerve_proto.answer_fields.KINDS: describe them there")
    return tuple(sorted((Field(f.name, f.number, KINDS[f.name]) for f in fields),
                        key=lambda f: f.number))


#: Every field of ``ReadResponse`` in number order (the order protobuf writes them in).
RESPONSE = _response()
BY_NAME = {f.name: f for f in RESPONSE}
#: The per-sample fields, in number order.
PER_SAMPLE = tuple(f for f in RESPONSE if f.per_sample)
TENSOR = numbers(pb.Tensor)  # name, dtype, shape, data
IMAGE_COLUMN = numbers(pb.ImageColumn)  # name, source, shape, index
FRAME_SOURCE = numbers(pb.FrameSource)  # key, frames
TEXT_COLUMN = numbers(pb.TextColumn)  # name, samples
TEXTS = numbers(pb.Texts)  # texts
