"""Clients of the Coordinator API: ``LearnerSession`` (async; join, heartbeat, leave,
report a snapshot) for learners and tests, ``AdminClient`` (blocking) for ``diloco
admin``. Every call has a deadline; UNAVAILABLE is retried by the channel's policy, and
a failed call raises the ``DilocoError`` subclass its status code stands for.

Imports no torch: a learner's heartbeat path and the admin CLI stay light.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import grpc

from diloco import auth, rpc
from diloco.clock import VectorClock
from diloco.errors import DilocoError, Unavailable
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

SERVICE = "diloco.v1.Coordinator"
_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_ERROR_FOR_STATUS: dict[grpc.StatusCode, type[DilocoError]] = {}
for _cls, _code in rpc.STATUS_FOR_ERROR:
    _ERROR_FOR_STATUS.setdefault(_code, _cls)


def error_from_rpc(error: grpc.RpcError, what: str) -> DilocoError:
    """The domain error a status code stands for (the table in ``diloco.rpc``, read
    backwards), with the server's message."""
    cls = _ERROR_FOR_STATUS.get(error.code(), DilocoError)
    return cls(f"{what}: {error.details()} ({error.code().name})")


def _clock_proto(clock: VectorClock) -> common_pb2.VectorClock:
    return common_pb2.VectorClock(entries=dict(clock.entries))


def _state_name(enum, value: int, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix).lower()


def learner_dict(info: common_pb2.LearnerInfo) -> dict:
    return {
        "id": info.learner_id,
        "state": _state_name(common_pb2.LearnerState, info.state, "LEARNER_STATE_"),
        "pool": info.pool,
        "address": info.address,
        "last_heartbeat_unix_ms": info.last_heartbeat_unix_ms,
        "counted_unix_ms": info.counted_unix_ms,
        "joined_unix_ms": info.joined_unix_ms,
        "launch_id": info.launch_id,
        "reason": info.reason,
        "tokens": info.tokens,
        "inner_steps": info.inner_steps,
        "version_lag": info.version_lag,
        "tokens_per_s": info.tokens_per_s,
        "train_loss": info.train_loss if info.HasField("train_loss") else None,
        "eval_loss": info.eval_loss if info.HasField("eval_loss") else None,
        "loss_unit": info.loss_unit,
    }


def snapshot_dict(info: coordinator_pb2.SnapshotInfo) -> dict:
    return {
        "id": info.snapshot_id,
        "state": _state_name(coordinator_pb2.SnapshotState, info.state, "SNAPSHOT_STATE_"),
        "started_unix_ms": info.started_unix_ms,
        "finished_unix_ms": info.finished_unix_ms,
        "participants": list(info.participants),
        "reported": list(info.reported),
        "manifest": info.manifest,
        "detail": info.detail,
    }


class LearnerSession:
    """One learner's conversation with the coordinator. Keeps its vector clock (ticked
    on every send, merged on every reply: the learner's entry and the coordinator's, all
    the coordinator's replies carry) and, after Join, its credential."""

    def __init__(self, address: str, timeout_s: float = 10.0, channel_options=()) -> None:
        """``channel_options``: more gRPC channel arguments (a benchmark's own connection per session)."""
        self.channel = rpc.channel(address, [*rpc.channel_options(_MAX_MESSAGE_BYTES, SERVICE), *channel_options])
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.timeout_s = timeout_s
        self.learner_id = ""
        self.credential = ""
        self.clock = VectorClock()

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((auth.LEARNER_METADATA, self.learner_id), (auth.CREDENTIAL_METADATA, self.credential))

    def _send(self) -> common_pb2.VectorClock:
        if self.learner_id:
            self.clock = self.clock.tick(self.learner_id)
        return _clock_proto(self.clock)

    def _received(self, clock: common_pb2.VectorClock) -> None:
        self.clock = self.clock.merge(VectorClock(dict(clock.entries)))

    async def _call(self, what: str, method, request, metadata):
        try:
            return await method(request, metadata=metadata, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error, what) from None

    async def join(self, join_token: str, pool: str = "", address: str = "", launch_id: str = "", plan_hash: str = ""):
        request = coordinator_pb2.JoinRequest(
            pool=pool, address=address, launch_id=launch_id, plan_hash=plan_hash, clock=self._send()
        )
        reply = await self._call("Join", self.stub.Join, request, ((auth.JOIN_METADATA, join_token),))
        self.learner_id, self.credential = reply.learner_id, reply.credential
        self._received(reply.clock)
        return reply

    async def heartbeat(self, tokens: int = 0, inner_steps: int = 0, version_lag: int = 0, tokens_per_s: float = 0.0,
                        train_loss: float | None = None, eval_loss: float | None = None, loss_unit: str = "",
                        counted_unix_ms: int = 0):
        request = coordinator_pb2.HeartbeatRequest(
            learner_id=self.learner_id, tokens=tokens, inner_steps=inner_steps, version_lag=version_lag,
            tokens_per_s=tokens_per_s, train_loss=train_loss, eval_loss=eval_loss, loss_unit=loss_unit,
            counted_unix_ms=counted_unix_ms,
            clock=self._send(),
        )
        reply = await self._call("Heartbeat", self.stub.Heartbeat, request, self.metadata)
        self.credential = reply.credential or self.credential  # renewed: credentials expire
        self._received(reply.clock)
        return reply

    async def leave(self, reason: str = "", tokens: int | None = None, inner_steps: int | None = None,
                    failed: bool = False) -> None:
        """``tokens``, ``inner_steps``: the learner's final counts (unset: the last heartbeat's stand).
        ``failed``: it leaves because it failed, and is marked so."""
        counts = {k: v for k, v in (("tokens", tokens), ("inner_steps", inner_steps)) if v is not None}
        request = coordinator_pb2.LeaveRequest(learner_id=self.learner_id, reason=reason, clock=self._send(),
                                               failed=failed, **counts)
        await self._call("Leave", self.stub.Leave, request, self.metadata)

    async def topology(self) -> common_pb2.Topology:
        return await self._call("GetTopology", self.stub.GetTopology, coordinator_pb2.GetTopologyRequest(), self.metadata)

    async def register_model(self, manifest_json: str) -> common_pb2.Topology:
        request = coordinator_pb2.RegisterModelRequest(learner_id=self.learner_id, manifest_json=manifest_json, clock=self._send())
        reply = await self._call("RegisterModel", self.stub.RegisterModel, request, self.metadata)
        self._received(reply.clock)
        return reply.topology

    async def report_snapshot(self, snapshot_id: int, files: Sequence[tuple[str, int, str]] = (),
                              clock: VectorClock | None = None) -> None:
        """``files``: (path relative to the snapshot directory, size in bytes, hex SHA-256).
        ``clock``: the learner's clock when it recorded (default: this session's, ticked)."""
        if clock is not None:  # its own entry only: heartbeats stay two entries long
            self.clock = self.clock.merge(VectorClock({self.learner_id: clock[self.learner_id]}))
        request = coordinator_pb2.ReportSnapshotRequest(
            snapshot_id=snapshot_id,
            participant=self.learner_id,
            clock=_clock_proto(clock) if clock is not None else self._send(),
            files=[common_pb2.SnapshotFile(path=p, size_bytes=n, sha256=h) for p, n, h in files],
        )
        await self._call("ReportSnapshot", self.stub.ReportSnapshot, request, self.metadata)

    async def close(self) -> None:
        await self.channel.close()


def _interruptible(start: Callable[[], grpc.Future]):
    """The reply of the call ``start()`` begins (a ``.future()``), with no gRPC code on the
    main thread (``rpc.shielded``): a Ctrl-C lands in the wait, and the call is cancelled."""
    call = rpc.shielded(start)
    try:
        return rpc.shielded(call.result)
    except grpc.RpcError:
        raise
    except BaseException:
        rpc.in_background(call.cancel)
        raise


class AdminClient:
    """The operator's calls, blocking (the CLI has nothing else to do meanwhile)."""

    def __init__(self, address: str, token: str, timeout_s: float = 10.0, unreachable_hint: str = "") -> None:
        """``unreachable_hint``: said when no coordinator answers (what the run directory
        knows about the run)."""
        self.address = address
        self.channel = rpc.shielded(rpc.blocking_channel, address, rpc.channel_options(_MAX_MESSAGE_BYTES, SERVICE))
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.metadata = ((auth.ADMIN_METADATA, token),)
        self.timeout_s = timeout_s
        self.unreachable_hint = unreachable_hint

    def _call(self, what: str, method, request):
        try:
            return _interruptible(lambda: method.future(request, metadata=self.metadata, timeout=self.timeout_s))
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                hint = self.unreachable_hint or ("is it running, and is this its address (--coordinator, or the "
                                                 "run directory's endpoints.json)?")
                if rpc.handshake_failed(error.details() or ""):
                    hint = rpc.handshake_hint()
                raise Unavailable(f"no coordinator answers at {self.address} ({what}): {hint} {error.details()}") from None
            raise error_from_rpc(error, f"{what} at {self.address}") from None

    def members(self, include_gone: bool = False) -> list[dict]:
        return self.listing(include_gone)[0]

    def listing(self, include_gone: bool = False) -> tuple[list[dict], list[dict]]:
        """The learners, and the launches not joined (launching, or failed and why)."""
        reply = self._call("ListLearners", self.stub.ListLearners, coordinator_pb2.ListLearnersRequest(include_gone=include_gone))
        launches = [{"launch_id": x.launch_id, "pool": x.pool, "state": x.state, "detail": x.detail,
                     "since_unix_ms": x.since_unix_ms} for x in reply.launches]
        return [learner_dict(l) for l in reply.learners], launches

    def add_learners(self, count: int, pool: str = "", overrides: Mapping[str, str] | None = None) -> list[dict]:
        request = coordinator_pb2.AddLearnersRequest(count=count, pool=pool, overrides=dict(overrides or {}))
        reply = self._call("AddLearners", self.stub.AddLearners, request)
        return [{"launch_id": r.launch_id, "ok": r.ok, "detail": r.detail} for r in reply.launches]

    def remove_learners(self, learner_ids: Sequence[str] = (), count: int = 0, drain: bool = False,
                        after_tokens: dict[str, int] | None = None) -> list[str]:
        """``after_tokens`` (with ``drain``): learner -> the token count (its own) it trains
        to before it leaves; one not listed leaves now."""
        request = coordinator_pb2.RemoveLearnersRequest(learner_ids=list(learner_ids), count=count, drain=drain,
                                                        after_tokens=after_tokens or {})
        return list(self._call("RemoveLearners", self.stub.RemoveLearners, request).learner_ids)

    def start_snapshot(self) -> int:
        return self._call("StartSnapshot", self.stub.StartSnapshot, coordinator_pb2.StartSnapshotRequest()).snapshot_id

    def snapshots(self) -> list[dict]:
        reply = self._call("ListSnapshots", self.stub.ListSnapshots, coordinator_pb2.ListSnapshotsRequest())
        return [snapshot_dict(s) for s in reply.snapshots]

    def shards(self) -> list[dict]:
        reply = self._call("ListShards", self.stub.ListShards, coordinator_pb2.ListShardsRequest())
        return [
            {
                "shard_id": s.shard_id, "address": s.address, "error": s.error,
                "model_state": s.status.model_state if not s.error else "",
                "versions": {str(f.fragment): f.version for f in s.status.fragments},
                "rounds": s.status.rounds_closed, "pushes": s.status.pushes_received,
                "live_learners": list(s.status.live_learners), "plan_hash": s.status.plan_hash,
            }
            for s in reply.shards
        ]

    def accept_initial_values(self, shard_id: int, reason: str) -> dict:
        """An operator's decision: shard ``shard_id``, back without its state, takes fresh
        initial values for the fragments it lacks."""
        request = coordinator_pb2.AcceptShardInitialValuesRequest(shard_id=shard_id, reason=reason)
        reply = self._call("AcceptInitialValues", self.stub.AcceptInitialValues, request)
        return {"shard_id": shard_id, "fragments": list(reply.shard.fragments), "model_state": reply.shard.model_state}

    def export_model(self, timeout_s: float = 600.0) -> list[coordinator_pb2.ExportModelReply]:
        """The global model as relayed from the shards (``diloco.cli.export`` assembles it)."""
        replies = rpc.shielded(self.stub.ExportModel, coordinator_pb2.ExportModelRequest(), metadata=self.metadata,
                               timeout=timeout_s)
        try:
            return rpc.shielded(list, replies)  # (as _interruptible's call)
        except grpc.RpcError as error:
            raise error_from_rpc(error, f"ExportModel at {self.address}") from None
        except BaseException:
            rpc.in_background(replies.cancel)
            raise

    def close(self) -> None:
        rpc.shielded(self.channel.close)
