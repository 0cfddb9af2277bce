"""The Hugging Face task (diloco.tasks.hf_causal_lm): its byte-level tokenizer, its corpus
from text, JSONL and Parquet files, each bad option refused naming it, and --init from a
checkpoint directory whose tied weights are stored once."""

import json

import pytest
import torch

from diloco.errors import InvalidArgument, NotFound
from diloco.task import TaskContext, TaskError, build_task, load_init

SPEC = "diloco.tasks.hf_causal_lm:build"
SMALL = {"context": "16", "batch_size": "2", "hidden": "16", "layers": "1", "heads": "2", "intermediate": "32",
         "data_shards": "2", "eval_batches": "2"}


def build(options: dict, learner: int = 0):
    return build_task(SPEC, TaskContext(learner, 2, 0, torch.device("cpu"), {**SMALL, **options}))


def corpus(tmp_path, kind: str = "jsonl", docs: int = 60):
    """``docs`` documents of a few hundred bytes, as one JSONL file, a Parquet file or text files."""
    texts = [f"document {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(60)) for i in range(docs)]
    directory = tmp_path / kind
    directory.mkdir()
    if kind == "jsonl":
        (directory / "docs.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    elif kind == "parquet":
        import datasets

        datasets.Dataset.from_dict({"body": texts}).to_parquet(str(directory / "docs.parquet"))
    else:
        for i, t in enumerate(texts):
            (directory / f"doc{i:03}.txt").write_text(t)
    return directory, texts


def test_the_byte_tokenizer_is_the_bytes():
    from diloco.tasks.hf_causal_lm import byte_tokenizer

    tokenizer = byte_tokenizer()
    text = "héllo, wörld\n\t<|x|> ✓"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text
    assert len(tokenizer) == 257 and tokenizer.eos_token_id == 256


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "text"])
def test_each_learner_reads_its_shard_and_all_evaluate_on_the_same(tmp_path, kind):
    directory, texts = corpus(tmp_path, kind)
    column = {"column": "body"} if kind == "parquet" else {}
    tasks = [build({"data": str(directory), **column}, learner) for learner in (0, 1, 2)]
    assert tasks[0].eval_unit == "bits/byte"
    for a, b in zip(tasks[0].eval_batches, tasks[1].eval_batches):  # the same held-out documents
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    first = [next(iter(t.batches)) for t in tasks]
    assert not torch.equal(first[0][0], first[1][0])  # learners 0 and 1: different shards
    assert torch.equal(first[0][0], first[2][0])  # learner 2 reads shard 0 again (2 shards)
    x, y = first[0]
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])  # next-token targets
    assert bytes(x[0].tolist()).decode(errors="replace") in "\n".join(texts) or 256 in x[0].tolist()
    loss = tasks[0].loss(tasks[0].model, first[0])
    assert loss.ndim == 0 and 4 < float(loss.detach()) < 7  # about ln(257) for an untrained model


def test_every_bad_option_is_refused_naming_it(tmp_path):
    directory, _ = corpus(tmp_path)
    cases = [
        ({"config": str(tmp_path / "nowhere.json")}, NotFound, "task option config=.*no such file"),
        ({"config": str(directory / "docs.jsonl")}, InvalidArgument, "task option config=.*not a model config"),
        ({"checkpoint": str(tmp_path)}, NotFound, "task option checkpoint=.*no config.json"),
        ({"config": "a", "checkpoint": "b"}, InvalidArgument, "task options config and checkpoint: give one"),
        ({"tokenizer": str(tmp_path / "none")}, NotFound, "task option tokenizer=.*no such directory"),
        ({"tokenizer": str(directory)}, InvalidArgument, "task option tokenizer=.*not a tokenizer directory"),
        ({"data": str(tmp_path / "empty")}, NotFound, "no data at .*empty"),
        ({"data": str(directory), "column": "body"}, InvalidArgument, "task option column=body: the data has no such "
                                                                      "column .*text, id"),
        ({"hidden": "15"}, InvalidArgument, "task options hidden=15, heads=2: hidden must divide by heads"),
        ({"context": "0"}, InvalidArgument, "task option context must be >= 1"),
        ({"data": str(directory), "data_shards": "100"}, InvalidArgument, "task option data: 60 documents are too few for 100 data shards"),
    ]
    for options, kind, message in cases:  # (the task's error, as build_task reports it: one line)
        with pytest.raises(TaskError, match=f"raised {kind.__name__}: {message}"):
            build({"data": str(directory), **options})
            pytest.fail(f"{options} was taken")
    small_vocab = tmp_path / "config.json"
    small_vocab.write_text(json.dumps({"model_type": "llama", "vocab_size": 100, "hidden_size": 16, "intermediate_size": 32,
                                       "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 16}))
    with pytest.raises(TaskError, match="task option tokenizer: its 257 tokens do not fit the model's 100"):
        build({"data": str(directory), "config": str(small_vocab)})
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("x")
    (tmp_path / "mixed" / "b.jsonl").write_text('{"text": "y"}\n')
    with pytest.raises(TaskError, match="files of one kind"):
        build({"data": str(tmp_path / "mixed")})


def test_a_config_file_builds_its_architecture_from_the_seed(tmp_path):
    directory, _ = corpus(tmp_path)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 257, "n_embd": 16, "n_layer": 1, "n_head": 2,
                                  "n_positions": 16}))
    a, b = (build({"data": str(directory), "config": str(config)}, learner) for learner in (0, 1))
    assert type(a.model).__name__ == "GPT2LMHeadModel"
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), name  # every learner builds the same model


def test_init_from_a_checkpoint_directory_with_tied_weights(tmp_path):
    directory, _ = corpus(tmp_path)
    trained = build({"data": str(directory)})
    with torch.no_grad():
        for p in trained.model.parameters():
            p.add_(torch.randn_like(p))
    trained.save_pretrained(tmp_path / "hf")
    stored = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert stored["tie_word_embeddings"] is True
    fresh = build({"data": str(directory)})
    load_init(SPEC, fresh.model, str(tmp_path / "hf"))
    for (name, x), (_, y) in zip(trained.model.state_dict().items(), fresh.model.state_dict().items()):
        assert torch.equal(x, y), name
    # The same directory through --init, and as the checkpoint to start from.
    via_init = build_task(SPEC, TaskContext(0, 2, 0, torch.device("cpu"), {**SMALL, "data": str(directory)}),
                          init=str(tmp_path / "hf"))
    via_checkpoint = build({"data": str(directory), "checkpoint": str(tmp_path / "hf")})
    for task in (via_init, via_checkpoint):
        assert all(torch.equal(x, y) for x, y in zip(trained.model.state_dict().values(), task.model.state_dict().values()))
    # A directory of another model, or none of the files, is refused.
    other = build({"data": str(directory), "hidden": "32"})
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(TaskError, match="--init .*other does not fit the model"):
        load_init(SPEC, fresh.model, str(tmp_path / "other"))
    (tmp_path / "bare").mkdir()
    with pytest.raises(TaskError, match="a directory without model.safetensors"):
        load_init(SPEC, fresh.model, str(tmp_path / "bare"))


def test_building_and_saving_the_task_draws_no_progress_bar(tmp_path):
    """transformers drew "Loading weights" and "Writing model shards" bars on stderr, into
    diloco local's output and every learner's log. In a process of its own (nothing set
    before), a build from a checkpoint and a corpus, and a save, write nothing there."""
    import subprocess
    import sys

    directory, _ = corpus(tmp_path)
    script = f"""
import torch
from pathlib import Path
from diloco.task import TaskContext, build_task
small = {SMALL!r}
task = build_task({SPEC!r}, TaskContext(0, 2, 0, torch.device("cpu"), small))
task.save_pretrained(Path({str(tmp_path / "first")!r}))
again = build_task({SPEC!r}, TaskContext(0, 2, 0, torch.device("cpu"),
                                          {{**small, "checkpoint": {str(tmp_path / "first")!r}, "data": {str(directory)!r}}}))
again.save_pretrained(Path({str(tmp_path / "second")!r}))
print("built")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout == "built\n", proc.stderr[-3000:]
    assert (tmp_path / "second" / "config.json").is_file()
    assert "%|" not in proc.stderr and "\r" not in proc.stderr and "it/s]" not in proc.stderr, proc.stderr[-3000:]
