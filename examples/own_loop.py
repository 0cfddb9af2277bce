"""Decoupled DiLoCo around your own training loop (docs/own-loop.md walks through a run).

The model, data, loss and optimizer are all this file's: a small MLP fits a fixed
nonlinear function under the Huber loss, each learner drawing its own samples
(``learner.index`` picks them). ``diloco.Learner.join`` joins a running coordinator
over mutual TLS; ``learner.step`` after each optimizer step does the syncing.

    python own_loop.py --coordinator 127.0.0.1:7000 --join-token-file coord/join-token --tls-dir tls
    python own_loop.py --evaluate model.safetensors     # an export (diloco admin export)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import diloco

FEATURES = 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))


def samples(count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of the function to learn: sin(x·w) + x₀²/4, w fixed."""
    w = torch.linspace(-1.0, 1.0, FEATURES)
    x = torch.randn(count, FEATURES, generator=generator)
    return x, torch.sin(x @ w).unsqueeze(1) + x[:, :1] ** 2 / 4


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.huber_loss(model(x), y, delta=0.5)


HELD_OUT = samples(1024, torch.Generator().manual_seed(12345))


@torch.no_grad()
def evaluate(model: nn.Module) -> float:
    return float(loss_fn(model, *HELD_OUT))


def train(args: argparse.Namespace) -> None:
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    learner = diloco.Learner.join(model, coordinator=args.coordinator, optimizer=optimizer, tls_dir=args.tls_dir,
                                  join_token=Path(args.join_token_file).read_text().strip())
    with learner:  # leaves the run on exit, even on an error
        name = learner.learner_id
        data = torch.Generator().manual_seed(1000 + learner.index)  # this learner's share of the data
        start = evaluate(model)  # the run's global model: the learner starts from the shards' values
        print(f"{name}: eval loss {start:.4f} at step 0", flush=True)
        losses = []
        for step in range(1, args.steps + 1):
            x, y = samples(args.batch_size, data)
            loss = loss_fn(model, x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            learner.step(tokens=len(x))  # sends the fragments due, applies the replies due
            losses.append(loss.item())
            if step % 10 == 0:  # the status page's curve and the run's curves.jsonl
                learner.report_loss(train=sum(losses) / len(losses))
                losses = []
            if step % args.eval_every == 0:
                value = evaluate(model)
                learner.report_loss(eval=value)
                print(f"{name}: eval loss {value:.4f} at step {step} (version lag {learner.version_lag})", flush=True)
            if learner.should_stop:  # the coordinator drained this learner
                break
    s = learner.summary
    print(f"{name}: eval loss {start:.4f} -> {evaluate(model):.4f} in {s.inner_steps} steps "
          f"({s.pushes_sent} pushes, {s.replies_applied} replies applied)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="the coordinator's address")
    parser.add_argument("--join-token-file", default="coord/join-token", help="the coordinator's DATA_DIR/join-token")
    parser.add_argument("--tls-dir", help="the run's ca.crt, tls.crt and tls.key (default $DILOCO_TLS_DIR)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--evaluate", metavar="FILE.safetensors", help="print the eval loss of an exported model and exit")
    args = parser.parse_args()
    if args.evaluate:
        from safetensors.torch import load_file

        model = make_model()
        fresh = evaluate(model)
        model.load_state_dict(load_file(args.evaluate))
        print(f"{args.evaluate}: eval loss {evaluate(model):.4f} (the untrained model: {fresh:.4f})")
    elif args.coordinator:
        train(args)
    else:
        parser.error("give --coordinator HOST:PORT (train) or --evaluate FILE (evaluate an export)")


if __name__ == "__main__":
    main()
