"""Everything the daemon and the client must agree on, besides the messages themselves.

Plain constants (and a helper that suggests near misses of them): importing this module
imports neither grpc nor protobuf. A unit test checks the names below against the generated
descriptor of ``episerve/v1/episerve.proto``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

PACKAGE = "episerve.v1"
SERVICE_NAME = f"{PACKAGE}.EpiServe"
#: The prefix of every method path: ``SERVICE_PATH + "Read"``.
SERVICE_PATH = f"/{SERVICE_NAME}/"
METHODS = ("ListEpisodes", "RegisterKeymap", "Read", "GetStats", "GetKeyStats", "GetTopology")

#: Trailers of an error answer: the error's class name, then the episode and the key (UTF-8).
ERROR_TRAILER = "episerve-error"
EPISODE_TRAILER = "episerve-episode-bin"
KEY_TRAILER = "episerve-key-bin"

#: The fields of one keymap entry besides its output name (``KeySpec`` in the proto).
KEYMAP_FIELDS = ("zarr_key", "key_type", "horizon", "history", "history_stride",
                 "history_stride_s", "lag_s", "offsets_s")
#: The optional (scalar) window fields among them, in proto order.
WINDOW_FIELDS = KEYMAP_FIELDS[2:7]
#: The list-valued window fields (repeated in the proto: an empty list is no list).
LIST_FIELDS = KEYMAP_FIELDS[7:]
#: Output names the daemon adds with ``all_masks``: ``<output key>_is_pad`` per windowed
#: output, and ``total_frames`` per sample.
IS_PAD_SUFFIX = "_is_pad"
TOTAL_FRAMES = "total_frames"
#: Output names the daemon adds to every answer (float32, 1 where a row is real): the first
#: action entry's window mask, the first proprio entry's, and ``<camera output>_mask`` per
#: camera output with a history.
ACTION_MASK, PROPRIO_MASK = "action_pad_mask", "proprio_history_mask"
CAMERA_MASK_SUFFIX = "_mask"
#: The values of ``key_type``: which window rules an entry can take (docs/KEYMAP.md).
KEY_TYPES = ("camera_keys", "proprio_keys", "action_keys", "annotation_keys", "metadata_keys")
CAMERA_KEYS, PROPRIO_KEYS, ACTION_KEYS, ANNOTATION_KEYS, METADATA_KEYS = KEY_TYPES
#: Field names users of other loaders reach for, and the field that does that job here.
FIELD_ALIASES: Mapping[str, str] = MappingProxyType({
    "delta_timestamps": "offsets_s", "offsets": "offsets_s", "chunk_size": "horizon",
    "n_obs_steps": "history", "key": "zarr_key", "type": "key_type"})
#: The longest window (``horizon``, ``history``, entries of ``offsets_s``) and stride.
MAX_WINDOW = 4096
#: The largest offset (``offsets_s``), lag or stride, in seconds.
MAX_SECONDS = 3600.0


def did_you_mean(word: str, choices: tuple[str, ...] | list[str]) -> str:
    """``"; did you mean 'horizon'?"`` for a near miss of one of ``choices``, else ``""``."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


#: The largest message either side sends or receives.
MAX_MESSAGE_BYTES = 256 * 2**20
#: The largest request the daemon accepts (a Read of the largest batch fits easily).
MAX_REQUEST_BYTES = 8 * 2**20
#: The most frames (rows) one episode may have: the daemon refuses an episode whose
#: ``total_frames`` is larger, and the client refuses a manifest entry or a response that
#: gives one. Far above real data, far below 2**31.
MAX_EPISODE_FRAMES = 10**8
#: The most samples (frames summed over its episodes) one manifest may hold: a sampler's
#: epoch order is 8 bytes per sample, so this bound keeps it within 8 GB.
MAX_MANIFEST_FRAMES = 10**9
#: The most texts (annotation strings, over every text column) the client accepts in one
#: Read response; more are refused before any is turned into a Python string.
MAX_RESPONSE_TEXTS = 1 << 18
#: The most JPEG frames (over every camera key) the client accepts in one Read response.
MAX_RESPONSE_FRAMES = 1 << 18
#: Episode ids one ListEpisodes request may name in ``hashes``, and the bytes they may take
#: on the wire (each id's UTF-8 bytes plus ``LIST_HASH_OVERHEAD``); the client sends a
#: longer filter as several requests within both. A request over the bytes is refused
#: before it is parsed.
MAX_LIST_HASHES = 65536
MAX_LIST_FILTER_BYTES = 1 << 20
LIST_HASH_OVERHEAD = 3  # the field's tag and a length of up to 2 bytes
#: The longest episode id, output key, zarr key or keymap id, in characters.
MAX_NAME_CHARS = 256
#: The daemon accepts keepalive pings this often at most; the client pings less often.
MIN_PING_INTERVAL_MS = 10_000
CLIENT_KEEPALIVE_MS = 30_000
#: An episode's attributes (and, apart, its features) over this many bytes of JSON are
#: listed as a marker instead: ``{TOO_LARGE_ATTR: "<why>", TOO_LARGE_BYTES_ATTR: size}``.
MAX_LISTED_ATTRS_BYTES = 64 * 2**10
TOO_LARGE_ATTR = "episerve.too_large"
TOO_LARGE_BYTES_ATTR = "episerve.bytes"
