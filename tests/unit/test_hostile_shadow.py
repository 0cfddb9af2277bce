"""The hostile harness's shadow (``diloco.lab.bench.hostile.Shadow``): the honest training a
``negate`` attacker negates follows the global values as an honest learner does, by the
rebase rule, so its outer gradient is a learner's progress since its anchor, not its
progress since the run began."""

from types import SimpleNamespace

import torch

from diloco.cli.metrics import supervisor_task
from diloco.lab.bench.hostile import Shadow
from diloco.learner.core.sync import Sent
from tests.seeded import gpt_run, model_plan

RUN = gpt_run(fragments=1)


def test_the_shadow_rebases_each_reply_onto_the_progress_made_since_its_push(monkeypatch):
    import diloco.learner.runner

    monkeypatch.setattr(diloco.learner.runner, "inner_step", lambda *args: None)  # the test trains by hand
    _, plan, _ = model_plan(RUN)
    shadow = Shadow(RUN.task, supervisor_task(RUN, 1))
    pieces = plan.fragments[0].pieces
    g = torch.Generator().manual_seed(0)

    def values():
        return [p.view(shadow.params[p.tensor]).detach().clone() for p in pieces]

    def train():
        step = [torch.randn(v.shape, generator=g) * 1e-2 for v in values()]
        with torch.no_grad():
            for p, s in zip(pieces, step):
                p.view(shadow.params[p.tensor]).add_(s)
        return step

    def call(anchor, sent_step=None):
        sent = None if sent_step is None else Sent(sent_step, None, 0, 0)
        learner = SimpleNamespace(anchors=lambda: {0: anchor}, plan=plan,
                                  book=SimpleNamespace(fragments={0: SimpleNamespace(sent=sent)}))
        shadow.train(learner)

    def close(a, b):
        return all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b))

    def moved(anchor):
        return [a + torch.randn(a.shape, generator=g) * 1e-2 for a in anchor]

    a0 = [v + 1 for v in values()]
    call(a0)
    assert close(values(), a0)  # the first anchor: taken as it is
    train()
    call(a0, sent_step=1)  # a push went out: it stands for the values now
    t2 = train()  # progress during the overlap
    a1 = moved(a0)
    call(a1)  # its reply: the new anchor plus the progress since the push, not since a0
    assert close(values(), [a + t for a, t in zip(a1, t2)])
    train()
    call(a1, sent_step=4)
    t4 = train()
    a2 = moved(a1)
    call(a2, sent_step=8)  # a reply and the next push in the same step: rebased, then recorded
    assert close(values(), [a + t for a, t in zip(a2, t4)])
    t5 = train()
    a3 = moved(a2)
    call(a3, sent_step=8)  # the anchor moved while push 8 is out (a re-sync): by the move
    assert close(values(), [a + t + u for a, t, u in zip(a3, t4, t5)])
    train()
    a4 = moved(a3)
    before = values()
    call(a4)  # push 8 answered: rebased onto the values it was sent with
    pushed_8 = [a + t for a, t in zip(a2, t4)]
    assert close(values(), [a + (b - p) for a, b, p in zip(a4, before, pushed_8)])
