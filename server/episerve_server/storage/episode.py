"""One opened episode as the catalog keeps it: its length, rate, attributes and readers.

Apart from the catalog so that what reads episodes (the planner, the read plan's
directory, the key checks) can name the type without importing the catalog.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from episerve_proto.episode_fields import EpisodeFacts
from episerve_server.core.spans import Span
from episerve_server.storage.readers import ChunkReader


@dataclass(slots=True)
class Episode(EpisodeFacts):
    attrs: dict[str, Any]
    readers: dict[str, ChunkReader]
    problems: dict[str, str] = field(default_factory=dict)
    #: Keys the source lists but does not serve, with why: unlike ``problems``, they leave
    #: the episode healthy (a replay buffer's one bad array is no reason to refuse every
    #: episode); a read naming one is refused with the reason.
    unserved: dict[str, str] = field(default_factory=dict)
    spans: dict[str, list[Span]] = field(default_factory=dict)
    content_hash: str = ""  # 16 hex digits over the group's attributes and array metadata
    fingerprint: str = ""  # what its files were when it was opened (see CountingStore)
    checked_at: float = 0.0  # when a failed read last had its files checked (monotonic)
    # Annotation loads in flight: concurrent first reads share one (single-flight).
    span_loads: dict[str, asyncio.Future[list[Span]]] = field(default_factory=dict)

    @property
    def features(self) -> dict[str, Any]:
        feats = self.attrs.get("features")
        return feats if isinstance(feats, dict) else {}

    def why_not(self, key: str) -> str | None:
        """Why ``key`` is not served ("" never; None when nothing says so)."""
        return self.problems.get(key) or self.unserved.get(key)

    def reason(self) -> str:
        return "; ".join(self.problems.values())
