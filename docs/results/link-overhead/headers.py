"""The bytes a push and its reply carry besides the payload the learner counts, as
protobuf messages, for the default model of `diloco local` (4 fragments, int4 pushes):
the push's header message (``PushHeader``: its tensors' specs and the vector clock) and
the reply's update header (``FragmentUpdate``'s specs). gRPC adds 5 bytes a message;
HTTP/2 9 bytes a frame (DATA frames of at most 16 KiB) and a HEADERS frame per call (the
path, the deadline, the credential); TLS 1.3 22 bytes a record (at most 16 KiB).

    python docs/results/link-overhead/headers.py
"""

import torch

from diloco import auth
from diloco.clock import VectorClock
from diloco.codec import encode
from diloco.config import RunConfig
from diloco.convert import push_meta_to_proto
from diloco.manifest import manifest_of
from diloco.task import TaskContext, build_task
from diloco.syncer.config import MergeConfig
from diloco.wire import PushMeta

run = RunConfig()
task = build_task(run.task, TaskContext(0, 1, run.seed, torch.device("cpu"), dict(run.task_options)), run.init)
plan = manifest_of(task.model).plan(run.fragments)
state = task.model.state_dict()
clock = VectorClock({"C": 1234, "S0": 567, "S1": 589, "L0": 153, "L1": 150, "L2": 152})
for fragment in plan.fragments:
    encoded = [encode(p.name, p.view(state[p.tensor]).reshape(-1).clone(), encoding="fp32" if p.buffer else "int4",
                      block_size=MergeConfig().block_size) for p in fragment.pieces]
    meta = PushMeta("L0", fragment.id, 300, 2048, 8, 0.19, clock, tuple(e.spec for e in encoded))
    header = push_meta_to_proto(meta).SerializeToString()
    payload = sum(len(e.payload) for e in encoded)
    print(f"fragment {fragment.id}: {len(fragment.pieces)} tensors, int4 payload {payload:,} B, "
          f"push header message {len(header)} B ({len(header) / payload:.1%})")
credential = auth.Credential("L0", secret="s" * 64)
print("a call's metadata (learner id, credential):", sum(len(k) + len(v) for k, v in credential.metadata()), "B before HPACK")
