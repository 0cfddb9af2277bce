import subprocess, sys, tempfile, json, os
from pathlib import Path
from diloco.config import RunConfig
from tools.bench import learner as bl
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
# python one_shard_cpu.py 120 4: four identical untraced runs against one shard, with the shard's CPU per run
steps = sys.argv[1]
run_cfg = RunConfig(sync_every_steps=16, overlap_steps=2, task_options={"eval_batches": "1"})
with tempfile.TemporaryDirectory() as tmp:
    shard, address = bl._start_shard(Path(tmp), run_cfg)
    try:
        for i in range(int(sys.argv[2])):
            c0 = cpu(shard.pid)
            out = subprocess.run([sys.executable, "docs/results/tracing-profile/learner_cpu.py", run_cfg.to_json(), address, "{}", steps], capture_output=True, text=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(i, "tokens/s", r["tokens_per_s"], "learner cpu", r["cpu_s"], "shard cpu", round(cpu(shard.pid) - c0, 2), flush=True)
    finally:
        shard.kill()
