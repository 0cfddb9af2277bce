"""The validator's process: every ``interval_s`` it reads the global model from the shards
and the pushes they kept since its last pass (``Samples``), scores each new push by its
agreement with the outer gradient it trained last pass, from values read before that push
arrived (``diloco.validator.core``), sends the shards what each learner's pushes of each
fragment count for from then on (``Score``; the shards record it on their tapes, so replay
stays exact), and trains ``steps`` inner steps of its own from the values just read: the
trusted outer gradient of the next pass.

It needs the run's task (the model, its loss and its data) and the run secret (it signs
itself as ``V``, like the shards): an operator's process, never a learner's."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
import torch

from diloco import auth
from diloco.clients.syncer import DecodedSample, SyncerClient, open_channel
from diloco.config import RunConfig
from diloco.errors import DilocoError, FailedPrecondition
from diloco.manifest import manifest_of, synced_tensors
from diloco.task import TaskContext, TaskError, build_task
from diloco.validator.config import ValidatorConfig
from diloco.validator.core import cosine, trust

logger = logging.getLogger(__name__)

VALIDATION_SEED = 7919
"""Added to the run's seed for the validator's batches: the task's own stream, at offsets
no learner draws (a learner's batches come from the run's seed)."""
LEARNING_RATE = 1e-3
"""The validator's AdamW (the task's own optimizer when it has one): a direction is all it
needs, not a schedule."""


@dataclass(frozen=True)
class Judgement:
    learner_id: str
    fragment: int
    seq: int
    score: float | None
    """The cosine of the push's delta with the validator's outer gradient (None: a zero push)."""
    trust: float


class Validator:
    def __init__(self, run: RunConfig, cfg: ValidatorConfig, secret: str) -> None:
        if not cfg.shards:
            raise FailedPrecondition("the validator needs the run's shards (--shards HOST:PORT,...)")
        self.cfg = cfg
        task = build_task(run.task, TaskContext(0, 1, run.seed + VALIDATION_SEED, torch.device("cpu"),
                                                dict(run.task_options)), run.init)
        self.spec, self.task, self.model = run.task, task, task.model
        self.steps_trained = 0
        self.batches = iter(task.batches)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = task.optimizer(params) if task.optimizer is not None else torch.optim.AdamW(params, lr=LEARNING_RATE)
        manifest = manifest_of(self.model)
        self.plan = manifest.plan(run.fragments)
        self.tensors = synced_tensors(self.model, manifest)
        self.global_values: dict[int, list[torch.Tensor]] = {}
        self.direction: dict[int, list[torch.Tensor]] = {}
        """Each fragment's trusted outer gradient from the values read last: global - trained."""
        self.credential = auth.Credential(auth.VALIDATOR_ID, secret=secret)
        self.seen: dict[tuple[str, int], int] = {}
        """(learner, fragment) -> the seq of its latest push read, judged or not."""
        self.judged = 0

    def _views(self, fragment_id: int) -> list[torch.Tensor]:
        return [piece.view(self.tensors[piece.tensor]) for piece in self.plan.fragments[fragment_id].pieces]

    def train(self) -> float:
        """From the global values just read: ``steps`` inner steps, then each fragment's
        trusted outer gradient. Returns the mean training loss."""
        with torch.no_grad():
            for fragment_id, values in self.global_values.items():
                for view, value in zip(self._views(fragment_id), values):
                    view.copy_(value.reshape(view.shape))
        self.model.train()
        total = 0.0
        for _ in range(self.cfg.steps):
            batch = next(self.batches, None)
            if batch is None:
                raise TaskError(f"task {self.spec!r}: its batches ended after {self.steps_trained} steps of the "
                                "validator's (it draws a stream of its own: give it an endless one)")
            self.steps_trained += 1
            loss = self.task.loss(self.model, batch)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            total += loss.item()
        with torch.no_grad():
            self.direction = {f: [g.reshape(-1) - v.reshape(-1) for g, v in zip(values, self._views(f))]
                              for f, values in self.global_values.items()}
            if not all(bool(torch.isfinite(t).all()) for ts in self.direction.values() for t in ts):
                # Its own steps diverged: no learner is judged by that, and its optimizer starts again.
                self.direction = {}
                self.optimizer.state.clear()
        return total / self.cfg.steps

    def judge(self, sample: DecodedSample) -> Judgement:
        """Score one push against the trusted outer gradient trained last (``train``)."""
        pieces = self.plan.fragments[sample.fragment].pieces
        dot = norm_v = norm_d = 0.0
        for piece, v, d in zip(pieces, self.direction[sample.fragment], sample.tensors):
            if piece.buffer:
                continue
            d = d.reshape(-1).double()
            v = v.double()
            dot += float(torch.dot(v, d))
            norm_v += float(torch.dot(v, v))
            norm_d += float(torch.dot(d, d))
        score = cosine(dot, norm_v, norm_d)
        return Judgement(sample.learner_id, sample.fragment, sample.seq, score, trust(score, self.cfg.agreement))

    async def one_pass(self, clients: list[SyncerClient]) -> list[list[Judgement]]:
        """Read each shard's model, then the pushes it kept; score the new ones against the
        direction trained last pass; then train this pass's from the values just read.
        Returns each shard's judgements.

        A push is judged against a direction trained from global values that do not hold
        it: a push new since the last pass's read of the samples arrived after the last
        pass's read of the values. Judged from values that already hold it, a push that
        overshoots looks like descent: early in a run the loss falls on both sides of a
        ridge, and a negated outer gradient x2.9, once merged, is past it
        (docs/results/trust/README.md: its cosine -0.95 judged before its merge, +0.80
        after). A push that arrived before the validator had a direction for its fragment
        (its first pass, or after its own steps diverged) is not judged."""
        per_shard = []
        for client in clients:
            for update in await client.bootstrap():
                self.global_values[update.fragment] = update.apply_to([])
            fresh = [s for s in await client.samples() if self.seen.get((s.learner_id, s.fragment)) != s.seq]
            for s in fresh:
                self.seen[(s.learner_id, s.fragment)] = s.seq
            judged = [self.judge(s) for s in fresh if s.fragment in self.direction]
            if judged:
                await client.score([(j.learner_id, j.fragment, j.seq, j.score, j.trust) for j in judged])
            per_shard.append(judged)
        judged = [j for shard in per_shard for j in shard]
        self.judged += len(judged)
        loss = await asyncio.to_thread(self.train)
        doubted = [j for j in judged if j.trust < 1]
        if doubted:
            logger.info("loss %.4f; doubted: %s", loss, ", ".join(
                f"{j.learner_id} f{j.fragment} cos {j.score:+.3f} trust {j.trust:.2f}" if j.score is not None else "?" for j in doubted))
        return per_shard

    async def run(self, stop: asyncio.Event) -> None:
        channels = [open_channel(address) for address in self.cfg.shards]
        clients = [SyncerClient(c, self.credential, self.cfg.timeout_s) for c in channels]
        logger.info("validator: %d shards, %d steps a pass, agreement %g, every %g s", len(clients), self.cfg.steps,
                    self.cfg.agreement, self.cfg.interval_s)
        waiting = None
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    await self.one_pass(clients)
                    waiting = None
                except TaskError:
                    raise  # the validator cannot evaluate: one line, exit 2 (``diloco.cli.main``)
                except (DilocoError, grpc.RpcError) as error:
                    # A shard with no model yet, restarting or unreachable: the next pass tries again.
                    reason = (f"{error.code().name}: {error.details()}" if isinstance(error, grpc.aio.AioRpcError)
                              else str(error))[:300]
                    if reason != waiting:
                        logger.info("validator waits: %s", reason)
                        waiting = reason
                await _wait(stop, self.cfg.interval_s - (time.monotonic() - started))
        finally:
            for channel in channels:
                await channel.close()
            logger.info("validator: %d pushes scored", self.judged)


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    if seconds > 0:
        try:
            await asyncio.wait_for(stop.wait(), seconds)
        except asyncio.TimeoutError:
            pass
