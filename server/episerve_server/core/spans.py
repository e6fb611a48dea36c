"""Annotation spans (SPEC section 2): parsing, texts at a frame, the action-chunk cutoff."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from episerve_proto.errors import DataLossError


@dataclass(frozen=True, slots=True)
class Span:
    text: str
    start: int
    end: int


def parse_spans(episode: str, key: str, items: list[bytes]) -> list[Span]:
    spans = []
    for n, item in enumerate(items):
        if not item:
            continue
        try:
            doc = json.loads(bytes(item).decode("utf-8"))
            span = Span(str(doc["text"]), int(doc["start_idx"]), int(doc["end_idx"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise DataLossError(
                f"episode {episode!r} key {key!r}: element {n} is not an annotation "
                f"{{text, start_idx, end_idx}} ({type(exc).__name__}: {exc})",
                episode=episode, key=key,
            ) from exc
        if span.start >= 0 and span.end > span.start:
            spans.append(span)
    return spans


def texts_at(spans: list[list[Span]], ep: np.ndarray, frame: np.ndarray) -> list[list[str]]:
    return [
        [s.text for s in spans[e] if s.start <= i < s.end]
        for e, i in zip(ep.tolist(), frame.tolist())
    ]


def cutoff_ends(spans: list[list[Span]], ep: np.ndarray, frame: np.ndarray,
                total: np.ndarray) -> np.ndarray:
    """End of the last-listed span containing each frame; ``total`` where none does."""
    out = total.copy()
    for b, (e, i) in enumerate(zip(ep.tolist(), frame.tolist())):
        for s in reversed(spans[e]):
            if s.start <= i < s.end:
                out[b] = s.end
                break
    return out
