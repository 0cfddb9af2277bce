#!/usr/bin/env bash
# Train each example task with `diloco local` on its defaults (3 learners, 2 shards, 150
# inner steps each) and keep the raw results behind README's "Your own model" figures in
# docs/results/examples/<example>/: the command, its summary.json and its printed output.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/results/examples
for example in tied_lm cnn_bn byte_gpt; do
  run=$(mktemp -d)
  cmd=(diloco local --task "examples/$example.py:build" --out "$run/run" --json)
  mkdir -p "$out/$example"
  echo "${cmd[*]}" > "$out/$example/command.txt"
  "${cmd[@]}" > "$out/$example/stdout.txt" 2> "$run/stderr.txt"
  cp "$run/run/summary.json" "$out/$example/summary.json"
  python - "$run/run" "$example" >> "$out/$example/stdout.txt" <<'PY'
import sys, torch
from safetensors.torch import load_file
from diloco.config import RunConfig
from diloco.task import TaskContext, build_task, evaluate
run_dir, example = sys.argv[1], sys.argv[2]
run = RunConfig.from_json(open(f"{run_dir}/run.json").read())
task = build_task(run.task, TaskContext(0, 3, run.seed, torch.device("cpu"), dict(run.task_options)))
task.model.load_state_dict(load_file(f"{run_dir}/model.safetensors"))
print(f"{example}: model.safetensors loaded into a fresh instance: eval {evaluate(run.task, task):.4f} {task.eval_unit}")
PY
  diloco replay "$run/run" --check | tail -1 >> "$out/$example/stdout.txt"
  rm -rf "$run"
done
