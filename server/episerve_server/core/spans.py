"""Annotation spans (docs/KEYMAP.md): parsing, texts at a frame, the action-chunk cutoff.

Elements come from a dataset nobody vetted, so parsing is bounded: at most ``MAX_SPANS``
elements per array (the decoder already bounds each one by ``max_item_bytes``), JSON nested
too deeply or that is not an object is ``DataLossError`` naming the episode, the key and the
element, and start/end values are clamped to +-2**62 so no later arithmetic can overflow.
Lookups are vectorized over the spans, so a long list costs numpy time, not Python loops.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from episerve_proto.errors import DataLossError

MAX_SPANS = 1 << 16  # elements of one annotations array
MAX_ANNOTATION_BYTES = 64 << 20  # decoded elements of one annotations array, in all
_FAR = 1 << 62  # |start|, |end| beyond this are clamped: every frame is far below it
_BLOCK = 1 << 20  # samples x spans compared at once


@dataclass(frozen=True, slots=True)
class Span:
    text: str
    start: int
    end: int


def parse_spans(episode: str, key: str, items: list[bytes]) -> list[Span]:
    """The valid spans of ``items``, in listed order (runs in a worker thread)."""
    if len(items) > MAX_SPANS:
        raise _loss(episode, key, f"holds {len(items)} elements, more than {MAX_SPANS}")
    spans = []
    for n, item in enumerate(items):
        if not item:
            continue
        span = _parse_one(episode, key, n, item)
        if span.start >= 0 and span.end > span.start:
            spans.append(span)
    return spans


def _parse_one(episode: str, key: str, n: int, item: bytes) -> Span:
    what = f"element {n} is not an annotation {{text, start_idx, end_idx}}"
    try:
        doc = json.loads(bytes(item).decode("utf-8"))
        if not isinstance(doc, dict):
            raise TypeError(f"a JSON {type(doc).__name__}, expected an object")
        return Span(str(doc["text"]), _clamp(int(doc["start_idx"])), _clamp(int(doc["end_idx"])))
    except RecursionError as exc:
        raise _loss(episode, key, f"element {n} is JSON nested too deeply") from exc
    except (ValueError, KeyError, TypeError, OverflowError) as exc:
        raise _loss(episode, key, f"{what} ({type(exc).__name__}: {_cut(exc)})") from exc


def _clamp(value: int) -> int:
    return max(-_FAR, min(_FAR, value))


def _cut(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} chars)"


def _loss(episode: str, key: str, what: str) -> DataLossError:
    return DataLossError(f"episode {episode!r} key {key!r}: annotations {what}",
                         episode=episode, key=key)


def _last_containing(spans: list[Span], frames: np.ndarray) -> np.ndarray:
    """Per frame, the index of the last-listed span containing it, or -1."""
    out = np.full(len(frames), -1, np.int64)
    if not spans or not len(frames):
        return out
    start = np.array([s.start for s in spans], np.int64)
    end = np.array([s.end for s in spans], np.int64)
    order = np.arange(len(spans), dtype=np.int64)
    step = max(1, _BLOCK // len(spans))
    for lo in range(0, len(frames), step):
        f = frames[lo:lo + step, None]
        inside = (start[None, :] <= f) & (f < end[None, :])
        out[lo:lo + step] = np.where(inside, order[None, :], -1).max(axis=1)
    return out


def _by_episode(ep: np.ndarray) -> dict[int, np.ndarray]:
    return {int(e): np.flatnonzero(ep == e) for e in np.unique(ep)}


def texts_at(spans: list[list[Span]], ep: np.ndarray, frame: np.ndarray) -> list[list[str]]:
    out: list[list[str]] = [[] for _ in range(len(ep))]
    for e, where in _by_episode(ep).items():
        listed = spans[e]
        if not listed:
            continue
        start = np.array([s.start for s in listed], np.int64)
        end = np.array([s.end for s in listed], np.int64)
        for b in where.tolist():
            i = int(frame[b])
            hits = np.flatnonzero((start <= i) & (i < end)).tolist()
            out[b] = [listed[k].text for k in hits]
    return out


def cutoff_ends(spans: list[list[Span]], ep: np.ndarray, frame: np.ndarray,
                total: np.ndarray) -> np.ndarray:
    """End of the last-listed span containing each frame; ``total`` where none does."""
    out = total.copy()
    for e, where in _by_episode(ep).items():
        last = _last_containing(spans[e], np.asarray(frame, np.int64)[where])
        ends = np.array([s.end for s in spans[e]] or [0], np.int64)
        hit = last >= 0
        out[where[hit]] = ends[last[hit]]
    return out
