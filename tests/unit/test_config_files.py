"""`--config FILE` (TOML or JSON): a file's settings become a command's defaults, the
command line wins, and bad files get a clear error before anything starts."""

import subprocess
import sys

import pytest

from diloco.cli.main import _deepest_parser
from diloco.command import build_parser
from diloco.errors import InvalidArgument, NotFound
from diloco.cli.settings import apply_config, read_config


def _parse(argv, path):
    parser = build_parser()
    args, _ = parser.parse_known_args(argv)
    apply_config(_deepest_parser(parser, args), read_config(str(path)), str(path))
    return parser.parse_args(argv)


def test_a_file_sets_the_defaults_and_the_command_line_wins(tmp_path):
    toml = tmp_path / "shard.toml"
    toml.write_text('quorum = 2\ngrace = "1.5"\nouter-lr = 0.7\nmerge = "mean"\nreflection = true\nsync_every = 16\n')
    args = _parse(["syncer", "--config", str(toml), "--quorum", "3"], toml)
    assert (args.quorum, args.grace, args.outer_lr, args.merge, args.reflection, args.sync_every) == \
        (3, ("fixed", 1.5), 0.7, "mean", True, 16)
    js = tmp_path / "learner.json"
    js.write_text('{"steps": 7, "precision": "bf16", "task_option": ["a=1", "b=2"], "inner_optimizer": "adamw-pooled"}')
    args = _parse(["learner", "--config", str(js)], js)
    assert (args.steps, args.precision, args.task_option, args.inner_optimizer) == \
        (7, "bf16", ["a=1", "b=2"], "adamw-pooled")


def test_a_file_turns_off_a_flag_that_has_a_no_form(tmp_path):
    """``--x/--no-x`` flags: ``x = false`` in a file is off (it was read as the string
    "false", which is true: ``diloco local --no-fork-server`` and ``--no-error-feedback``
    reached their processes on)."""
    js = tmp_path / "coordinator.json"
    js.write_text('{"fork_server": false}')
    assert _parse(["coordinator", "--config", str(js)], js).fork_server is False
    js.write_text('{"fork_server": true}')
    assert _parse(["coordinator", "--config", str(js)], js).fork_server is True
    js.write_text('{"no_fork_server": true}')
    assert _parse(["coordinator", "--config", str(js)], js).fork_server is False
    js.write_text('{"error_feedback": false}')
    assert _parse(["learner", "--config", str(js)], js).error_feedback is False
    assert _parse(["learner", "--config", str(js), "--error-feedback"], js).error_feedback is True
    js.write_text('{"fork_server": "false"}')
    with pytest.raises(InvalidArgument, match="fork_server takes true or false"):
        _parse(["coordinator", "--config", str(js)], js)


@pytest.mark.parametrize(("text", "why"), [
    ("nope = 1\n", "no setting 'nope' for this command"),
    ("quorum = 2.5\n", "quorum = 2.5"),
    ('merge = "median"\n', "must be one of rda, mean"),
    ('reflection = "yes"\n', "reflection takes true or false"),
    ("quorum = [1, 2]\n", "quorum takes one value"),
    ("quorum = \n", "is not TOML"),
])
def test_a_bad_file_is_refused_by_name(tmp_path, text, why):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(InvalidArgument, match=why):
        _parse(["syncer", "--config", str(path)], path)


def test_the_command_says_what_is_wrong_without_a_traceback(tmp_path):
    with pytest.raises(NotFound, match="missing.toml"):
        read_config(str(tmp_path / "missing.toml"))
    path = tmp_path / "bad.toml"
    path.write_text("nope = 1\n")
    proc = subprocess.run([sys.executable, "-m", "diloco", "--insecure", "syncer", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no setting 'nope'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
