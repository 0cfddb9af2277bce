import sysconfig
from pathlib import Path

import torch

from diloco.errors import NotFound
from diloco.tasks.corpus import corpus_files, load_corpus, stdlib_sources

import pytest


def test_default_corpus_is_the_stdlib_and_shards_are_disjoint():
    files = corpus_files(None)
    assert any(f.name == "argparse.py" for f in files)
    a, b = load_corpus(None, 0, 8), load_corpus(None, 1, 8)
    assert a.train.tokens.numel() > 100_000 and a.eval.tokens.numel() > 50_000
    assert torch.equal(a.eval.tokens, b.eval.tokens)
    assert not torch.equal(a.train.tokens[:4096], b.train.tokens[:4096])


def test_the_stdlib_walk_finds_every_source_outside_tests_and_caches():
    """The pruning walk finds what a full search filtered afterwards finds (the data, so
    every run's batches, depend on this list)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    expected = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    assert len(expected) > 100 and stdlib_sources() == expected


def test_batches_are_deterministic_in_the_step_cursor(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, " * 2000)
    corpus = load_corpus(str(tmp_path / "a.txt"), 0, 2)
    x1, y1 = corpus.train.batch(7, 4, 16, seed=1)
    x2, y2 = corpus.train.batch(7, 4, 16, seed=1)
    assert torch.equal(x1, x2) and torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(x1, corpus.train.batch(8, 4, 16, seed=1)[0])


def test_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(NotFound, match="no data at"):
        corpus_files(str(tmp_path / "nope"))
    with pytest.raises(NotFound, match="no text files"):
        corpus_files(str(tmp_path))
