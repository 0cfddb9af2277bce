"""A small task that misbehaves on purpose, for learner ``fail_index`` only (the others
train normally; ``fail_index=all``: every learner, and the supervisor's build too):
``--task-option fail=MODE`` with MODE one of raise (build raises), type (build returns no
Task), nan (the loss turns NaN at step 3), short (the batches end after 5), scalar (the
loss is not a scalar), frozen (nothing to train), tokens (a bad count), step (the loss
raises ValueError at inner step ``fail_step``, default 5). ``evals=0``: no eval batches."""

import torch

import diloco


def build(ctx: diloco.TaskContext) -> diloco.Task:
    mode = ctx.option("fail", "none")
    which = ctx.option("fail_index", "1")
    failing = which == "all" or ctx.learner_index == int(which)
    fail_step = ctx.option("fail_step", 5, int)
    if failing and mode == "raise":
        raise RuntimeError("cannot open the dataset")
    if failing and mode == "type":
        return {"model": None}
    torch.manual_seed(ctx.seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if failing and mode == "frozen":
        model.requires_grad_(False)
    target = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

    # The inner step is the number of the batch drawn last (a step draws one batch and may
    # call the loss more than once: adamw-pooled calls it on each half).
    drawn = {"step": -1}

    def batches():
        g = torch.Generator().manual_seed(ctx.learner_index)
        step = 0
        while not (failing and mode == "short" and step == 5):
            x = torch.randn(32, 4, generator=g)
            drawn["step"] = step
            yield x, x @ target
            step += 1

    def loss(model, batch):
        x, y = batch
        value = torch.nn.functional.mse_loss(model(x), y)
        step = drawn["step"]
        if failing and mode == "step" and model.training and step == fail_step:
            raise ValueError(f"the batch of inner step {step} is corrupt")
        if failing and mode == "nan" and step >= 3 and model.training:
            return value * float("nan")
        if failing and mode == "scalar":
            return (model(x) - y) ** 2
        return value

    def tokens(batch):
        return -1 if failing and mode == "tokens" else batch[0].shape[0]

    g = torch.Generator().manual_seed(99)
    x = torch.randn(64, 4, generator=g)
    evals = [(x, x @ target)] if ctx.option("evals", 1, int) else []
    return diloco.Task(model=model, batches=batches(), loss=loss, tokens=tokens, eval_batches=evals, eval_unit="mse")
