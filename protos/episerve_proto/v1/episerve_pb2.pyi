from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KeySpec(_message.Message):
    __slots__ = ("name", "zarr_key", "key_type", "horizon", "history", "history_stride", "history_stride_s", "lag_s", "offsets_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ZARR_KEY_FIELD_NUMBER: _ClassVar[int]
    KEY_TYPE_FIELD_NUMBER: _ClassVar[int]
    HORIZON_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    HISTORY_STRIDE_FIELD_NUMBER: _ClassVar[int]
    HISTORY_STRIDE_S_FIELD_NUMBER: _ClassVar[int]
    LAG_S_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    zarr_key: str
    key_type: str
    horizon: int
    history: int
    history_stride: int
    history_stride_s: float
    lag_s: float
    offsets_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, name: _Optional[str] = ..., zarr_key: _Optional[str] = ..., key_type: _Optional[str] = ..., horizon: _Optional[int] = ..., history: _Optional[int] = ..., history_stride: _Optional[int] = ..., history_stride_s: _Optional[float] = ..., lag_s: _Optional[float] = ..., offsets_s: _Optional[_Iterable[float]] = ...) -> None: ...

class Keymap(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[KeySpec]
    def __init__(self, entries: _Optional[_Iterable[_Union[KeySpec, _Mapping]]] = ...) -> None: ...

class RegisterKeymapRequest(_message.Message):
    __slots__ = ("keymap", "check_episodes")
    KEYMAP_FIELD_NUMBER: _ClassVar[int]
    CHECK_EPISODES_FIELD_NUMBER: _ClassVar[int]
    keymap: Keymap
    check_episodes: bool
    def __init__(self, keymap: _Optional[_Union[Keymap, _Mapping]] = ..., check_episodes: bool = ...) -> None: ...

class KeymapProblem(_message.Message):
    __slots__ = ("episode", "reason", "key")
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    episode: str
    reason: str
    key: str
    def __init__(self, episode: _Optional[str] = ..., reason: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class FrameSizeGroup(_message.Message):
    __slots__ = ("key", "height", "width", "episodes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    key: str
    height: int
    width: int
    episodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, key: _Optional[str] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., episodes: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterKeymapResponse(_message.Message):
    __slots__ = ("keymap_id", "checked", "episodes_checked", "problems", "frame_sizes")
    KEYMAP_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    EPISODES_CHECKED_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    FRAME_SIZES_FIELD_NUMBER: _ClassVar[int]
    keymap_id: str
    checked: bool
    episodes_checked: int
    problems: _containers.RepeatedCompositeFieldContainer[KeymapProblem]
    frame_sizes: _containers.RepeatedCompositeFieldContainer[FrameSizeGroup]
    def __init__(self, keymap_id: _Optional[str] = ..., checked: bool = ..., episodes_checked: _Optional[int] = ..., problems: _Optional[_Iterable[_Union[KeymapProblem, _Mapping]]] = ..., frame_sizes: _Optional[_Iterable[_Union[FrameSizeGroup, _Mapping]]] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("keymap", "keymap_id", "episodes", "frames", "annotation_cutoff", "max_response_bytes", "all_masks", "prefetch")
    KEYMAP_FIELD_NUMBER: _ClassVar[int]
    KEYMAP_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    ANNOTATION_CUTOFF_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALL_MASKS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    keymap: Keymap
    keymap_id: str
    episodes: _containers.RepeatedScalarFieldContainer[str]
    frames: _containers.RepeatedScalarFieldContainer[int]
    annotation_cutoff: bool
    max_response_bytes: int
    all_masks: bool
    prefetch: Samples
    def __init__(self, keymap: _Optional[_Union[Keymap, _Mapping]] = ..., keymap_id: _Optional[str] = ..., episodes: _Optional[_Iterable[str]] = ..., frames: _Optional[_Iterable[int]] = ..., annotation_cutoff: bool = ..., max_response_bytes: _Optional[int] = ..., all_masks: bool = ..., prefetch: _Optional[_Union[Samples, _Mapping]] = ...) -> None: ...

class Samples(_message.Message):
    __slots__ = ("episodes", "frames")
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    episodes: _containers.RepeatedScalarFieldContainer[str]
    frames: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, episodes: _Optional[_Iterable[str]] = ..., frames: _Optional[_Iterable[int]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ImageColumn(_message.Message):
    __slots__ = ("name", "source", "shape", "index")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    index: bytes
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., index: _Optional[bytes] = ...) -> None: ...

class FrameSource(_message.Message):
    __slots__ = ("key", "frames")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    key: str
    frames: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, key: _Optional[str] = ..., frames: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Texts(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...

class TextColumn(_message.Message):
    __slots__ = ("name", "samples")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    name: str
    samples: _containers.RepeatedCompositeFieldContainer[Texts]
    def __init__(self, name: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[Texts, _Mapping]]] = ...) -> None: ...

class ReadResponse(_message.Message):
    __slots__ = ("episodes", "frame_index", "fps", "embodiments", "arrays", "images", "frames", "texts", "total_frames")
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    EMBODIMENTS_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FRAMES_FIELD_NUMBER: _ClassVar[int]
    episodes: _containers.RepeatedScalarFieldContainer[str]
    frame_index: _containers.RepeatedScalarFieldContainer[int]
    fps: _containers.RepeatedScalarFieldContainer[float]
    embodiments: _containers.RepeatedScalarFieldContainer[str]
    arrays: _containers.RepeatedCompositeFieldContainer[Tensor]
    images: _containers.RepeatedCompositeFieldContainer[ImageColumn]
    frames: _containers.RepeatedCompositeFieldContainer[FrameSource]
    texts: _containers.RepeatedCompositeFieldContainer[TextColumn]
    total_frames: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, episodes: _Optional[_Iterable[str]] = ..., frame_index: _Optional[_Iterable[int]] = ..., fps: _Optional[_Iterable[float]] = ..., embodiments: _Optional[_Iterable[str]] = ..., arrays: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., images: _Optional[_Iterable[_Union[ImageColumn, _Mapping]]] = ..., frames: _Optional[_Iterable[_Union[FrameSource, _Mapping]]] = ..., texts: _Optional[_Iterable[_Union[TextColumn, _Mapping]]] = ..., total_frames: _Optional[_Iterable[int]] = ...) -> None: ...

class ListEpisodesRequest(_message.Message):
    __slots__ = ("page_token", "page_size", "brief", "hashes")
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    BRIEF_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    page_token: str
    page_size: int
    brief: bool
    hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, page_token: _Optional[str] = ..., page_size: _Optional[int] = ..., brief: bool = ..., hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class EpisodeInfo(_message.Message):
    __slots__ = ("hash", "total_frames", "fps", "embodiment", "features_json", "attrs_json", "arrays", "content_hash")
    HASH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    EMBODIMENT_FIELD_NUMBER: _ClassVar[int]
    FEATURES_JSON_FIELD_NUMBER: _ClassVar[int]
    ATTRS_JSON_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    hash: str
    total_frames: int
    fps: float
    embodiment: str
    features_json: str
    attrs_json: str
    arrays: _containers.RepeatedScalarFieldContainer[str]
    content_hash: str
    def __init__(self, hash: _Optional[str] = ..., total_frames: _Optional[int] = ..., fps: _Optional[float] = ..., embodiment: _Optional[str] = ..., features_json: _Optional[str] = ..., attrs_json: _Optional[str] = ..., arrays: _Optional[_Iterable[str]] = ..., content_hash: _Optional[str] = ...) -> None: ...

class BrokenEpisode(_message.Message):
    __slots__ = ("hash", "reason")
    HASH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    hash: str
    reason: str
    def __init__(self, hash: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ListEpisodesResponse(_message.Message):
    __slots__ = ("episodes", "broken", "next_page_token")
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    BROKEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    episodes: _containers.RepeatedCompositeFieldContainer[EpisodeInfo]
    broken: _containers.RepeatedCompositeFieldContainer[BrokenEpisode]
    next_page_token: str
    def __init__(self, episodes: _Optional[_Iterable[_Union[EpisodeInfo, _Mapping]]] = ..., broken: _Optional[_Iterable[_Union[BrokenEpisode, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EpisodeCounters(_message.Message):
    __slots__ = ("chunks_fetched", "read_rpcs")
    CHUNKS_FETCHED_FIELD_NUMBER: _ClassVar[int]
    READ_RPCS_FIELD_NUMBER: _ClassVar[int]
    chunks_fetched: int
    read_rpcs: int
    def __init__(self, chunks_fetched: _Optional[int] = ..., read_rpcs: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("counters", "episodes")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class EpisodesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: EpisodeCounters
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[EpisodeCounters, _Mapping]] = ...) -> None: ...
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    counters: _containers.ScalarMap[str, int]
    episodes: _containers.MessageMap[str, EpisodeCounters]
    def __init__(self, counters: _Optional[_Mapping[str, int]] = ..., episodes: _Optional[_Mapping[str, EpisodeCounters]] = ...) -> None: ...

class KeyStatsRequest(_message.Message):
    __slots__ = ("keys", "episodes")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    episodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., episodes: _Optional[_Iterable[str]] = ...) -> None: ...

class KeyStats(_message.Message):
    __slots__ = ("key", "count", "episodes", "mean", "std", "min", "max", "q01", "q99")
    KEY_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    Q01_FIELD_NUMBER: _ClassVar[int]
    Q99_FIELD_NUMBER: _ClassVar[int]
    key: str
    count: int
    episodes: int
    mean: Tensor
    std: Tensor
    min: Tensor
    max: Tensor
    q01: Tensor
    q99: Tensor
    def __init__(self, key: _Optional[str] = ..., count: _Optional[int] = ..., episodes: _Optional[int] = ..., mean: _Optional[_Union[Tensor, _Mapping]] = ..., std: _Optional[_Union[Tensor, _Mapping]] = ..., min: _Optional[_Union[Tensor, _Mapping]] = ..., max: _Optional[_Union[Tensor, _Mapping]] = ..., q01: _Optional[_Union[Tensor, _Mapping]] = ..., q99: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class KeyStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: _containers.RepeatedCompositeFieldContainer[KeyStats]
    def __init__(self, stats: _Optional[_Iterable[_Union[KeyStats, _Mapping]]] = ...) -> None: ...

class GetTopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Topology(_message.Message):
    __slots__ = ("workers", "routing", "local_plane")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PLANE_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedScalarFieldContainer[str]
    routing: str
    local_plane: str
    def __init__(self, workers: _Optional[_Iterable[str]] = ..., routing: _Optional[str] = ..., local_plane: _Optional[str] = ...) -> None: ...
