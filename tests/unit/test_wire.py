"""The hand-written ReadResponse encoder against messages built with the generated class."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from episerve_proto.v1 import episerve_pb2 as pb
from episerve_server.core.result import BatchResult, ImageColumn
from episerve_server.rpc.wire import encode
from tests.support.keymaps import BATCH, KEYMAPS
from tests.support.profiles import scaled


def reference(result: BatchResult) -> Any:
    msg = pb.ReadResponse(episodes=result.episodes, frame_index=result.frame_index.tolist(),
                          fps=result.fps.tolist(), embodiments=result.embodiments)
    for name, arr in result.arrays.items():
        msg.arrays.add(name=name, dtype=arr.dtype.str, shape=arr.shape, data=arr.tobytes())
    for name, col in result.images.items():
        msg.images.add(name=name, source=col.source, shape=col.index.shape,
                       index=col.index.astype("<i4").tobytes())
    for key, frames in result.frames.items():
        msg.frames.add(key=key, frames=frames)
    for name, per_sample in result.texts.items():
        column = msg.texts.add(name=name)
        for texts in per_sample:
            column.samples.add(texts=texts)
    if result.total_frames is not None:
        msg.total_frames.extend(result.total_frames.tolist())
    return msg


def test_planner_results_encode_like_the_generated_class(ramp_served: dict[Any, Any]) -> None:
    served = ramp_served["sharded", True]
    for name in ("mecka_keypoints_k4", "camera_history", "annotations"):
        result = served.read(KEYMAPS[name], BATCH)
        assert pb.ReadResponse.FromString(encode.encode_result(result)) == reference(result)


def test_all_masks_results_encode_like_the_generated_class(ramp_served: dict[Any, Any]) -> None:
    served = ramp_served["sharded", True]
    for name in ("mecka_keypoints_k4", "camera_history", "offsets"):
        result = served.read(KEYMAPS[name], BATCH, all_masks=True)
        assert result.total_frames is not None
        assert any(a.dtype == np.bool_ for a in result.arrays.values())
        parsed = pb.ReadResponse.FromString(encode.encode_result(result))
        assert parsed == reference(result)
        assert list(parsed.total_frames) == result.total_frames.tolist()


def test_default_responses_are_byte_for_byte_without_the_masks(
        ramp_served: dict[Any, Any]) -> None:
    """all_masks only adds: dropping its extras gives the default response's very bytes."""
    served = ramp_served["sharded", True]
    for name in ("mecka_keypoints_k4", "offsets"):
        plain = served.read(KEYMAPS[name], BATCH)
        assert plain.total_frames is None
        assert not any(k.endswith("_is_pad") for k in plain.arrays)
        full = served.read(KEYMAPS[name], BATCH, all_masks=True)
        stripped = dataclasses.replace(
            full, total_frames=None,
            arrays={k: v for k, v in full.arrays.items() if not k.endswith("_is_pad")})
        assert encode.encode_result(stripped) == encode.encode_result(plain)
        assert b"_is_pad" not in encode.encode_result(plain)


texts = st.lists(st.lists(st.text(max_size=20), max_size=3))


@settings(max_examples=scaled(150), deadline=None)
@given(b=st.integers(1, 6), w=st.integers(1, 5), names=st.lists(st.text(min_size=1,
       max_size=12), min_size=1, max_size=3, unique=True), data=st.data())
def test_random_results_encode_like_the_generated_class(b: int, w: int, names: list[str],
                                                        data: st.DataObject) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    frames = [rng.bytes(data.draw(st.integers(0, 300))) for _ in range(data.draw(
        st.integers(1, 4)))]
    result = BatchResult(
        episodes=[data.draw(st.text(max_size=8)) for _ in range(b)],
        frame_index=rng.integers(0, 2**40, size=b),
        fps=rng.random(b).astype(np.float32) * 60,
        embodiments=[data.draw(st.text(max_size=8)) for _ in range(b)],
        arrays={n: rng.standard_normal((b, w, 3)).astype(np.float32) for n in names},
        images={"cam": ImageColumn("src", rng.integers(0, len(frames), (b, w)).astype(np.int32))},
        frames={"src": frames},
        texts={"t": [data.draw(st.lists(st.text(max_size=20), max_size=3)) for _ in range(b)]},
        total_frames=rng.integers(1, 10**8, size=b) if data.draw(st.booleans()) else None,
    )
    if data.draw(st.booleans()):
        result.arrays["x_is_pad"] = rng.random((b, w)) < 0.5
    assert pb.ReadResponse.FromString(encode.encode_result(result)) == reference(result)


def test_varint_matches_protobuf() -> None:
    for n in (0, 1, 127, 128, 300, 2**31, 2**63 - 1, -1):
        msg = pb.ReadResponse(frame_index=[n])
        assert msg.SerializeToString() == b"\x12" + encode.varint(len(encode.varint(n))) + \
            encode.varint(n)


@settings(max_examples=scaled(200), deadline=None)
@given(st.lists(st.one_of(st.integers(0, 300), st.integers(-2**63, 2**63 - 1)), max_size=40))
def test_packed_varints_match_protobuf(values: list[int]) -> None:
    """The numpy varint encoder, one byte to ten (negatives), against protobuf's packing."""
    body = encode.varints(np.array(values, np.int64))
    assert body == b"".join(encode.varint(v) for v in values)
    msg = pb.ReadResponse(frame_index=values)
    expect = msg.SerializeToString()
    assert expect == (b"\x12" + encode.varint(len(body)) + body if values else b"")


def test_the_read_accounting_uses_the_parse_the_handler_made() -> None:
    from episerve_server.rpc.wire import messages

    req = pb.ReadRequest(episodes=["ep000a", "ep001b", "ep000a"], frames=[0, 5, 9],
                         keymap_id="k")
    data = req.SerializeToString()
    limits = messages.Limits(max_batch=256, max_keymap_entries=64, max_keymap_bytes=1 << 20)
    messages.parse_read(data, limits)
    # what the handler parsed counts: the bytes are not parsed again
    assert messages.read_samples_seen(b"not a read request") == 3
    # read once: a call the handler never parsed is parsed for its count
    assert messages.read_samples_seen(data) == 3
    assert messages.read_samples_seen(b"\xff") == 0


def test_varints_from_the_table_the_vectorized_loop_and_the_kernel_agree() -> None:
    """Every way the encoder writes packed varints (the table join and the vectorized loop
    in numpy, the compiled loop when built) against one value at a time."""
    from episerve_server.core import kernel
    from episerve_server.rpc.wire.loops import WireLoops

    rng = np.random.default_rng(5)
    cases = [rng.integers(0, top, 300).astype(np.int64) for top in (0x80, 0x4000, 1 << 16)]
    cases += [np.array([0x7F, 0x80, 0xFFFF], np.int64), np.zeros(0, np.int64),
              rng.integers(-2**63, 2**63 - 1, 50, dtype=np.int64),
              np.array([-1, 0, 2**63 - 1, -2**63, 1 << 35], np.int64)]
    for v in cases:
        want = b"".join(encode.varint(x) for x in v.tolist())
        for compiled in (False, True) if kernel.BUILT else (False,):
            loops = WireLoops(compiled)
            assert encode.varints(v, loops) == loops.varints(v) == want, (compiled, v[:5])
    assert encode.varints(np.array([0x7F, 0x80, 0xFFFF], np.int64)) == b"\x7f\x80\x01\xff\xff\x03"


@settings(max_examples=scaled(100), deadline=None)
@given(b=st.integers(1, 40), n_frames=st.integers(0, 60), seed=st.integers(0, 2**32 - 1),
       pool=st.lists(st.lists(st.text(max_size=12), max_size=3), min_size=1, max_size=3))
def test_the_local_plane_s_metadata_and_blobs_encode_like_the_generated_class(
        b: int, n_frames: int, seed: int, pool: list[list[str]]) -> None:
    # Samples share texts (as a run of frames between span boundaries does) and the frames'
    # bytes go to the sink: the message keeps every field, the bulk ones empty.
    rng = np.random.default_rng(seed)
    frames = [rng.bytes(int(rng.integers(0, 200))) for _ in range(n_frames)]
    result = BatchResult(
        episodes=[f"e{int(i)}" for i in rng.integers(0, 4, b)],
        frame_index=rng.integers(0, 2**20, size=b), fps=np.full(b, 30, np.float32),
        embodiments=["m"] * b, arrays={"x": rng.standard_normal((b, 2)).astype(np.float32)},
        images={"cam": ImageColumn("src", rng.integers(0, max(n_frames, 1), b).astype(np.int32))},
        frames={"src": frames},
        texts={"t": [pool[int(i)] for i in rng.integers(0, len(pool), b)]},
        total_frames=None)
    blobs: list[encode.Buf] = []
    meta = encode.encode_result(result, blobs)
    emptied = dataclasses.replace(
        result, arrays={"x": np.empty((b, 0), np.float32)},
        images={"cam": ImageColumn("src", np.empty((b, 0), np.int32))},
        frames={"src": [b""] * n_frames})
    expected = reference(emptied)
    expected.arrays[0].shape[:] = [b, 2]
    expected.images[0].shape[:] = [b]
    assert pb.ReadResponse.FromString(meta) == expected
    assert [bytes(x) for x in blobs] == [result.arrays["x"].tobytes(),
                                         result.images["cam"].index.tobytes(), *frames]
    assert pb.ReadResponse.FromString(encode.encode_result(result)) == reference(result)


def test_memos_stay_right_when_full_and_cleared(monkeypatch: Any) -> None:
    """The kept encodings (episode hashes, embodiments, a sample's texts) are bounded: with
    room for three entries or 64 bytes they are cleared again and again, and every answer
    still parses as the generated class writes it."""
    monkeypatch.setattr(encode, "MAX_MEMO", 3)
    monkeypatch.setattr(encode, "MAX_MEMO_BYTES", 64)
    monkeypatch.setattr(encode, "_STRINGS", {})  # (what earlier tests kept is not this one's)
    monkeypatch.setattr(encode, "_SAMPLE_TEXTS", encode._Memo(encode._sample_texts))
    rng = np.random.default_rng(5)
    for _ in range(40):
        b = int(rng.integers(1, 9))
        result = BatchResult(
            episodes=[f"ep{rng.integers(0, 12)}" for _ in range(b)],
            frame_index=rng.integers(0, 500, size=b), fps=np.full(b, 30, np.float32),
            embodiments=[f"robot{rng.integers(0, 4)}" for _ in range(b)], arrays={},
            images={}, frames={},
            texts={"t": [[f"text {rng.integers(0, 9)}" * int(rng.integers(1, 6))
                          for _ in range(int(rng.integers(0, 3)))] for _ in range(b)]})
        assert pb.ReadResponse.FromString(encode.encode_result(result)) == reference(result)
        kept = encode._SAMPLE_TEXTS
        assert len(kept) <= 3
        assert kept.nbytes <= 64 or len(kept) == 1  # one entry over the bound stays alone
        assert kept.nbytes <= 64  # (an entry over the bound is not kept at all)
        assert kept.nbytes == sum(map(len, kept.values()))
    assert all(len(memo) <= 3 for memo in encode._STRINGS.values())
