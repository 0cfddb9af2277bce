"""Learner credentials expire and heartbeats renew them: a credential is bound to its id
and its expiry by the run's MAC, the coordinator issues one for --credential-lifetime-s
with every Join and Heartbeat reply, a learner's heartbeat thread swaps it in place for
every channel, and once expired it is refused by the coordinator and the shards alike."""

import asyncio
import threading
import time

import grpc
import pytest

from diloco.clients.coordinator import LearnerSession
from diloco import auth
from diloco.errors import InvalidArgument, Unauthenticated
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc
from diloco.learner.membership import Heartbeats, Membership
from diloco.clients.syncer import SyncerClient, open_channel
from tests.grpc.conftest import SECRET, TINY, running_shard
from tests.grpc.coordinator_fixtures import running_coordinator


def test_a_credential_is_bound_to_its_id_and_its_expiry():
    credential = auth.sign(SECRET, "L0", 60, now=1000)
    auth.verify(SECRET, "L0", credential, now=1059)
    with pytest.raises(Unauthenticated, match="the credential of 'L0' expired 1 s ago"):
        auth.verify(SECRET, "L0", credential, now=1061)
    later = "9999999999." + credential.partition(".")[2]  # a holder cannot extend it
    for who, presented in (("L1", credential), ("L0", later), ("L0", auth.sign("another run", "L0", 60, now=1000)),
                           ("L0", credential.partition(".")[2]), ("L0", "1e9." + credential.partition(".")[2])):
        with pytest.raises(Unauthenticated, match="invalid credential"):
            auth.verify(SECRET, who, presented, now=1000)


def test_a_credential_made_from_the_secret_signs_itself_again_before_it_expires(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(auth.time, "time", lambda: now[0])
    credential = auth.Credential("S0", secret=SECRET, lifetime_s=10)
    first = credential.value
    now[0] = 1004.0
    assert credential.value == first  # more than half its life left
    now[0] = 1006.0
    assert credential.value != first and auth.expiry(credential.value) == 1016
    auth.verify(SECRET, "S0", credential.value)
    issued = auth.Credential("L0", first)  # a learner's, without the secret: only renew() changes it
    now[0] = 1100.0
    assert issued.value == first
    issued.renew("")
    assert issued.value == first


def test_the_lifetime_must_cover_two_leases(tmp_path):
    from diloco.coordinator.config import CoordinatorConfig

    with pytest.raises(InvalidArgument, match="credential lifetime must be at least two leases"):
        CoordinatorConfig(data_dir=tmp_path, lease_s=5, credential_lifetime_s=9)


def test_heartbeats_renew_a_learner_s_credential_and_an_expired_one_is_refused_everywhere(tmp_path):
    async def scenario():
        async with running_coordinator(tmp_path, lease_s=1.0, credential_lifetime_s=2.0) as coordinator, \
                running_shard(tmp_path / "shard", learners=("L0",)) as (_, shard):
            session = LearnerSession(coordinator.address)
            reply = await session.join(auth.join_credential(SECRET, "test", 64))
            joined = reply.credential
            assert auth.expiry(joined) <= time.time() + 2.0
            while time.time() < auth.expiry(joined) + 0.2:  # heartbeats keep the lease and the credential
                await session.heartbeat()
                await asyncio.sleep(0.25)
            renewed = session.credential
            assert renewed != joined and auth.expiry(renewed) > time.time()
            stale = ((auth.LEARNER_METADATA, "L0"), (auth.CREDENTIAL_METADATA, joined))
            async with grpc.aio.insecure_channel(coordinator.address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await coordinator_pb2_grpc.CoordinatorStub(channel).Heartbeat(
                        coordinator_pb2.HeartbeatRequest(learner_id="L0"), metadata=stale, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED and "expired" in refused.value.details()
            async with open_channel(shard) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await SyncerClient(channel, auth.Credential("L0", joined), timeout_s=5).status()
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED and "expired" in refused.value.details()
                assert (await SyncerClient(channel, auth.Credential("L0", renewed), timeout_s=5).status()).plan_hash
            await session.leave("done")
            await session.close()

            # A real learner's heartbeat thread: the Membership's credential, which its
            # channels to the shards read per call, is renewed in place and never lapses.
            session = LearnerSession(coordinator.address)
            reply = await session.join(auth.join_credential(SECRET, "test", 64))
            member = Membership(reply.learner_id, auth.Credential(reply.learner_id, reply.credential), TINY, {0: shard}, 1.0)
            drained = threading.Event()
            beats = Heartbeats(coordinator.address, member, 0.2, stats=dict, on_drain=lambda reason, after_tokens: drained.set())
            beats.start()
            try:
                while time.time() < auth.expiry(reply.credential) + 1.0:  # past the first credential's expiry
                    await asyncio.sleep(0.1)
                assert not drained.is_set()
                assert member.credential.value != reply.credential
                auth.verify(SECRET, reply.learner_id, member.credential.value)
            finally:
                await asyncio.to_thread(beats.stop_and_leave, "done")
            await session.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
