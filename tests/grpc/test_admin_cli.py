"""``diloco admin`` and ``diloco coordinator`` parsers, driven through a parser built
here (as ``diloco.command.build_parser`` will build it) against a real coordinator."""

import argparse
import asyncio
import contextlib
import io
import json
from pathlib import Path

import pytest

from diloco.cli.coordinator import add_admin_parser, add_coordinator_parser
from diloco.errors import DilocoError, FailedPrecondition, InvalidArgument, NotFound, Unauthenticated
from tests.grpc.conftest import run
from tests.grpc.coordinator_fixtures import ADMIN, joined, running_coordinator


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diloco")
    commands = p.add_subparsers(dest="command", required=True)
    add_coordinator_parser(commands)
    add_admin_parser(commands)
    return p


def diloco(*argv) -> tuple[int, str]:
    """Run a command like ``main`` does (blocking; call it off the event loop)."""
    args = parser().parse_args([str(a) for a in argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = args.func(args)
    return code, out.getvalue()


def run_dir(tmp_path: Path, address: str, token: str = ADMIN) -> Path:
    directory = tmp_path / "run"
    directory.mkdir(exist_ok=True)
    endpoints = [
        {"role": "syncer", "address": "127.0.0.1:1", "pid": 1},
        {"role": "coordinator", "address": address, "pid": 2},
    ]
    (directory / "endpoints.json").write_text(json.dumps(endpoints))
    (directory / "admin-token").write_text(token + "\n")
    return directory


def test_members_and_snapshots_as_json_and_tables(tmp_path):
    async def scenario():
        async with running_coordinator(tmp_path, pools=("default", "spot")) as server:
            await (await joined(server.address)).heartbeat(tokens=4096, tokens_per_s=1234.0, train_loss=2.71828)
            await (await joined(server.address, pool="spot")).leave("done")
            directory = run_dir(tmp_path, server.address)
            code, out = await asyncio.to_thread(diloco, "admin", "--run-dir", directory, "members", "--json")
            assert code == 0
            assert [(l["id"], l["state"], l["pool"], l["tokens_per_s"], l["train_loss"], l["eval_loss"])
                    for l in json.loads(out)] == [("L0", "active", "default", 1234.0, 2.71828, None)]
            _, out = await asyncio.to_thread(diloco, "admin", "--run-dir", directory, "members", "--all", "--json")
            assert [(l["id"], l["state"], l["pool"]) for l in json.loads(out)] == [("L0", "active", "default"), ("L1", "left", "spot")]
            _, table = await asyncio.to_thread(diloco, "admin", "--run-dir", directory, "members")
            assert "L0" in table and "active" in table and "1 learners" in table
            assert "1,234" in table and "2.718" in table and "train loss" in table

            token_file = directory / "admin-token"
            code, out = await asyncio.to_thread(
                diloco, "admin", "--coordinator", server.address, "--token-file", token_file, "snapshot", "--json"
            )
            assert code == 0 and json.loads(out) == {"id": 1, "state": "running"}  # L0 has not reported
            _, out = await asyncio.to_thread(diloco, "admin", "--run-dir", directory, "snapshots", "--json")
            (snapshot,) = json.loads(out)
            assert (snapshot["id"], snapshot["state"], snapshot["participants"]) == (1, "running", ["L0"])
            _, table = await asyncio.to_thread(diloco, "admin", "--run-dir", directory, "snapshots")
            assert "running" in table and "0/1" in table

    run(scenario())


def test_snapshot_wait_and_remove(tmp_path):
    async def scenario():
        async with running_coordinator(tmp_path) as server:
            directory = run_dir(tmp_path, server.address)
            code, out = await asyncio.to_thread(diloco, "admin", "--run-dir", directory, "snapshot", "--wait-s", 10, "--json")
            assert code == 0 and json.loads(out)["state"] == "complete"  # no participants: complete at once
            await joined(server.address)
            await joined(server.address)
            code, out = await asyncio.to_thread(diloco, "admin", "--run-dir", directory, "remove-learners", "--count", 1, "--drain", "--json")
            assert code == 0 and json.loads(out) == ["L1"]
            code, out = await asyncio.to_thread(diloco, "admin", "--run-dir", directory, "remove-learners", "L0")
            assert out.strip() == "removed: L0"

    run(scenario())


def test_bad_input_raises_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("DILOCO_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("DILOCO_COORDINATOR", raising=False)
    monkeypatch.chdir(tmp_path)

    async def scenario():
        async with running_coordinator(tmp_path) as server:
            directory = run_dir(tmp_path, server.address)
            cases = [
                (("admin", "members"), InvalidArgument, "no run directory here"),
                (("admin", "--coordinator", server.address, "members"), InvalidArgument, "no admin token"),
                (("admin", "--run-dir", tmp_path / "nowhere", "members"), NotFound, "cannot read"),
                (("admin", "--run-dir", directory, "add-learners", 0), InvalidArgument, "count must be >= 1, got 0"),
                (("admin", "--run-dir", directory, "add-learners", 2), FailedPrecondition, "has no launcher"),
                (("admin", "--run-dir", directory, "add-learners", 1, "--set", "novalue"), InvalidArgument, "KEY=VALUE"),
                (("admin", "--run-dir", directory, "remove-learners", "L0", "--count", 1), InvalidArgument, "not both"),
                (("admin", "--run-dir", directory, "remove-learners", "L5"), NotFound, "unknown learner 'L5'"),
            ]
            for argv, error, message in cases:
                with pytest.raises(error, match=message):
                    await asyncio.to_thread(diloco, *argv)
            (directory / "admin-token").write_text("wrong\n")
            with pytest.raises(Unauthenticated, match="invalid admin token"):
                await asyncio.to_thread(diloco, "admin", "--run-dir", directory, "members")
        with pytest.raises(DilocoError, match="no coordinator answers at"):
            await asyncio.to_thread(diloco, "admin", "--coordinator", server.address, "--token-file", directory / "admin-token",
                                    "--timeout-s", 2, "members")

    run(scenario())


def test_coordinator_flags_become_a_validated_config(tmp_path):
    args = parser().parse_args([
        "coordinator", "--shards", "a:1,b:2", "--pod-template", "spot=/t/spot.yaml", "--pod-template", "/t/any.yaml",
        "--lease-s", "0", "--data-dir", str(tmp_path),
    ])
    assert args.pod_template == [("spot", Path("/t/spot.yaml")), ("", Path("/t/any.yaml"))]
    with pytest.raises(InvalidArgument, match="lease_s must be a finite number > 0"):
        args.func(args)
    args = parser().parse_args(["coordinator", "--launcher", "kubernetes", "--data-dir", str(tmp_path)])
    with pytest.raises(InvalidArgument, match="needs --pod-template"):
        args.func(args)
    args = parser().parse_args(["coordinator", "--pools", "default,Spot!", "--data-dir", str(tmp_path)])
    with pytest.raises(InvalidArgument, match="pool must be lowercase"):
        args.func(args)


def test_what_an_operator_gets_wrong_is_said_plainly(tmp_path, capsys):
    """No coordinator at the address, a tape kind that is not there, an unknown flag: one
    line naming the problem and what to check, exit code 2, the usage of the command given."""
    import socket

    from diloco import command as cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    (tmp_path / "token").write_text("t")
    assert cli.main(["--insecure", "admin", "--coordinator", closed, "--token-file", str(tmp_path / "token"), "members"]) == 2
    err = capsys.readouterr().err
    assert f"no coordinator answers at {closed}" in err and "endpoints.json" in err and "Traceback" not in err

    tape = tmp_path / "tape.jsonl"
    tape.write_text('{"kind": "start", "t": 1.0}\n{"kind": "round", "t": 2.0}\n')
    assert cli.main(["tape", "show", str(tape), "--kind", "bogus"]) == 2
    assert "no records of kind bogus; its kinds: round, start" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exited:
        cli.main(["local", "--bogus"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "usage: diloco local" in err and "diloco local: error: unrecognized arguments: --bogus" in err


def test_diloco_local_never_writes_into_another_run_s_directory(tmp_path, capsys):
    """`diloco local --out DIR` on a finished, a stopped or a live run's directory used to
    overwrite its secret, config and endpoints and mix its tapes: now it refuses, says
    what is there, and touches nothing."""
    import subprocess
    import sys

    from diloco import command as cli

    finished, stopped, live, other = (tmp_path / name for name in ("finished", "stopped", "live", "other"))
    for directory in (finished, stopped, live, other):
        directory.mkdir()
    (finished / "config.json").write_text("{}")
    (finished / "summary.json").write_text("{}")
    (stopped / "config.json").write_text("{}")
    (other / "notes.txt").write_text("mine")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (live / "endpoints.json").write_text(json.dumps([{"role": "coordinator", "address": "x", "pid": sleeper.pid}]))
        expected = {finished: "a finished run (summary.json)",
                    stopped: "a run that stopped before it finished (config.json, no summary.json)",
                    live: f"a live run (coordinator pid {sleeper.pid})", other: "files"}
        for directory, what in expected.items():
            before = {p.name: p.read_text() for p in directory.iterdir()}
            assert cli.main(["local", "--out", str(directory)]) == 2
            err = capsys.readouterr().err
            assert f"--out {directory} already holds {what}" in err and "Traceback" not in err, err
            assert {p.name: p.read_text() for p in directory.iterdir()} == before
    finally:
        sleeper.kill()
        sleeper.wait()


def test_admin_on_a_run_directory_whose_coordinator_is_gone_says_what_became_of_the_run(tmp_path, capsys):
    import socket

    from diloco import command as cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    run = tmp_path / "run"
    run.mkdir()
    (run / "endpoints.json").write_text(json.dumps([{"role": "coordinator", "address": closed, "pid": 1}]))
    (run / "admin-token").write_text("t")
    cases = [
        (None, f"the run in {run} has no summary.json: it is starting, or its supervisor was killed"),
        ({"interrupted": True, "started_unix": 0, "wall_s": 1}, f"{run}/summary.json says the run was stopped at"),
        ({"interrupted": False, "started_unix": 0, "wall_s": 1}, f"{run}/summary.json says the run finished at"),
    ]
    for summary, said in cases:
        if summary is not None:
            (run / "summary.json").write_text(json.dumps(summary))
        assert cli.main(["admin", "--run-dir", str(run), "members"]) == 2
        err = capsys.readouterr().err
        assert f"no coordinator answers at {closed}" in err and said in err and "Traceback" not in err, err
        assert ("--resume" in err) == (summary is None or summary["interrupted"])


def test_admin_outside_a_run_directory_says_there_is_none_and_how_to_name_one(tmp_path, monkeypatch, capsys):
    """`diloco admin members` where no run is (no --run-dir, no --coordinator) blamed
    plaintext gRPC; what is missing is the run: one line saying so and how to name one,
    whatever the transport."""
    from diloco import command as cli

    for name in ("DILOCO_TLS_DIR", "DILOCO_INSECURE", "DILOCO_ADMIN_TOKEN", "DILOCO_COORDINATOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    expected = (f"diloco: error: no run directory here ({tmp_path} holds no endpoints.json) and no coordinator "
                "named: give --run-dir DIR (a `diloco local` run's directory), run the command inside one, or name the "
                "coordinator with --coordinator HOST:PORT --token-file FILE\n")
    for argv in (["admin", "members"], ["--insecure", "admin", "members"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.splitlines()[-1] + "\n" == expected, err
        assert "plaintext" not in err.replace("--insecure: plaintext gRPC", ""), err


def test_admin_inside_a_tls_run_s_directory_is_admin_with_run_dir_dot(tmp_path, monkeypatch, capsys):
    """`cd RUN_DIR && diloco admin members` was refused as plaintext although the run's
    certificates were right there: it now follows the directory as `--run-dir .` does."""
    from diloco import rpc
    from diloco.cli.certs import make_certs
    from diloco import command as cli

    for name in ("DILOCO_TLS_DIR", "DILOCO_INSECURE", "DILOCO_ADMIN_TOKEN", "DILOCO_COORDINATOR"):
        monkeypatch.delenv(name, raising=False)
    directory = tmp_path / "run"
    make_certs(directory / "tls", ["localhost", "127.0.0.1"])
    monkeypatch.chdir(directory)

    async def scenario():
        rpc.use_tls(rpc.Tls.from_dir(directory / "tls"))  # the coordinator serves mutual TLS only
        try:
            async with running_coordinator(tmp_path) as server:
                await joined(server.address)
                run_dir(tmp_path, server.address)
                answers = []
                for argv in (["admin", "members", "--json"], ["admin", "--run-dir", ".", "members", "--json"]):
                    rpc.use_tls(None)  # a fresh command: no transport chosen yet
                    code = await asyncio.to_thread(cli.main, argv)
                    answers.append((code, capsys.readouterr()))
        finally:
            rpc.use_tls(None)
        (inside, out_inside), (dot, out_dot) = answers
        assert inside == dot == 0, (out_inside.err, out_dot.err)
        assert out_inside.out == out_dot.out and [l["id"] for l in json.loads(out_inside.out)] == ["L0"]

    run(scenario())
