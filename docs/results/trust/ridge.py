"""Why the validator judges a push against values read before it arrived: the CI's sybil
run (tests/cluster/test_hostile_local.py: the tiny model, 4 fragments) replayed in one
process, without the wire. A `negate` learner trains k inner steps from the initial
values w0 (its progress p), pushes 2.9 p (its outer gradient negated, x2.9); alone, the
round moves the global to w0 - 2.9 p. The validator trains 8 steps from the global and
takes the cosine of the push with its outer gradient, per fragment: from w0 (before the
merge) and from w0 - 2.9 p (after it). Then the loss along the line w0 + t p, and the plain
gradient's cosine with the push at w0 - 2.9 p.

    python docs/results/trust/ridge.py > docs/results/trust/ridge-output.txt
"""

import torch

from diloco.config import RunConfig
from diloco.learner.config import LearnerConfig
from diloco.learner.runner import inner_optimizer, inner_step
from diloco.manifest import manifest_of
from diloco.task import TaskContext, build_task
from diloco.validator.runner import LEARNING_RATE, VALIDATION_SEED

RUN = RunConfig(fragments=4, sync_every_steps=8,
                task_options={"width": "32", "depth": "1", "heads": "2", "context": "32", "batch_size": "8"})
STEPS = 8


def task(seed):
    return build_task(RUN.task, TaskContext(0, 1, seed, torch.device("cpu"), dict(RUN.task_options)), RUN.init)


def validator_direction(values):
    """The validator's outer gradient from ``values``: its 8 AdamW steps, global - trained."""
    val = task(RUN.seed + VALIDATION_SEED)
    val.model.load_state_dict(values)
    optimizer = torch.optim.AdamW([q for q in val.model.parameters() if q.requires_grad], lr=LEARNING_RATE)
    batches = iter(val.batches)
    for _ in range(STEPS):
        val.loss(val.model, next(batches)).backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = val.model.state_dict()
    return {n: values[n] - trained[n] for n in values}


def cosines(a, b, plan):
    out = []
    for fragment in plan.fragments:
        dot = na = nb = 0.0
        for piece in fragment.pieces:
            if piece.buffer:
                continue
            x, y = piece.view(a[piece.tensor]).reshape(-1).double(), piece.view(b[piece.tensor]).reshape(-1).double()
            dot, na, nb = dot + float(x @ y), na + float(x @ x), nb + float(y @ y)
        out.append(dot / (na * nb) ** 0.5)
    return " ".join(f"{c:+.3f}" for c in out)


def main():
    torch.manual_seed(0)
    shadow = task(RUN.seed)
    plan = manifest_of(shadow.model).plan(RUN.fragments)
    w0 = {k: v.detach().clone() for k, v in shadow.model.state_dict().items()}
    cfg = LearnerConfig()
    optimizer, schedule = inner_optimizer(shadow, cfg)
    batches = iter(shadow.batches)
    print("cosine of the negated push 2.9 p with the validator's outer gradient, fragments 0-3")
    print("k  judged from w0 (before its merge)   judged from w0 - 2.9 p (after it)")
    for k in range(1, STEPS + 1):
        inner_step(RUN.task, shadow, next(batches), optimizer, schedule, cfg.grad_clip)
        p = {n: shadow.model.state_dict()[n] - w0[n] for n in w0}
        push = {n: 2.9 * p[n] for n in w0}
        before = cosines(validator_direction(w0), push, plan)
        after = cosines(validator_direction({n: w0[n] - push[n] for n in w0}), push, plan)
        print(f"{k}  {before}          {after}")
    print(f"\nthe loss along w0 + t p (p after {STEPS} steps), the validator's first 8 batches")
    val = task(RUN.seed + VALIDATION_SEED)
    held = iter(val.batches)
    held = [next(held) for _ in range(8)]
    for t in (2, 1, 0, -1, -2, -2.9, -4, -6, -10):
        val.model.load_state_dict({n: w0[n] + t * p[n] for n in w0})
        with torch.no_grad():
            print(f"t {t:+5}: {sum(float(val.loss(val.model, b)) for b in held) / len(held):.4f}")
    val.model.load_state_dict({n: w0[n] - 2.9 * p[n] for n in w0})
    for b in held:
        val.loss(val.model, b).backward()
    gradient = {n: q.grad for n, q in val.model.named_parameters()}
    print(f"\nthe plain gradient at w0 - 2.9 p against the push, fragments 0-3: {cosines(gradient, {n: p[n] for n in gradient}, plan)}")
    print("(positive: the loss falls along -p there, the push's own direction of merge)")


if __name__ == "__main__":
    main()
