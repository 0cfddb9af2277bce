from diloco.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PushOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_OUTCOME_UNSPECIFIED: _ClassVar[PushOutcome]
    PUSH_OUTCOME_ACCEPTED: _ClassVar[PushOutcome]
    PUSH_OUTCOME_ACCEPTED_NEXT_ROUND: _ClassVar[PushOutcome]
    PUSH_OUTCOME_DUPLICATE: _ClassVar[PushOutcome]

class UpdateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_KIND_UNSPECIFIED: _ClassVar[UpdateKind]
    UPDATE_KIND_DELTA: _ClassVar[UpdateKind]
    UPDATE_KIND_FULL: _ClassVar[UpdateKind]
PUSH_OUTCOME_UNSPECIFIED: PushOutcome
PUSH_OUTCOME_ACCEPTED: PushOutcome
PUSH_OUTCOME_ACCEPTED_NEXT_ROUND: PushOutcome
PUSH_OUTCOME_DUPLICATE: PushOutcome
UPDATE_KIND_UNSPECIFIED: UpdateKind
UPDATE_KIND_DELTA: UpdateKind
UPDATE_KIND_FULL: UpdateKind

class PushHeader(_message.Message):
    __slots__ = ("learner_id", "fragment", "base_version", "tokens", "inner_steps", "step_time_s", "clock", "snapshot_epoch", "tensors", "final")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    fragment: int
    base_version: int
    tokens: int
    inner_steps: int
    step_time_s: float
    clock: _common_pb2.VectorClock
    snapshot_epoch: int
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorHeader]
    final: bool
    def __init__(self, learner_id: _Optional[str] = ..., fragment: _Optional[int] = ..., base_version: _Optional[int] = ..., tokens: _Optional[int] = ..., inner_steps: _Optional[int] = ..., step_time_s: _Optional[float] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ..., snapshot_epoch: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_common_pb2.TensorHeader, _Mapping]]] = ..., final: _Optional[bool] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: _common_pb2.Chunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.Chunk, _Mapping]] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("outcome", "target_version", "clock", "snapshot_epoch")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    outcome: PushOutcome
    target_version: int
    clock: _common_pb2.VectorClock
    snapshot_epoch: int
    def __init__(self, outcome: _Optional[_Union[PushOutcome, str]] = ..., target_version: _Optional[int] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ..., snapshot_epoch: _Optional[int] = ...) -> None: ...

class UpdateSegment(_message.Message):
    __slots__ = ("version", "kind", "tensors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: int
    kind: UpdateKind
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorHeader]
    def __init__(self, version: _Optional[int] = ..., kind: _Optional[_Union[UpdateKind, str]] = ..., tensors: _Optional[_Iterable[_Union[_common_pb2.TensorHeader, _Mapping]]] = ...) -> None: ...

class FragmentUpdate(_message.Message):
    __slots__ = ("fragment", "base_version", "version", "segments", "clock", "close_reason", "participants", "snapshot_epoch")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    CLOSE_REASON_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    base_version: int
    version: int
    segments: _containers.RepeatedCompositeFieldContainer[UpdateSegment]
    clock: _common_pb2.VectorClock
    close_reason: str
    participants: int
    snapshot_epoch: int
    def __init__(self, fragment: _Optional[int] = ..., base_version: _Optional[int] = ..., version: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[UpdateSegment, _Mapping]]] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ..., close_reason: _Optional[str] = ..., participants: _Optional[int] = ..., snapshot_epoch: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("ack", "update", "chunk")
    ACK_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ack: PushAck
    update: FragmentUpdate
    chunk: _common_pb2.Chunk
    def __init__(self, ack: _Optional[_Union[PushAck, _Mapping]] = ..., update: _Optional[_Union[FragmentUpdate, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.Chunk, _Mapping]] = ...) -> None: ...

class BootstrapRequest(_message.Message):
    __slots__ = ("learner_id", "fragments", "clock", "have")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    HAVE_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    fragments: _containers.RepeatedScalarFieldContainer[int]
    clock: _common_pb2.VectorClock
    have: _containers.RepeatedCompositeFieldContainer[FragmentDigest]
    def __init__(self, learner_id: _Optional[str] = ..., fragments: _Optional[_Iterable[int]] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ..., have: _Optional[_Iterable[_Union[FragmentDigest, _Mapping]]] = ...) -> None: ...

class FragmentDigest(_message.Message):
    __slots__ = ("fragment", "sha256")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    sha256: bytes
    def __init__(self, fragment: _Optional[int] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class BootstrapReply(_message.Message):
    __slots__ = ("update", "chunk")
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    update: FragmentUpdate
    chunk: _common_pb2.Chunk
    def __init__(self, update: _Optional[_Union[FragmentUpdate, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.Chunk, _Mapping]] = ...) -> None: ...

class InitializeHeader(_message.Message):
    __slots__ = ("learner_id", "fragment", "manifest_json", "plan_hash", "tensors", "clock", "anchor", "anchor_version")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    fragment: int
    manifest_json: str
    plan_hash: str
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorHeader]
    clock: _common_pb2.VectorClock
    anchor: bool
    anchor_version: int
    def __init__(self, learner_id: _Optional[str] = ..., fragment: _Optional[int] = ..., manifest_json: _Optional[str] = ..., plan_hash: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[_common_pb2.TensorHeader, _Mapping]]] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ..., anchor: _Optional[bool] = ..., anchor_version: _Optional[int] = ...) -> None: ...

class InitializeRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: InitializeHeader
    chunk: _common_pb2.Chunk
    def __init__(self, header: _Optional[_Union[InitializeHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.Chunk, _Mapping]] = ...) -> None: ...

class InitializeReply(_message.Message):
    __slots__ = ("initialized", "version", "clock")
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    initialized: bool
    version: int
    clock: _common_pb2.VectorClock
    def __init__(self, initialized: _Optional[bool] = ..., version: _Optional[int] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ...) -> None: ...

class MarkerRequest(_message.Message):
    __slots__ = ("snapshot_id", "directory", "clock", "learners")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LEARNERS_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    directory: str
    clock: _common_pb2.VectorClock
    learners: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, snapshot_id: _Optional[int] = ..., directory: _Optional[str] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ..., learners: _Optional[_Iterable[str]] = ...) -> None: ...

class MarkerReply(_message.Message):
    __slots__ = ("participant", "clock", "files", "incarnation")
    PARTICIPANT_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    participant: str
    clock: _common_pb2.VectorClock
    files: _containers.RepeatedCompositeFieldContainer[_common_pb2.SnapshotFile]
    incarnation: str
    def __init__(self, participant: _Optional[str] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ..., files: _Optional[_Iterable[_Union[_common_pb2.SnapshotFile, _Mapping]]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class AcceptInitialValuesRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class AcceptInitialValuesReply(_message.Message):
    __slots__ = ("fragments", "model_state")
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_STATE_FIELD_NUMBER: _ClassVar[int]
    fragments: _containers.RepeatedScalarFieldContainer[int]
    model_state: str
    def __init__(self, fragments: _Optional[_Iterable[int]] = ..., model_state: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FragmentStatus(_message.Message):
    __slots__ = ("fragment", "version", "open_round_pushes", "round_state", "last_round_age_s", "last_round_participants")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OPEN_ROUND_PUSHES_FIELD_NUMBER: _ClassVar[int]
    ROUND_STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    open_round_pushes: int
    round_state: str
    last_round_age_s: float
    last_round_participants: int
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., open_round_pushes: _Optional[int] = ..., round_state: _Optional[str] = ..., last_round_age_s: _Optional[float] = ..., last_round_participants: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("shard_id", "fragments", "live_learners", "rounds_closed", "pushes_received", "bytes_received", "bytes_sent", "clock", "plan_hash", "model_state", "anchors_only", "initializing")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEARNERS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_CLOSED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_STATE_FIELD_NUMBER: _ClassVar[int]
    ANCHORS_ONLY_FIELD_NUMBER: _ClassVar[int]
    INITIALIZING_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentStatus]
    live_learners: _containers.RepeatedScalarFieldContainer[str]
    rounds_closed: int
    pushes_received: int
    bytes_received: int
    bytes_sent: int
    clock: _common_pb2.VectorClock
    plan_hash: str
    model_state: str
    anchors_only: bool
    initializing: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shard_id: _Optional[int] = ..., fragments: _Optional[_Iterable[_Union[FragmentStatus, _Mapping]]] = ..., live_learners: _Optional[_Iterable[str]] = ..., rounds_closed: _Optional[int] = ..., pushes_received: _Optional[int] = ..., bytes_received: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ..., plan_hash: _Optional[str] = ..., model_state: _Optional[str] = ..., anchors_only: _Optional[bool] = ..., initializing: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplesRequest(_message.Message):
    __slots__ = ("fragments",)
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    fragments: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, fragments: _Optional[_Iterable[int]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("learner_id", "fragment", "seq", "base_version", "version", "tensors")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    fragment: int
    seq: int
    base_version: int
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorHeader]
    def __init__(self, learner_id: _Optional[str] = ..., fragment: _Optional[int] = ..., seq: _Optional[int] = ..., base_version: _Optional[int] = ..., version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_common_pb2.TensorHeader, _Mapping]]] = ...) -> None: ...

class SamplesReply(_message.Message):
    __slots__ = ("sample", "chunk")
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    sample: Sample
    chunk: _common_pb2.Chunk
    def __init__(self, sample: _Optional[_Union[Sample, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.Chunk, _Mapping]] = ...) -> None: ...

class LearnerScore(_message.Message):
    __slots__ = ("learner_id", "fragment", "seq", "score", "trust")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    fragment: int
    seq: int
    score: float
    trust: float
    def __init__(self, learner_id: _Optional[str] = ..., fragment: _Optional[int] = ..., seq: _Optional[int] = ..., score: _Optional[float] = ..., trust: _Optional[float] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[LearnerScore]
    def __init__(self, scores: _Optional[_Iterable[_Union[LearnerScore, _Mapping]]] = ...) -> None: ...

class ScoreReply(_message.Message):
    __slots__ = ("applied",)
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    applied: int
    def __init__(self, applied: _Optional[int] = ...) -> None: ...
