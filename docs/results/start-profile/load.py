"""CPU seconds of what a learner loads before it can train, phase by phase, in a fresh
process (what the fork server pays once and each forked learner skips):

    for i in 1 2 3; do python docs/results/start-profile/load.py; done > docs/results/start-profile/load.txt
"""
import sys
import time

cpu = time.process_time()
import torch  # noqa: E402

phases = [("import torch", time.process_time() - cpu)]
cpu = time.process_time()
import learner.server  # noqa: E402,F401

phases.append(("import learner.server (grpc, numpy, OpenTelemetry, the learner)", time.process_time() - cpu))
cpu = time.process_time()
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
phases.append(("first AdamW (imports torch._dynamo)", time.process_time() - cpu))
print(" | ".join(f"{name}: {seconds:.2f} s" for name, seconds in phases),
      f"| total {sum(s for _, s in phases):.2f} s CPU; torch._dynamo loaded: {'torch._dynamo' in sys.modules}")
