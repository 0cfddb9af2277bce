"""Reading fragments to host memory on XLA, two ways side by side in one run: XLA's own
`.cpu()` of each piece (what the learner did before) and the learner's read from the
devices' own shards (`Device.fragment_to_host`). Prints the XLA graphs each compiled
and the seconds each took for every fragment read `--rounds` times.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python scripts/xla_reads.py   # in the XLA venv
"""

import argparse
import time

import torch

from diloco.manifest import manifest_of, synced_tensors
from diloco.task import DEFAULT_TASK, TaskContext, build_task
from diloco.learner.device import Device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = Device("xla")
    task = build_task(DEFAULT_TASK, TaskContext(0, 1, 0, device.torch, {}), None)
    device.place_model(task.model)
    optimizer = torch.optim.AdamW(task.model.parameters())
    loss = task.loss(task.model, device.place_batch(next(iter(task.batches))))
    loss.backward()
    optimizer.step()
    device.step_done()
    manifest = manifest_of(task.model)
    plan, tensors = manifest.plan(args.fragments), synced_tensors(task.model, manifest)
    ways = {
        "xla .cpu() per piece": lambda f: [view.detach().cpu() for view in plan.gather(f, tensors)],
        "shards (fragment_to_host)": lambda f: device.fragment_to_host(plan, f, tensors),
    }
    print(f"byte GPT {sum(p.numel() for p in task.model.parameters()):,} parameters, {device.num_devices} devices, "
          f"{plan.num_fragments} fragments ({sum(len(f.pieces) for f in plan.fragments)} pieces), {args.rounds} rounds")
    for name, read in ways.items():
        graphs, started = device.compiles()[0], time.perf_counter()
        for _ in range(args.rounds):
            for fragment in range(plan.num_fragments):
                read(fragment)
        print(f"{name:28s} graphs compiled {device.compiles()[0] - graphs:5d}   seconds {time.perf_counter() - started:7.2f}")


if __name__ == "__main__":
    main()
