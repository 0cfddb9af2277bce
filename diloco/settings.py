"""One source for a setting's default: a command-line flag that sets a config dataclass
field takes its default (and the "(default X)" of its help) from that field, never from
a number written again beside the flag. tests/unit/test_defaults.py checks the chart's
values against the same fields."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields


def default_of(cls: type, name: str):
    """The default of dataclass ``cls``'s field ``name``."""
    for field in fields(cls):
        if field.name == name:
            if field.default is not MISSING:
                return field.default
            if field.default_factory is not MISSING:
                return field.default_factory()
            raise KeyError(f"{cls.__name__}.{name} has no default")
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, cls: type, name: str, help: str,
             **kwargs) -> argparse.Action:
    """``parser.add_argument(flag, ...)`` with ``cls.name``'s default, which its help shows."""
    default = default_of(cls, name)
    return parser.add_argument(flag, default=default, help=f"{help} (default {default})", **kwargs)
