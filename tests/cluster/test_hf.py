"""A Hugging Face model end to end: a tiny Llama trained by ``diloco local`` on a JSONL
corpus the test writes, exported in ``from_pretrained``'s layout while the run trains
(``diloco admin export --format hf``) and by the run at its end (RUN_DIR/hf), reloaded in
a fresh process that never imports this project, its eval loss reproduced and ``generate``
run; then a second run fine-tunes from that directory (``--init``) and starts at the
first run's final loss."""

import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch

from diloco.task import TaskContext, build_task

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

SPEC = "diloco.tasks.hf_causal_lm:build"
OPTIONS = {"context": "32", "batch_size": "8", "hidden": "32", "layers": "2", "heads": "4", "intermediate": "64"}

# In a fresh interpreter: transformers alone loads the export, evaluates the batches the
# test saved and generates; it must not have imported this project.
RELOAD = """
import json, math, sys
import torch
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

directory, batches = sys.argv[1], torch.load(sys.argv[2])
model, tokenizer = AutoModelForCausalLM.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
model.eval()
with torch.no_grad():
    losses = [F.cross_entropy(model(input_ids=x).logits.reshape(-1, model.config.vocab_size).float(), y.reshape(-1)).item()
              for x, y in batches]
    prompt = tokenizer("def ", return_tensors="pt")["input_ids"]
    generated = model.generate(prompt, max_new_tokens=12, do_sample=False)
print(json.dumps({"bits_per_byte": sum(losses) / len(losses) / math.log(2), "prompt": prompt.shape[1],
                  "generated": generated.shape[1], "text": tokenizer.decode(generated[0]),
                  "imported_diloco": any(name.split(".")[0] == "diloco"
                                         for name in sys.modules)}))
"""


def write_corpus(directory):
    """Documents of real text, the standard library's sources cut into pieces, as JSONL."""
    from diloco.tasks.corpus import stdlib_sources

    directory.mkdir()
    docs = []
    for path in stdlib_sources()[:40]:
        text = path.read_text(errors="replace")
        docs += [text[i:i + 2000] for i in range(0, min(len(text), 20000), 2000)]
    (directory / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return directory


def local(tmp_path, out, *extra, steps=40, background=False):
    options = [arg for key, value in OPTIONS.items() for arg in ("--task-option", f"{key}={value}")]
    command = [sys.executable, "-m", "diloco", "local", "--task", SPEC, *options, "--task-option",
               f"data={tmp_path / 'corpus'}", "--learners", "2", "--shards", "1", "--fragments", "2",
               "--steps", str(steps), "--out", str(out), *extra]
    if background:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{out.name}.log", "w"))
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def reload(tmp_path, directory) -> dict:
    proc = subprocess.run([sys.executable, "-c", RELOAD, str(directory), str(tmp_path / "eval.pt")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_train_export_reload_generate_and_fine_tune(tmp_path):
    write_corpus(tmp_path / "corpus")
    task = build_task(SPEC, TaskContext(0, 1, 0, torch.device("cpu"), {**OPTIONS, "data": str(tmp_path / "corpus")}))
    torch.save(task.eval_batches, tmp_path / "eval.pt")  # the run's eval batches, for the fresh process

    # A run that trains until stopped: exported through the admin CLI while it trains.
    run = tmp_path / "run"
    proc = local(tmp_path, run, "--time-limit-s", "120", steps=100000, background=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "learners").is_dir() or len(list((run / "learners").glob("*.events.jsonl"))) < 2 or \
                not any("train" in line for line in (run / "learners" / "L0.events.jsonl").read_text().splitlines()):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.5)
        live = subprocess.run([sys.executable, "-m", "diloco", "admin", "--run-dir", str(run), "export", "--format",
                               "hf", "--out", str(tmp_path / "live"), "--json"], capture_output=True, text=True, timeout=300)
        assert live.returncode == 0, live.stderr[-3000:]
        assert json.loads(live.stdout)["path"] == str(tmp_path / "live")
        again = subprocess.run([sys.executable, "-m", "diloco", "admin", "--run-dir", str(run), "export", "--format",
                                "hf", "--out", str(tmp_path / "live")], capture_output=True, text=True, timeout=120)
        assert again.returncode != 0 and "exists: give a new directory" in again.stderr and "Traceback" not in again.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130, (tmp_path / "run.log").read_text()[-3000:]
    assert {p.name for p in (tmp_path / "live").iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    live_model = reload(tmp_path, tmp_path / "live")
    assert math.isfinite(live_model["bits_per_byte"]) and not live_model["imported_diloco"]

    # The run's own export at its end: the final model, its eval reproduced by transformers alone.
    curves = [json.loads(line) for line in (run / "curves.jsonl").read_text().splitlines()]
    final = [r for r in curves if r["series"] == "global_eval"][-1]
    assert final["model"] == "final"
    reloaded = reload(tmp_path, run / "hf")
    assert not reloaded["imported_diloco"]
    assert abs(reloaded["bits_per_byte"] - final["loss"]) < 1e-4, (reloaded, final)
    assert final["loss"] < 7.0  # it trained (an untrained model: about 8 bits/byte)
    assert reloaded["generated"] == reloaded["prompt"] + 12 and reloaded["text"].startswith("def ")

    # Fine-tuning from the checkpoint directory starts where the first run ended.
    tuned = tmp_path / "tuned"
    local(tmp_path, tuned, "--init", str(run / "hf"), steps=10)
    summary = json.loads((tuned / "summary.json").read_text())
    assert abs(summary["eval_loss_start"] - final["loss"]) < 1e-4, (summary["eval_loss_start"], final["loss"])
    assert (tuned / "hf" / "model.safetensors").exists()
