from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_UNSPECIFIED: _ClassVar[Encoding]
    ENCODING_FP32: _ClassVar[Encoding]
    ENCODING_INT4: _ClassVar[Encoding]
    ENCODING_SPARSE: _ClassVar[Encoding]

class LearnerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEARNER_STATE_UNSPECIFIED: _ClassVar[LearnerState]
    LEARNER_STATE_JOINING: _ClassVar[LearnerState]
    LEARNER_STATE_ACTIVE: _ClassVar[LearnerState]
    LEARNER_STATE_DRAINING: _ClassVar[LearnerState]
    LEARNER_STATE_FAILED: _ClassVar[LearnerState]
    LEARNER_STATE_LEFT: _ClassVar[LearnerState]
ENCODING_UNSPECIFIED: Encoding
ENCODING_FP32: Encoding
ENCODING_INT4: Encoding
ENCODING_SPARSE: Encoding
LEARNER_STATE_UNSPECIFIED: LearnerState
LEARNER_STATE_JOINING: LearnerState
LEARNER_STATE_ACTIVE: LearnerState
LEARNER_STATE_DRAINING: LearnerState
LEARNER_STATE_FAILED: LearnerState
LEARNER_STATE_LEFT: LearnerState

class VectorClock(_message.Message):
    __slots__ = ("entries",)
    class EntriesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.ScalarMap[str, int]
    def __init__(self, entries: _Optional[_Mapping[str, int]] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("name", "shape", "dtype", "encoding", "block_size", "scale_dtype", "byte_length", "checksum", "kept")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SCALE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BYTE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    encoding: Encoding
    block_size: int
    scale_dtype: str
    byte_length: int
    checksum: int
    kept: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., block_size: _Optional[int] = ..., scale_dtype: _Optional[str] = ..., byte_length: _Optional[int] = ..., checksum: _Optional[int] = ..., kept: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class Piece(_message.Message):
    __slots__ = ("tensor", "row_start", "row_stop", "shape", "embedding", "buffer")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_STOP_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    row_start: int
    row_stop: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    embedding: bool
    buffer: bool
    def __init__(self, tensor: _Optional[str] = ..., row_start: _Optional[int] = ..., row_stop: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., embedding: _Optional[bool] = ..., buffer: _Optional[bool] = ...) -> None: ...

class Fragment(_message.Message):
    __slots__ = ("id", "pieces", "shard_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    pieces: _containers.RepeatedCompositeFieldContainer[Piece]
    shard_id: int
    def __init__(self, id: _Optional[int] = ..., pieces: _Optional[_Iterable[_Union[Piece, _Mapping]]] = ..., shard_id: _Optional[int] = ...) -> None: ...

class FragmentPlan(_message.Message):
    __slots__ = ("fragments", "plan_hash")
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    fragments: _containers.RepeatedCompositeFieldContainer[Fragment]
    plan_hash: str
    def __init__(self, fragments: _Optional[_Iterable[_Union[Fragment, _Mapping]]] = ..., plan_hash: _Optional[str] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("shard_id", "address", "fragments")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    address: str
    fragments: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shard_id: _Optional[int] = ..., address: _Optional[str] = ..., fragments: _Optional[_Iterable[int]] = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("plan", "shards", "run_config_json", "epoch", "manifest_json", "initial_values", "seeds_shards")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    INITIAL_VALUES_FIELD_NUMBER: _ClassVar[int]
    SEEDS_SHARDS_FIELD_NUMBER: _ClassVar[int]
    plan: FragmentPlan
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    run_config_json: str
    epoch: int
    manifest_json: str
    initial_values: _containers.RepeatedScalarFieldContainer[bytes]
    seeds_shards: bool
    def __init__(self, plan: _Optional[_Union[FragmentPlan, _Mapping]] = ..., shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ..., run_config_json: _Optional[str] = ..., epoch: _Optional[int] = ..., manifest_json: _Optional[str] = ..., initial_values: _Optional[_Iterable[bytes]] = ..., seeds_shards: _Optional[bool] = ...) -> None: ...

class LearnerInfo(_message.Message):
    __slots__ = ("learner_id", "state", "pool", "address", "last_heartbeat_unix_ms", "tokens", "inner_steps", "version_lag", "joined_unix_ms", "launch_id", "reason", "train_loss", "eval_loss", "tokens_per_s", "loss_unit", "counted_unix_ms")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    VERSION_LAG_FIELD_NUMBER: _ClassVar[int]
    JOINED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LOSS_UNIT_FIELD_NUMBER: _ClassVar[int]
    COUNTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    state: LearnerState
    pool: str
    address: str
    last_heartbeat_unix_ms: int
    tokens: int
    inner_steps: int
    version_lag: int
    joined_unix_ms: int
    launch_id: str
    reason: str
    train_loss: float
    eval_loss: float
    tokens_per_s: float
    loss_unit: str
    counted_unix_ms: int
    def __init__(self, learner_id: _Optional[str] = ..., state: _Optional[_Union[LearnerState, str]] = ..., pool: _Optional[str] = ..., address: _Optional[str] = ..., last_heartbeat_unix_ms: _Optional[int] = ..., tokens: _Optional[int] = ..., inner_steps: _Optional[int] = ..., version_lag: _Optional[int] = ..., joined_unix_ms: _Optional[int] = ..., launch_id: _Optional[str] = ..., reason: _Optional[str] = ..., train_loss: _Optional[float] = ..., eval_loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., loss_unit: _Optional[str] = ..., counted_unix_ms: _Optional[int] = ...) -> None: ...

class SnapshotFile(_message.Message):
    __slots__ = ("path", "size_bytes", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...
