import json, os, sys, time
import torch
from diloco import telemetry
from diloco.config import RunConfig
from learner.config import LearnerConfig
from tools.bench import learner as bl
run_json, address, env, steps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
cfg = LearnerConfig(steps=steps, eval_every_steps=10**9, warmup_steps=10)
torch.set_num_threads(1)
handle = telemetry.start("learner", env, learner_id="L0")
def threads():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        stat = open(f"/proc/self/task/{tid}/stat").read()
        name = stat[stat.index("(")+1:stat.rindex(")")]
        f = stat[stat.rindex(")")+2:].split()
        out[tid] = (name, (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"))
    return out
before = threads()
cpu0 = time.process_time()
summary = bl._train(RunConfig.from_json(run_json), cfg, address).summary
cpu = time.process_time() - cpu0
after = threads()
agg = {}
for tid, (name, t) in after.items():
    agg[f"{name}-{tid}"] = t - before.get(tid, (name, 0))[1]
print(json.dumps({"traced": bool(handle.tracer_provider), "tokens_per_s": round(summary.tokens_per_s), "cpu_s": round(cpu, 2),
                  "tokens_per_cpu_s": round(summary.tokens / cpu), "threads": {k: round(v, 2) for k, v in sorted(agg.items(), key=lambda kv: -kv[1]) if v > 0.02}}))
handle.shutdown(timeout_s=10)
