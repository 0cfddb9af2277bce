"""A Hugging Face causal language model as a task (``--task diloco.tasks.hf_causal_lm:build``,
the ``hf`` extra): a ``transformers`` model built from a config or loaded from a local
checkpoint directory, its tokenizer, and a corpus of local text, JSONL or Parquet files
read with ``datasets``. Nothing is downloaded: every path is local, and the hub is never
asked (``local_files_only``).

Options (``--task-option KEY=VALUE``):

- ``config``: a ``config.json`` of any causal-LM architecture ``transformers`` knows; the
  model is built from it, initialised from the run's seed. ``checkpoint``: a local
  checkpoint directory (``save_pretrained``'s layout) to start from instead. Neither: a
  tiny Llama of ``hidden`` (64), ``layers`` (2), ``heads`` (4) and ``intermediate`` (192),
  tied embeddings, its vocabulary the tokenizer's.
- ``tokenizer``: a local tokenizer directory; default: the checkpoint's, else a byte-level
  one built here (each byte one token, plus ``<|endoftext|>``).
- ``data``: a file or a directory of files, all of one kind: text (``.txt``, ``.md``,
  ``.py``, ...; each file one document), ``.jsonl``/``.json`` or ``.parquet`` (each row's
  ``column``, default ``text``, one document). Default: the byte GPT's corpus, the Python
  standard library's sources.
- ``context`` (128), ``batch_size`` (16), ``data_shards`` (8), ``eval_batches`` (8).

Every 20th document is held out for evaluation (the same for every learner); learner i
trains on the documents of shard i mod ``data_shards``. The documents are tokenized, joined
with the end-of-text token, and batches are windows at offsets drawn from (seed, shard,
step), as the byte GPT's. The loss is the next-token cross entropy; the eval unit is bits
per byte with the byte-level tokenizer and nats per token with any other.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from diloco.errors import InvalidArgument, NotFound
from diloco.task import Task, TaskContext
from diloco.tasks.corpus import Split, corpus_files

EVAL_EVERY = 20
EVAL_SEED = 12345
END_OF_TEXT = "<|endoftext|>"
_ROWS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Options:
    config: str | None = None
    checkpoint: str | None = None
    tokenizer: str | None = None
    data: str | None = None
    column: str = "text"
    context: int = 128
    batch_size: int = 16
    data_shards: int = 8
    eval_batches: int = 8
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    intermediate: int = 192

    @classmethod
    def parse(cls, ctx: TaskContext) -> Options:
        texts = {name: ctx.option(name, getattr(cls, name)) for name in ("config", "checkpoint", "tokenizer", "data",
                                                                          "column")}
        sizes = {name: ctx.option(name, getattr(cls, name), int) for name in (
            "context", "batch_size", "data_shards", "eval_batches", "hidden", "layers", "heads", "intermediate")}
        for name, value in sizes.items():
            if value < 1:
                raise InvalidArgument(f"task option {name} must be >= 1, got {value}")
        if texts["config"] and texts["checkpoint"]:
            raise InvalidArgument("task options config and checkpoint: give one (a config builds a fresh model, a "
                                  "checkpoint starts from trained values)")
        return cls(**texts, **sizes)


def byte_tokenizer():
    """Each byte one token (ids 0..255, GPT-2's byte-to-character alphabet), and
    ``<|endoftext|>`` (256): a tokenizer every machine can build, with no file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    chars = {b: chr(b if b in alphabet else next(shifted)) for b in range(256)}
    vocab = {chars[b]: b for b in range(256)} | {END_OF_TEXT: 256}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT)


def _tokenizer(opts: Options):
    from transformers import AutoTokenizer

    where = opts.tokenizer or (opts.checkpoint if opts.checkpoint and _has_tokenizer(Path(opts.checkpoint)) else None)
    if where is None:
        return byte_tokenizer(), True
    if not Path(where).is_dir():
        raise NotFound(f"task option tokenizer={where}: no such directory")
    try:
        return AutoTokenizer.from_pretrained(where, local_files_only=True), False
    except (OSError, ValueError) as error:
        raise InvalidArgument(f"task option tokenizer={where}: not a tokenizer directory ({_first_line(error)})") from None


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _model(opts: Options, vocab: int, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if opts.checkpoint:
        if not (Path(opts.checkpoint) / "config.json").is_file():
            raise NotFound(f"task option checkpoint={opts.checkpoint}: no config.json there (a save_pretrained directory)")
        try:
            return AutoModelForCausalLM.from_pretrained(opts.checkpoint, local_files_only=True, dtype=torch.float32)
        except (OSError, ValueError) as error:
            raise InvalidArgument(f"task option checkpoint={opts.checkpoint}: {_first_line(error)}") from None
    if opts.config:
        try:
            fields = json.loads(Path(opts.config).read_text())
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        except FileNotFoundError:
            raise NotFound(f"task option config={opts.config}: no such file") from None
        except (OSError, ValueError, KeyError) as error:
            raise InvalidArgument(f"task option config={opts.config}: not a model config ({_first_line(error)})") from None
    else:
        if opts.hidden % opts.heads:
            raise InvalidArgument(f"task options hidden={opts.hidden}, heads={opts.heads}: hidden must divide by heads")
        config = LlamaConfig(vocab_size=vocab, hidden_size=opts.hidden, intermediate_size=opts.intermediate,
                             num_hidden_layers=opts.layers, num_attention_heads=opts.heads,
                             num_key_value_heads=opts.heads, max_position_embeddings=opts.context,
                             tie_word_embeddings=True, bos_token_id=None, eos_token_id=vocab - 1, pad_token_id=None)
    with torch.random.fork_rng(devices=[]):  # every learner builds the same model from the run's seed
        torch.manual_seed(seed)
        try:
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except ValueError as error:
            raise InvalidArgument(f"task option config={opts.config}: {_first_line(error)}") from None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def documents(opts: Options) -> list[str]:
    """The corpus's documents, in a fixed order (module docstring)."""
    import datasets

    files = corpus_files(opts.data) if opts.data is None or not Path(opts.data).is_dir() else sorted(
        p for p in Path(opts.data).rglob("*") if p.is_file() and not p.name.startswith("."))
    kinds = {_ROWS.get(f.suffix.lower(), "text") for f in files}
    if len(kinds) > 1:
        raise InvalidArgument(f"task option data={opts.data}: files of one kind, please (text, JSONL or Parquet); "
                              f"found {', '.join(sorted(kinds))}")
    if not files:
        raise NotFound(f"task option data={opts.data}: no files there")
    (kind,) = kinds
    with tempfile.TemporaryDirectory() as cache:  # datasets' Arrow cache, for this call only
        extra = {"sample_by": "document"} if kind == "text" else {}
        try:
            rows = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train", cache_dir=cache, **extra)
        except Exception as error:  # noqa: BLE001 -- a file datasets cannot read: one line naming it
            raise InvalidArgument(f"task option data={opts.data}: datasets cannot read it ({_first_line(error)})") from None
        column = "text" if kind == "text" else opts.column
        if column not in rows.column_names:
            raise InvalidArgument(f"task option column={column}: the data has no such column (it has "
                                  f"{', '.join(rows.column_names)})")
        return [str(text) for text in rows[column] if text]


def _tokens(tokenizer, texts: list[str]) -> torch.Tensor:
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    joined = [token for doc in ids for token in (*doc, tokenizer.eos_token_id)]
    return torch.tensor(joined, dtype=torch.int64)


def _quiet() -> None:
    """No progress bars from the libraries (transformers' "Loading weights" and "Writing
    model shards", datasets' splits): they are drawn on stderr, into diloco's output and
    logs, for loads of a second or less."""
    import datasets
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    datasets.disable_progress_bars()


def build(ctx: TaskContext) -> Task:
    _quiet()
    opts = Options.parse(ctx)
    tokenizer, byte_level = _tokenizer(opts)
    if tokenizer.eos_token_id is None:
        raise InvalidArgument(f"task option tokenizer={opts.tokenizer}: it has no end-of-text token to join documents")
    model = _model(opts, len(tokenizer), ctx.seed)
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise InvalidArgument(f"task option tokenizer: its {len(tokenizer)} tokens do not fit the model's "
                              f"{vocab} embeddings")
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and opts.context > positions:
        raise InvalidArgument(f"task option context={opts.context}: the model takes at most {positions} positions")
    docs = documents(opts)
    held_out = [d for i, d in enumerate(docs) if i % EVAL_EVERY == 0]
    training = [d for i, d in enumerate(docs) if i % EVAL_EVERY]
    shard = ctx.learner_index % opts.data_shards
    mine = training[shard::opts.data_shards]
    if len(training) < opts.data_shards or not held_out:
        raise InvalidArgument(f"task option data: {len(docs)} documents are too few for {opts.data_shards} data shards "
                              "plus an eval split (every 20th)")
    train, held = Split(_tokens(tokenizer, mine)), Split(_tokens(tokenizer, held_out))

    def batches():
        step = 0
        while True:
            yield train.batch(step, opts.batch_size, opts.context, ctx.seed)
            step += 1

    def save_pretrained(directory: Path) -> None:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    return Task(
        model=model.to(ctx.device),
        batches=batches(),
        loss=loss,
        tokens=lambda batch: batch[0].numel(),
        eval_batches=[held.batch(i, opts.batch_size, opts.context, EVAL_SEED) for i in range(opts.eval_batches)],
        eval_unit="bits/byte" if byte_level else "nats/token",
        eval_scale=1 / math.log(2) if byte_level else 1.0,
        save_pretrained=save_pretrained,
    )


def loss(model, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = (t.to(model.device) for t in batch)
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
