from diloco.v1 import common_pb2 as _common_pb2
from diloco.v1 import syncer_pb2 as _syncer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MembershipEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBERSHIP_EVENT_KIND_UNSPECIFIED: _ClassVar[MembershipEventKind]
    MEMBERSHIP_EVENT_KIND_SNAPSHOT: _ClassVar[MembershipEventKind]
    MEMBERSHIP_EVENT_KIND_JOINED: _ClassVar[MembershipEventKind]
    MEMBERSHIP_EVENT_KIND_FAILED: _ClassVar[MembershipEventKind]
    MEMBERSHIP_EVENT_KIND_LEFT: _ClassVar[MembershipEventKind]
    MEMBERSHIP_EVENT_KIND_DRAINING: _ClassVar[MembershipEventKind]

class SnapshotState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SNAPSHOT_STATE_UNSPECIFIED: _ClassVar[SnapshotState]
    SNAPSHOT_STATE_RUNNING: _ClassVar[SnapshotState]
    SNAPSHOT_STATE_COMPLETE: _ClassVar[SnapshotState]
    SNAPSHOT_STATE_FAILED: _ClassVar[SnapshotState]
MEMBERSHIP_EVENT_KIND_UNSPECIFIED: MembershipEventKind
MEMBERSHIP_EVENT_KIND_SNAPSHOT: MembershipEventKind
MEMBERSHIP_EVENT_KIND_JOINED: MembershipEventKind
MEMBERSHIP_EVENT_KIND_FAILED: MembershipEventKind
MEMBERSHIP_EVENT_KIND_LEFT: MembershipEventKind
MEMBERSHIP_EVENT_KIND_DRAINING: MembershipEventKind
SNAPSHOT_STATE_UNSPECIFIED: SnapshotState
SNAPSHOT_STATE_RUNNING: SnapshotState
SNAPSHOT_STATE_COMPLETE: SnapshotState
SNAPSHOT_STATE_FAILED: SnapshotState

class JoinRequest(_message.Message):
    __slots__ = ("pool", "address", "launch_id", "plan_hash", "clock")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    pool: str
    address: str
    launch_id: str
    plan_hash: str
    clock: _common_pb2.VectorClock
    def __init__(self, pool: _Optional[str] = ..., address: _Optional[str] = ..., launch_id: _Optional[str] = ..., plan_hash: _Optional[str] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("learner_id", "credential", "topology", "lease_s", "clock")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    credential: str
    topology: _common_pb2.Topology
    lease_s: float
    clock: _common_pb2.VectorClock
    def __init__(self, learner_id: _Optional[str] = ..., credential: _Optional[str] = ..., topology: _Optional[_Union[_common_pb2.Topology, _Mapping]] = ..., lease_s: _Optional[float] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("learner_id", "tokens", "inner_steps", "version_lag", "tokens_per_s", "clock", "train_loss", "eval_loss", "loss_unit", "counted_unix_ms")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    VERSION_LAG_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_UNIT_FIELD_NUMBER: _ClassVar[int]
    COUNTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    tokens: int
    inner_steps: int
    version_lag: int
    tokens_per_s: float
    clock: _common_pb2.VectorClock
    train_loss: float
    eval_loss: float
    loss_unit: str
    counted_unix_ms: int
    def __init__(self, learner_id: _Optional[str] = ..., tokens: _Optional[int] = ..., inner_steps: _Optional[int] = ..., version_lag: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ..., train_loss: _Optional[float] = ..., eval_loss: _Optional[float] = ..., loss_unit: _Optional[str] = ..., counted_unix_ms: _Optional[int] = ...) -> None: ...

class Directive(_message.Message):
    __slots__ = ("drain", "snapshot")
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    drain: DrainDirective
    snapshot: SnapshotMarker
    def __init__(self, drain: _Optional[_Union[DrainDirective, _Mapping]] = ..., snapshot: _Optional[_Union[SnapshotMarker, _Mapping]] = ...) -> None: ...

class DrainDirective(_message.Message):
    __slots__ = ("reason", "after_tokens")
    REASON_FIELD_NUMBER: _ClassVar[int]
    AFTER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reason: str
    after_tokens: int
    def __init__(self, reason: _Optional[str] = ..., after_tokens: _Optional[int] = ...) -> None: ...

class SnapshotMarker(_message.Message):
    __slots__ = ("snapshot_id", "directory")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    directory: str
    def __init__(self, snapshot_id: _Optional[int] = ..., directory: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("directives", "lease_s", "topology_epoch", "clock", "credential")
    DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    directives: _containers.RepeatedCompositeFieldContainer[Directive]
    lease_s: float
    topology_epoch: int
    clock: _common_pb2.VectorClock
    credential: str
    def __init__(self, directives: _Optional[_Iterable[_Union[Directive, _Mapping]]] = ..., lease_s: _Optional[float] = ..., topology_epoch: _Optional[int] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ..., credential: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("learner_id", "reason", "clock", "tokens", "inner_steps", "failed")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    reason: str
    clock: _common_pb2.VectorClock
    tokens: int
    inner_steps: int
    failed: bool
    def __init__(self, learner_id: _Optional[str] = ..., reason: _Optional[str] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ..., tokens: _Optional[int] = ..., inner_steps: _Optional[int] = ..., failed: _Optional[bool] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterModelRequest(_message.Message):
    __slots__ = ("learner_id", "manifest_json", "clock")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    manifest_json: str
    clock: _common_pb2.VectorClock
    def __init__(self, learner_id: _Optional[str] = ..., manifest_json: _Optional[str] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ...) -> None: ...

class RegisterModelReply(_message.Message):
    __slots__ = ("topology", "clock")
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    topology: _common_pb2.Topology
    clock: _common_pb2.VectorClock
    def __init__(self, topology: _Optional[_Union[_common_pb2.Topology, _Mapping]] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ...) -> None: ...

class ExportModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListShardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("shard_id", "address", "error", "status")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    address: str
    error: str
    status: _syncer_pb2.StatusReply
    def __init__(self, shard_id: _Optional[int] = ..., address: _Optional[str] = ..., error: _Optional[str] = ..., status: _Optional[_Union[_syncer_pb2.StatusReply, _Mapping]] = ...) -> None: ...

class ListShardsReply(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardStatus]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardStatus, _Mapping]]] = ...) -> None: ...

class AcceptShardInitialValuesRequest(_message.Message):
    __slots__ = ("shard_id", "reason")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    reason: str
    def __init__(self, shard_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AcceptShardInitialValuesReply(_message.Message):
    __slots__ = ("shard",)
    SHARD_FIELD_NUMBER: _ClassVar[int]
    shard: _syncer_pb2.AcceptInitialValuesReply
    def __init__(self, shard: _Optional[_Union[_syncer_pb2.AcceptInitialValuesReply, _Mapping]] = ...) -> None: ...

class ExportHeader(_message.Message):
    __slots__ = ("manifest_json", "plan_hash", "fragments")
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    manifest_json: str
    plan_hash: str
    fragments: int
    def __init__(self, manifest_json: _Optional[str] = ..., plan_hash: _Optional[str] = ..., fragments: _Optional[int] = ...) -> None: ...

class ExportModelReply(_message.Message):
    __slots__ = ("header", "update", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ExportHeader
    update: _syncer_pb2.FragmentUpdate
    chunk: _common_pb2.Chunk
    def __init__(self, header: _Optional[_Union[ExportHeader, _Mapping]] = ..., update: _Optional[_Union[_syncer_pb2.FragmentUpdate, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.Chunk, _Mapping]] = ...) -> None: ...

class WatchMembershipRequest(_message.Message):
    __slots__ = ("watcher", "clock", "incarnation")
    WATCHER_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    watcher: str
    clock: _common_pb2.VectorClock
    incarnation: str
    def __init__(self, watcher: _Optional[str] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class MembershipEvent(_message.Message):
    __slots__ = ("kind", "learners", "clock")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LEARNERS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    kind: MembershipEventKind
    learners: _containers.RepeatedCompositeFieldContainer[_common_pb2.LearnerInfo]
    clock: _common_pb2.VectorClock
    def __init__(self, kind: _Optional[_Union[MembershipEventKind, str]] = ..., learners: _Optional[_Iterable[_Union[_common_pb2.LearnerInfo, _Mapping]]] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ...) -> None: ...

class ReportSnapshotRequest(_message.Message):
    __slots__ = ("snapshot_id", "participant", "clock", "files")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANT_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    participant: str
    clock: _common_pb2.VectorClock
    files: _containers.RepeatedCompositeFieldContainer[_common_pb2.SnapshotFile]
    def __init__(self, snapshot_id: _Optional[int] = ..., participant: _Optional[str] = ..., clock: _Optional[_Union[_common_pb2.VectorClock, _Mapping]] = ..., files: _Optional[_Iterable[_Union[_common_pb2.SnapshotFile, _Mapping]]] = ...) -> None: ...

class ReportSnapshotReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AddLearnersRequest(_message.Message):
    __slots__ = ("count", "pool", "overrides")
    class OverridesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COUNT_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    count: int
    pool: str
    overrides: _containers.ScalarMap[str, str]
    def __init__(self, count: _Optional[int] = ..., pool: _Optional[str] = ..., overrides: _Optional[_Mapping[str, str]] = ...) -> None: ...

class LaunchResult(_message.Message):
    __slots__ = ("launch_id", "ok", "detail")
    LAUNCH_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    launch_id: str
    ok: bool
    detail: str
    def __init__(self, launch_id: _Optional[str] = ..., ok: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class AddLearnersReply(_message.Message):
    __slots__ = ("launches",)
    LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    launches: _containers.RepeatedCompositeFieldContainer[LaunchResult]
    def __init__(self, launches: _Optional[_Iterable[_Union[LaunchResult, _Mapping]]] = ...) -> None: ...

class RemoveLearnersRequest(_message.Message):
    __slots__ = ("learner_ids", "count", "drain", "after_tokens")
    class AfterTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    LEARNER_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    AFTER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    learner_ids: _containers.RepeatedScalarFieldContainer[str]
    count: int
    drain: bool
    after_tokens: _containers.ScalarMap[str, int]
    def __init__(self, learner_ids: _Optional[_Iterable[str]] = ..., count: _Optional[int] = ..., drain: _Optional[bool] = ..., after_tokens: _Optional[_Mapping[str, int]] = ...) -> None: ...

class RemoveLearnersReply(_message.Message):
    __slots__ = ("learner_ids",)
    LEARNER_IDS_FIELD_NUMBER: _ClassVar[int]
    learner_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, learner_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ListLearnersRequest(_message.Message):
    __slots__ = ("include_gone",)
    INCLUDE_GONE_FIELD_NUMBER: _ClassVar[int]
    include_gone: bool
    def __init__(self, include_gone: _Optional[bool] = ...) -> None: ...

class ListLearnersReply(_message.Message):
    __slots__ = ("learners", "launches")
    LEARNERS_FIELD_NUMBER: _ClassVar[int]
    LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    learners: _containers.RepeatedCompositeFieldContainer[_common_pb2.LearnerInfo]
    launches: _containers.RepeatedCompositeFieldContainer[LaunchInfo]
    def __init__(self, learners: _Optional[_Iterable[_Union[_common_pb2.LearnerInfo, _Mapping]]] = ..., launches: _Optional[_Iterable[_Union[LaunchInfo, _Mapping]]] = ...) -> None: ...

class LaunchInfo(_message.Message):
    __slots__ = ("launch_id", "pool", "state", "detail", "since_unix_ms")
    LAUNCH_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    launch_id: str
    pool: str
    state: str
    detail: str
    since_unix_ms: int
    def __init__(self, launch_id: _Optional[str] = ..., pool: _Optional[str] = ..., state: _Optional[str] = ..., detail: _Optional[str] = ..., since_unix_ms: _Optional[int] = ...) -> None: ...

class StartSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartSnapshotReply(_message.Message):
    __slots__ = ("snapshot_id",)
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    def __init__(self, snapshot_id: _Optional[int] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SnapshotInfo(_message.Message):
    __slots__ = ("snapshot_id", "state", "started_unix_ms", "finished_unix_ms", "participants", "reported", "manifest", "detail")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    REPORTED_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    state: SnapshotState
    started_unix_ms: int
    finished_unix_ms: int
    participants: _containers.RepeatedScalarFieldContainer[str]
    reported: _containers.RepeatedScalarFieldContainer[str]
    manifest: str
    detail: str
    def __init__(self, snapshot_id: _Optional[int] = ..., state: _Optional[_Union[SnapshotState, str]] = ..., started_unix_ms: _Optional[int] = ..., finished_unix_ms: _Optional[int] = ..., participants: _Optional[_Iterable[str]] = ..., reported: _Optional[_Iterable[str]] = ..., manifest: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ListSnapshotsReply(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotInfo]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotInfo, _Mapping]]] = ...) -> None: ...
