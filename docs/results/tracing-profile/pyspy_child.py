import json, sys, time
import torch
from diloco.config import RunConfig
from learner.config import LearnerConfig
from tools.bench import learner as bl
run_json, address, env, steps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
cfg = LearnerConfig(steps=steps, eval_every_steps=10**9, warmup_steps=10)
print(json.dumps(bl._traced_learner(run_json, cfg, address, env, 1)))
