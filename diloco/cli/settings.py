"""One source for a setting: a command-line flag that sets a config dataclass field takes
its default (and the "(default X)" of its help) from that field, and its help from the
field's docstring (``field_doc``), never from words or a number written again beside the
flag. docs/SETTINGS.md and the chart's schema descriptions are made from the same fields
(``diloco.lab.reference``); tests/unit/test_defaults.py checks the chart's values against
them."""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path


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


@functools.cache
def _module_tree(module: str) -> ast.Module:
    """The parsed source of ``module``, once per module (``inspect.getsource`` of a class
    parses its whole module each time: half of building the command's parser)."""
    return ast.parse(Path(inspect.getsourcefile(sys.modules[module])).read_text())


@functools.cache
def _docstrings(cls: type) -> dict[str, ast.expr | str | None]:
    """Each field of dataclass ``cls``: the docstring under it, else its default's
    expression (None: neither)."""
    scope: list[ast.stmt] = _module_tree(cls.__module__).body
    for name in cls.__qualname__.split("."):
        tree = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == name)
        scope = tree.body
    found: dict[str, ast.expr | str | None] = {}
    body = tree.body
    for node, after in zip(body, [*body[1:], None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                found[node.target.id] = after.value.value
            else:
                found[node.target.id] = node.value
    return found


def field_doc(cls: type, name: str) -> str:
    """The description of dataclass ``cls``'s field ``name``: the first paragraph of the
    docstring under it, on one line; for a field without one whose default is another
    config's field (``outer_lr: float = MergeConfig.outer_lr``), that field's description
    (one setting, one description). KeyError: the field has none."""
    owner = next((c for c in cls.__mro__ if is_dataclass(c) and name in _docstrings(c)), cls)
    if owner is not cls:  # a field a base class declares
        return field_doc(owner, name)
    doc = _docstrings(cls).get(name)
    if isinstance(doc, str):
        return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split()).replace("``", "`")
    if isinstance(doc, ast.Attribute) and isinstance(doc.value, ast.Name):
        owner = getattr(sys.modules[cls.__module__], doc.value.id, None)
        if is_dataclass(owner):
            return field_doc(owner, doc.attr)
    if isinstance(doc, ast.Call):  # field(default=Other.name, ...)
        for keyword in doc.keywords:
            value = keyword.value
            if keyword.arg == "default" and isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name):
                owner = getattr(sys.modules[cls.__module__], value.value.id, None)
                if is_dataclass(owner):
                    return field_doc(owner, value.attr)
    raise KeyError(f"{cls.__name__}.{name} has no docstring (nor a default that is another config's field)")


def add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, cls: type, name: str,
             *, shown: Callable[[object], object] | None = None, taken: Callable[[object], object] | None = None,
             **kwargs) -> argparse.Action:
    """``parser.add_argument(flag, ...)`` with ``cls.name``'s default and description
    (``field_doc``) as its help, and whose value ``from_flags`` puts back into that field.
    ``shown``: the default as the flag says it (MiB for a field in bytes, a comma list for
    a tuple), ``taken`` the way back. A switch (``action="store_true"``) needs a field that
    is off by default. The action remembers its field (``action.field``):
    tests/unit/test_defaults.py and docs/SETTINGS.md read it."""
    help = field_doc(cls, name)
    default = default_of(cls, name)
    if shown is not None:
        default = shown(default)
    if kwargs.get("action") == "store_true":
        if default is not False:
            raise ValueError(f"{flag} is a switch, but {cls.__name__}.{name} is on by default")
        help = help.replace("%", "%%")  # argparse formats help with %
        action = parser.add_argument(flag, help=f"{help} (default off)", **kwargs)
    else:
        action = parser.add_argument(flag, default=default, help=f"{help} (default {default if default != '' else 'none'})",
                                     **kwargs)
    action.field = (cls, name)
    # The command's namespace carries which flag sets which field (argument groups share
    # their parser's defaults), for from_flags.
    known = dict(parser.get_default(FIELDS) or {})
    known[cls, name] = (action.dest, taken)
    parser.set_defaults(**{FIELDS: known})
    return action


FIELDS = "_config_fields"


def from_flags(args: argparse.Namespace, cls: type, **given):
    """``cls`` with each field a flag of this command sets (``add_flag``) taken from
    ``args``; ``given`` sets the others (nested configs, values the command works out)
    and wins."""
    values = dict(given)
    for (owner, name), (dest, taken) in getattr(args, FIELDS, {}).items():
        if owner is cls and name not in values:
            value = getattr(args, dest)
            values[name] = taken(value) if taken is not None else value
    return cls(**values)


CONFIG_FLAG = "--config"


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(CONFIG_FLAG, metavar="FILE",
                        help="settings from a TOML or JSON file, one key per flag (its name without the leading "
                             "dashes; - or _); flags given on the command line win")


def read_config(path: str) -> dict:
    """The table of a ``--config`` file: TOML, or JSON for a name ending in .json."""
    import json
    import tomllib

    from diloco.errors import InvalidArgument, NotFound

    try:
        text = open(path, "rb").read()
    except OSError as error:
        raise NotFound(f"--config {path}: {error.strerror}") from None
    try:
        table = json.loads(text) if path.endswith(".json") else tomllib.loads(text.decode())
    except (ValueError, UnicodeDecodeError) as error:
        raise InvalidArgument(f"--config {path} is not {'JSON' if path.endswith('.json') else 'TOML'}: {error}") from None
    if not isinstance(table, dict):
        raise InvalidArgument(f"--config {path}: expected a table of settings, got {type(table).__name__}")
    return table


def apply_config(parser: argparse.ArgumentParser, table: dict, path: str) -> None:
    """Make the file's settings ``parser``'s defaults: a flag given on the command line
    still wins. Every value goes through its flag's own checks (type, choices) when the
    command line is parsed, as if it had been typed; an unknown key is an error naming it."""
    from diloco.errors import InvalidArgument

    actions = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--"):
                actions[option[2:].replace("-", "_")] = action
    defaults = {}
    for key, value in table.items():
        action = actions.get(str(key).replace("-", "_"))
        if action is None or action.dest in ("help", "config"):
            raise InvalidArgument(f"--config {path}: no setting {key!r} for this command (its flags: --help)")
        if isinstance(action, (argparse._StoreConstAction, argparse.BooleanOptionalAction)):
            if not isinstance(value, bool):
                raise InvalidArgument(f"--config {path}: {key} takes true or false, got {value!r}")
            if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x: "no_x = true" is x = false
                positive = f"--{str(key).replace('_', '-')}" == action.option_strings[0]
                defaults[action.dest] = value if positive else not value
            else:  # store_true / store_false
                defaults[action.dest] = value == action.const
        elif isinstance(action, argparse._AppendAction):
            values = value if isinstance(value, list) else [value]
            defaults[action.dest] = [_checked(action, v, key, path) for v in values]
        else:
            defaults[action.dest] = _checked(action, value, key, path)
    parser.set_defaults(**defaults)


def _checked(action: argparse.Action, value, key: str, path: str):
    """``value`` as the flag would take it from the command line (its type and choices)."""
    from diloco.errors import InvalidArgument

    if isinstance(value, (dict, list)) or value is None:
        raise InvalidArgument(f"--config {path}: {key} takes one value, got {value!r}")
    text = str(value).lower() if isinstance(value, bool) else str(value)
    try:
        converted = action.type(text) if action.type is not None else text
    except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
        raise InvalidArgument(f"--config {path}: {key} = {value!r}: {error or 'not a valid value'}") from None
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise InvalidArgument(f"--config {path}: {key} = {value!r}: must be one of {choices}")
    return converted
