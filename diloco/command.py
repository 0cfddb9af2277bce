"""The ``diloco`` command: the product's commands (``diloco.cli``) and the lab's
(``diloco.lab``) under one parser. The only module that imports both wings; the product
never imports the lab (tests/unit/test_layering.py)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from diloco.cli.main import COMMANDS as PRODUCT
from diloco.cli.main import build_parser as _build_parser
from diloco.cli.main import run
from diloco.lab.commands import COMMANDS as LAB

COMMANDS = PRODUCT + LAB


def build_parser() -> argparse.ArgumentParser:
    return _build_parser(COMMANDS)


def main(argv: Sequence[str] | None = None) -> int:
    return run(argv, COMMANDS)
