"""Single-process model of DP against M averaged AdamW learners on the byte GPT (no wire, no quantization):
docs/results/outer/README.md, "A model without the wire". Run from the repository root with PYTHONPATH=. (run.sh).
"""
import argparse, copy, json, sys, time
import torch
from diloco.config import RunConfig
from diloco.lab.baseline.common import worker_task
from diloco.learner.config import LearnerConfig
from diloco.learner.runner import inner_optimizer
from diloco.task import evaluate
sys.path.insert(0, str(__import__('pathlib').Path(__file__).parent))
from nadam_exp import GlobalNoiseAdamW

ap = argparse.ArgumentParser()
ap.add_argument("--mode", default="dp")  # dp | avg
ap.add_argument("--H", type=int, default=1)
ap.add_argument("--M", type=int, default=4)
ap.add_argument("--steps", type=int, default=480)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--clip", type=float, default=1.0)
ap.add_argument("--outer-lr", type=float, default=1.0)
ap.add_argument("--outer-mom", type=float, default=0.0)
ap.add_argument("--points", type=int, default=8)
ap.add_argument("--noise-m", type=float, default=0)
ap.add_argument("--split", action="store_true")
ap.add_argument("--gain", action="store_true")
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--avg-m", action="store_true")
ap.add_argument("--avg-v", action="store_true")
a = ap.parse_args()
torch.manual_seed(a.seed)
run = RunConfig(seed=a.seed, task_options={"batch_size": str(a.batch)})
tasks = [worker_task(run, i, a.M) for i in range(a.M)]
for t in tasks[1:]:
    t.model.load_state_dict(tasks[0].model.state_dict())
cfg = LearnerConfig(steps=a.steps, lr=a.lr, inner_optimizer="adamw")  # plain AdamW: the experiments choose their own
its = [iter(t.batches) for t in tasks]
marks = {a.steps * k // a.points for k in range(1, a.points + 1)}
curve = []
t0 = time.time()
if a.mode == "dp":
    task = tasks[0]
    params = [p for p in task.model.parameters() if p.requires_grad]
    opt, sched = inner_optimizer(task, cfg)
    for step in range(a.steps):
        grads = None
        for i, t in enumerate(tasks):
            t.model.load_state_dict(task.model.state_dict()) if i else None
            loss = t.loss(t.model, next(its[i]))
            g = torch.autograd.grad(loss, [p for p in t.model.parameters() if p.requires_grad])
            grads = list(g) if grads is None else [x + y for x, y in zip(grads, g)]
        for p, g in zip(params, grads):
            p.grad = g / a.M
        if a.clip:
            torch.nn.utils.clip_grad_norm_(params, a.clip)
        opt.step(); sched.step(); opt.zero_grad()
        if step + 1 in marks:
            curve.append(round(evaluate("x", task), 4))
else:
    def make(t):
        if not a.noise_m:
            return inner_optimizer(t, cfg)
        from diloco.learner.core.schedule import inner_lr
        o = GlobalNoiseAdamW([p for p in t.model.parameters()], lr=cfg.lr, weight_decay=cfg.weight_decay, learners=1.0 if a.gain else a.noise_m)
        return o, torch.optim.lr_scheduler.LambdaLR(o, lambda s: inner_lr(s, 1.0, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio))
    opts = [make(t) for t in tasks]
    glob = [p.detach().clone() for p in tasks[0].model.parameters()]
    buf = [torch.zeros_like(p) for p in glob]
    for step in range(a.steps):
        for i, t in enumerate(tasks):
            opt, sched = opts[i]
            batch = next(its[i])
            if a.split:
                ps = [p for p in t.model.parameters() if p.requires_grad]
                half = batch[0].shape[0] // 2
                ga = torch.autograd.grad(t.loss(t.model, tuple(x[:half] for x in batch)), ps)
                gb = torch.autograd.grad(t.loss(t.model, tuple(x[half:] for x in batch)), ps)
                for p, x, y in zip(ps, ga, gb):
                    p.grad = (x + y) / 2
                    p.noise_sample = (x - y).pow(2) / 4
                if a.clip:
                    norm = torch.nn.utils.clip_grad_norm_(ps, a.clip)
                    c = min(1.0, a.clip / (float(norm) + 1e-6))
                    for p in ps:
                        p.noise_sample.mul_(c * c)
            else:
                loss = t.loss(t.model, batch)
                loss.backward()
                if a.clip:
                    torch.nn.utils.clip_grad_norm_(list(t.model.parameters()), a.clip)
            opt.step(); sched.step(); opt.zero_grad()
        if (step + 1) % a.H == 0:
            with torch.no_grad():
                for k, g in enumerate(glob):
                    if a.gain:
                        ds = []
                        for i2, t in enumerate(tasks):
                            p = list(t.model.parameters())[k]
                            st = opts[i2][0].state[p]
                            tt = st["t"]
                            vh = st["v"] / (1 - 0.999 ** tt)
                            nh = st["n"] / (1 - 0.999 ** tt)
                            pooled = torch.maximum(vh - (1 - 1 / a.noise_m) * nh, vh / a.noise_m)
                            ds.append((g - p) * ((vh + 1e-16) / (pooled + 1e-16)).sqrt())
                        delta = sum(ds) / a.M
                    else:
                        delta = sum(g - list(t.model.parameters())[k] for t in tasks) / a.M
                    buf[k].mul_(a.outer_mom).add_(delta)
                    g.sub_(a.outer_lr * (delta + a.outer_mom * buf[k]) if a.outer_mom else a.outer_lr * delta)
                    for t in tasks:
                        list(t.model.parameters())[k].copy_(g)
                    for key, on in (("exp_avg", a.avg_m), ("exp_avg_sq", a.avg_v)):
                        if on:
                            sts = [opts[i2][0].state[list(tasks[i2].model.parameters())[k]] for i2 in range(a.M)]
                            mean = sum(st[key] for st in sts) / a.M
                            for st in sts:
                                st[key].copy_(mean)
        if step + 1 in marks:
            curve.append(round(evaluate("x", tasks[0]), 4))
print(json.dumps(dict(args=vars(a), final=curve[-1], curve=curve, wall=round(time.time() - t0))), flush=True)
