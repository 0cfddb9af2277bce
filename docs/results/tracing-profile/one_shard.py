import subprocess, sys, tempfile, json
from pathlib import Path
from diloco.config import RunConfig
from tools.bench import learner as bl
from tools.bench.otlp import OtlpReceiver
steps = sys.argv[1]
run_cfg = RunConfig(sync_every_steps=16, overlap_steps=2, task_options={"eval_batches": "1"})
with tempfile.TemporaryDirectory() as tmp:
    shard, address = bl._start_shard(Path(tmp), run_cfg)
    try:
        with OtlpReceiver() as receiver:
            for mode in sys.argv[2:]:
                env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"} if mode == "on" else {}
                out = subprocess.run([sys.executable, "docs/results/tracing-profile/learner_cpu.py", run_cfg.to_json(), address, json.dumps(env), steps], capture_output=True, text=True)
                print(mode, out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:])
    finally:
        shard.kill()
