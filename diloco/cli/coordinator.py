"""``diloco coordinator`` and ``diloco admin``: their parsers and handlers, wired into
the ``diloco`` command by ``diloco.command.build_parser``.

Like the main CLI, parsers import nothing heavy; handlers import their implementation
when they run. The helpers shared with ``diloco.command`` are imported inside functions, so
``diloco.command`` may import this module at its top (also when it runs as ``__main__``). This module may read the environment (the Kubernetes chart passes the
admin token and the pod's namespace that way); nothing below it does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from pathlib import Path

from diloco.coordinator.config import CoordinatorConfig, KubernetesLauncherConfig, LocalLauncherConfig
from diloco.errors import FailedPrecondition, InvalidArgument, NotFound
from diloco.files import private_dir
from diloco.cli.settings import add_config_flag, add_flag, from_flags

ENDPOINTS_FILE = "endpoints.json"
ADMIN_TOKEN_FILE = "admin-token"


# --- diloco coordinator ----------------------------------------------------------------


def _pod_template(value: str) -> tuple[str, Path]:
    pool, sep, path = value.rpartition("=")
    return (pool if sep else "", Path(path))


def _read_token(path: Path, what: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as error:
        raise NotFound(f"cannot read {what} {path}: {error.strerror}") from None
    if not token:
        raise InvalidArgument(f"{what} {path} is empty")
    return token


def _admin_token(args: argparse.Namespace, data_dir: Path) -> str:
    """--admin-token-file, else $DILOCO_ADMIN_TOKEN, else DATA_DIR/admin-token (made on
    first start, owner-only)."""
    if args.admin_token_file:
        return _read_token(Path(args.admin_token_file), "admin token file")
    if os.environ.get("DILOCO_ADMIN_TOKEN"):
        return os.environ["DILOCO_ADMIN_TOKEN"]
    path = data_dir / ADMIN_TOKEN_FILE
    if path.exists():
        return _read_token(path, "admin token file")
    from diloco.coordinator.server import write_secret_file
    from diloco.auth import new_secret

    private_dir(data_dir)
    token = new_secret()
    write_secret_file(path, token)
    return token


def _coordinator(args: argparse.Namespace) -> int:
    import asyncio

    from diloco.coordinator.server import run_coordinator
    from diloco.cli.common import build_run_config, run_secret, start_telemetry

    run = build_run_config(args)
    data_dir = Path(args.data_dir)
    cfg = from_flags(
        args, CoordinatorConfig,
        data_dir=data_dir,
        shards=tuple(x for x in (args.shards or "").split(",") if x),
        snapshot_dir=args.snapshot_dir or None,
        restore=args.restore,
        health_port=args.health_port,
        advertise_address=args.advertise_address or "",
        local=from_flags(args, LocalLauncherConfig, command=(
            tuple(shlex.split(args.learner_command)) if args.learner_command
            else (sys.executable, "-m", "diloco", *args.transport, "learner"))),
        kubernetes=from_flags(
            args, KubernetesLauncherConfig,
            namespace=args.namespace or os.environ.get("POD_NAMESPACE", "default"),
            pod_templates=tuple(args.pod_template or ()),
            owner_configmap=args.owner_configmap or os.environ.get("DILOCO_OWNER_CONFIGMAP", ""),
        ),
    )
    if cfg.launcher == "kubernetes" and not cfg.kubernetes.pod_templates:
        raise InvalidArgument("--launcher kubernetes needs --pod-template [POOL=]PATH")
    port_file = Path(args.port_file) if args.port_file else None
    secret, admin_token = run_secret(args), _admin_token(args, data_dir)
    telemetry = start_telemetry(args, "coordinator")
    try:
        return asyncio.run(run_coordinator(run, cfg, secret, admin_token, port_file))
    finally:
        telemetry.shutdown()


def add_coordinator_parser(commands: argparse._SubParsersAction) -> None:
    from diloco.cli.common import add_run_config, add_telemetry

    p = commands.add_parser(
        "coordinator",
        help="run the coordinator: membership and leases, launchers, snapshots",
        description=(
            "Run the coordinator. Learners Join with the join token (DATA_DIR/join-token), heartbeat within "
            "the lease and are marked failed when it runs out; shards follow the membership stream. SIGTERM "
            "stops the learners it launched as processes, saves its state and exits 0; a restart resumes "
            "from DATA_DIR/coordinator-state.json."
        ),
    )
    add_config_flag(p)
    add_flag(p, "--host", CoordinatorConfig, "host")
    p.add_argument("--health-port", type=int, metavar="PORT",
                   help="also answer grpc.health.v1 in plaintext on PORT (for kubelet probes when --tls-dir "
                        "makes the main port mutual TLS)")
    add_flag(p, "--reflection", CoordinatorConfig, "reflection",
             action="store_true")
    add_flag(p, "--port", CoordinatorConfig, "port", type=int)
    add_flag(p, "--status-port", CoordinatorConfig, "status_port", type=int)
    add_flag(p, "--status-host", CoordinatorConfig, "status_host")
    p.add_argument("--port-file", help="write HOST:PORT here once serving")
    p.add_argument("--advertise-address", metavar="HOST:PORT", help="address launched learners use (default: the bound one)")
    p.add_argument("--data-dir", default="coordinator", help="state, tokens, learner logs, snapshots (default ./coordinator)")
    p.add_argument("--secret-file", help="file holding the run secret (default: $DILOCO_SECRET)")
    p.add_argument("--admin-token-file", help="admin token (default: $DILOCO_ADMIN_TOKEN, else DATA_DIR/admin-token, made if absent)")
    p.add_argument("--shards", metavar="HOST:PORT,...", help="every shard's address, in shard id order")
    add_flag(p, "--pools", CoordinatorConfig, "pools",
             shown=",".join, taken=lambda pools: tuple(x for x in pools.split(",") if x))
    add_flag(p, "--lease-s", CoordinatorConfig, "lease_s", type=float)
    add_flag(p, "--isolation-hold-leases", CoordinatorConfig, "isolation_hold_leases", type=float, metavar="N")
    add_flag(p, "--idle-timeout-s", CoordinatorConfig, "idle_timeout_s",
             type=float)
    add_flag(p, "--credential-lifetime-s", CoordinatorConfig, "credential_lifetime_s", type=float, metavar="S")
    add_flag(p, "--max-learners", CoordinatorConfig, "max_learners", type=int)
    add_flag(p, "--join-learners", CoordinatorConfig, "join_learners", type=int, metavar="N")
    add_flag(p, "--join-tokens-per-s", CoordinatorConfig, "join_tokens_per_s", type=float, metavar="R")
    add_flag(p, "--drain-timeout-s", CoordinatorConfig, "drain_timeout_s",
             type=float)
    add_flag(p, "--join-timeout-s", CoordinatorConfig, "join_timeout_s",
             type=float)
    add_flag(p, "--snapshot-timeout-s", CoordinatorConfig, "snapshot_timeout_s", type=float)
    p.add_argument("--snapshot-dir", help="where snapshots go: a directory or an fsspec URL such as s3://bucket/run "
                   "(default DATA_DIR/snapshots); shards and learners must reach the same place")
    add_flag(p, "--snapshot-every-s", CoordinatorConfig, "snapshot_every_s", type=float, metavar="S")
    add_flag(p, "--snapshot-keep", CoordinatorConfig, "snapshot_keep", type=int, metavar="N")
    p.add_argument("--restore", metavar="latest|ID", help="restart the run from a complete snapshot (learners re-join)")
    pin = p.add_argument_group("the run's model (docs/security.md: without a pin the first learner fixes it)")
    add_flag(pin, "--pin-model", CoordinatorConfig, "pin_model", action="store_true")
    add_flag(pin, "--model-sha256", CoordinatorConfig, "model_sha256", metavar="HEX")
    add_flag(p, "--launcher", CoordinatorConfig, "launcher",
             choices=["local", "kubernetes", "none"])
    add_flag(p, "--release", CoordinatorConfig, "release")
    local = p.add_argument_group("local launcher")
    local.add_argument("--learner-command", help="command line that starts a learner (default: this Python's -m diloco learner, "
                                                   "with this coordinator's --tls-dir or --insecure)")
    add_flag(local, "--terminate-timeout-s", LocalLauncherConfig, "terminate_timeout_s", type=float)
    add_flag(local, "--fork-server", LocalLauncherConfig, "fork_server",
             action=argparse.BooleanOptionalAction)
    add_flag(local, "--site-hub", LocalLauncherConfig, "site_hub", metavar="TAG/NETWORK")
    add_flag(local, "--link-mbit", LocalLauncherConfig, "link_mbit", type=float)
    k8s = p.add_argument_group("kubernetes launcher")
    k8s.add_argument("--namespace", help="namespace of learner pods (default $POD_NAMESPACE, else default)")
    k8s.add_argument("--pod-template", action="append", type=_pod_template, metavar="[POOL=]PATH",
                     help="pod template (YAML/JSON) for POOL, or for every pool without its own (repeatable)")
    add_flag(k8s, "--learner-container", KubernetesLauncherConfig, "container")
    add_flag(k8s, "--join-token-path", KubernetesLauncherConfig, "join_token_path")
    add_flag(k8s, "--kube-config", KubernetesLauncherConfig, "kube_config")
    k8s.add_argument("--owner-configmap", metavar="NAME",
                     help="ConfigMap (in --namespace) that owns learner pods, so deleting it deletes them "
                          "(default $DILOCO_OWNER_CONFIGMAP, else none: pods outlive everything)")
    add_telemetry(p)
    add_run_config(p)
    p.set_defaults(func=_coordinator, transport=[])  # --tls-dir or --insecure, for the learners it launches


# --- diloco admin ----------------------------------------------------------------------


def admin_run_dir(args: argparse.Namespace) -> Path | None:
    """The run directory the admin follows: --run-dir, else this directory if it is one
    (it holds endpoints.json), else None."""
    if args.run_dir:
        return Path(args.run_dir)
    return Path.cwd() if (Path.cwd() / ENDPOINTS_FILE).exists() else None


def check_admin_target(args: argparse.Namespace) -> None:
    """The coordinator an admin verb talks to is named (--coordinator, $DILOCO_COORDINATOR)
    or found in a run directory (--run-dir, or this one); else one line saying there is no
    run directory here and how to name one. ``cleanup`` talks to none."""
    if args.admin in ("cleanup", "join-credential") or args.coordinator or os.environ.get("DILOCO_COORDINATOR") or admin_run_dir(args):
        return
    raise InvalidArgument(
        f"no run directory here ({Path.cwd()} holds no {ENDPOINTS_FILE}) and no coordinator named: give --run-dir DIR "
        "(a `diloco local` run's directory), run the command inside one, or name the coordinator with "
        "--coordinator HOST:PORT --token-file FILE")


def _coordinator_address(args: argparse.Namespace) -> str:
    if args.coordinator:
        return args.coordinator
    if os.environ.get("DILOCO_COORDINATOR"):
        return os.environ["DILOCO_COORDINATOR"]
    check_admin_target(args)
    run_dir = admin_run_dir(args)
    path = run_dir / ENDPOINTS_FILE
    try:
        endpoints = json.loads(path.read_text())
    except OSError as error:
        raise NotFound(f"cannot read {path}: {error.strerror}") from None
    except ValueError as error:
        raise InvalidArgument(f"{path} is not JSON: {error}") from None
    for entry in endpoints if isinstance(endpoints, list) else []:
        if isinstance(entry, dict) and entry.get("role") == "coordinator" and entry.get("address"):
            return entry["address"]
    raise NotFound(f"{path} lists no coordinator")


def _run_config(args: argparse.Namespace):
    """The run's config for an export that builds the task: --run-config, else the run
    directory's run.json."""
    from diloco.config import RunConfig

    run_dir = admin_run_dir(args)
    path = Path(args.run_config) if args.run_config else run_dir / "run.json" if run_dir is not None else None
    if path is None:
        raise InvalidArgument("--format hf builds the run's task: pass --run-config FILE (the run's run.json) or "
                              "--run-dir DIR")
    try:
        return RunConfig.from_json(path.read_text())
    except OSError as error:
        raise NotFound(f"cannot read the run config {path}: {error.strerror}") from None


def _token(args: argparse.Namespace) -> str:
    if args.token_file:
        return _read_token(Path(args.token_file), "admin token file")
    if os.environ.get("DILOCO_ADMIN_TOKEN"):
        return os.environ["DILOCO_ADMIN_TOKEN"]
    run_dir = admin_run_dir(args)
    if run_dir is None:
        raise InvalidArgument("no admin token: pass --token-file PATH or --run-dir DIR, or set DILOCO_ADMIN_TOKEN")
    return _read_token(run_dir / ADMIN_TOKEN_FILE, "admin token file")


@contextlib.contextmanager
def _client(args: argparse.Namespace):
    """The admin client of the coordinator ``args`` name, closed when the block ends."""
    from diloco import rpc
    from diloco.clients.coordinator import AdminClient

    run_dir = admin_run_dir(args)
    if not rpc.tls_enabled() and run_dir is not None and (run_dir / "tls").is_dir():
        rpc.use_tls(rpc.Tls.from_dir(run_dir / "tls"))  # a `diloco local --tls` run: its certificates
    client = AdminClient(_coordinator_address(args), _token(args), timeout_s=args.timeout_s,
                         unreachable_hint=_run_state(run_dir) if run_dir is not None else "")
    try:
        yield client
    finally:
        client.close()


def _run_state(run_dir: Path) -> str:
    """What a run directory says about its run, for when its coordinator does not answer."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return (f"the run in {run_dir} has no summary.json: it is starting, or its supervisor was killed "
                f"(`diloco local --resume {run_dir}` continues it from its newest snapshot, if it has one).")
    ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(summary.get("started_unix", 0) + summary.get("wall_s", 0)))
    if summary.get("interrupted"):
        return (f"{run_dir}/summary.json says the run was stopped at {ended} "
                f"(`diloco local --resume {run_dir}` continues it).")
    return f"{run_dir}/summary.json says the run finished at {ended}."


def _ago(unix_ms: int, now_s: float) -> str:
    return "-" if not unix_ms else f"{max(0.0, now_s - unix_ms / 1000):.1f} s ago"


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=True, header_style="bold")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:  # a log or a pipe: no table squeezed into 80 columns
        console.width = 160
    console.print(table)


def _members(args: argparse.Namespace) -> int:
    with _client(args) as client:
        learners, launches = client.listing(include_gone=args.all)
    if args.json:
        print(json.dumps(learners))
        return 0
    now = time.time()
    loss = lambda value: "" if value is None else f"{value:.3f}"  # noqa: E731
    rows = [
        [l["id"], l["state"], l["pool"], l["address"], _ago(l["last_heartbeat_unix_ms"], now),
         str(l["tokens"]), f"{l['tokens_per_s']:,.0f}", str(l["inner_steps"]), str(l["version_lag"]),
         loss(l["train_loss"]), loss(l["eval_loss"])]
        for l in learners
    ]
    _table(f"{len(learners)} learners", ["id", "state", "pool", "address", "heartbeat", "tokens", "tokens/s", "steps", "lag",
                                         "train loss", "eval loss"], rows)
    if launches:
        _table("launches not joined", ["launch id", "state", "pool", "since", "detail"],
               [[x["launch_id"], x["state"], x["pool"], _ago(x["since_unix_ms"], now), x["detail"]] for x in launches])
    return 0


def _overrides(pairs: list[str] | None) -> dict[str, str]:
    overrides = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidArgument(f"--set takes KEY=VALUE, got {pair!r}")
        overrides[key] = value
    return overrides


def _add_learners(args: argparse.Namespace) -> int:
    if args.count <= 0:
        raise InvalidArgument(f"count must be >= 1, got {args.count}")
    if not (args.wait_s >= 0):
        raise InvalidArgument(f"--wait-s must be >= 0, got {args.wait_s}")
    with _client(args) as client:
        launches = client.add_learners(args.count, args.pool or "", _overrides(args.set))
        outcomes = _joined_or_failed(client, launches, args.wait_s)
    if args.json:
        print(json.dumps(outcomes))
    else:
        _table("launches", ["launch id", "outcome", "detail"], [[x["launch_id"], x["outcome"], x["detail"]] for x in outcomes])
    return 0 if all(x["outcome"] in ("joined", "launched") for x in outcomes) else 1


def _joined_or_failed(client, launches: list[dict], wait_s: float) -> list[dict]:
    """Each launch's outcome: joined (as which learner), failed (and why: its exit and the
    last lines of its log, from the coordinator), not joined within ``wait_s``, or, with
    ``wait_s`` 0, launched (not waited for)."""
    outcomes = {x["launch_id"]: {**x, "outcome": "launched" if x["ok"] else "failed", "learner_id": ""} for x in launches}
    pending = {i for i, x in outcomes.items() if x["ok"]} if wait_s > 0 else set()
    deadline = time.monotonic() + wait_s
    while pending:
        learners, not_joined = client.listing(include_gone=True)
        for learner in learners:
            if learner["launch_id"] in pending:
                outcomes[learner["launch_id"]].update(outcome="joined", learner_id=learner["id"],
                                                      detail=f"as {learner['id']} ({outcomes[learner['launch_id']]['detail']})")
        for launch in not_joined:
            if launch["launch_id"] in pending and launch["state"] == "failed":
                outcomes[launch["launch_id"]].update(outcome="failed", detail=launch["detail"])
        pending = {i for i in pending if outcomes[i]["outcome"] == "launched"}
        if pending and time.monotonic() >= deadline:
            for i in pending:
                outcomes[i].update(outcome="not joined",
                                   detail=f"not joined within {wait_s:g} s (`diloco admin members` shows it); {outcomes[i]['detail']}")
            break
        if pending:
            time.sleep(0.5)  # polling a remote state on a human's behalf
    return list(outcomes.values())


def _remove_learners(args: argparse.Namespace) -> int:
    if bool(args.ids) == bool(args.count):
        raise InvalidArgument("give learner ids or --count N, not both")
    if args.count is not None and args.count <= 0:
        raise InvalidArgument(f"count must be >= 1, got {args.count}")
    with _client(args) as client:
        removed = client.remove_learners(args.ids, args.count or 0, args.drain)
    if args.json:
        print(json.dumps(removed))
    else:
        print(f"{'draining' if args.drain else 'removed'}: {', '.join(removed)}")
    return 0


def _snapshot(args: argparse.Namespace) -> int:
    with _client(args) as client:
        snapshot_id = client.start_snapshot()
        info = {"id": snapshot_id, "state": "running"}
        deadline = time.monotonic() + args.wait_s
        while args.wait_s > 0:
            info = next((s for s in client.snapshots() if s["id"] == snapshot_id), info)
            if info["state"] != "running" or time.monotonic() >= deadline:
                break
            time.sleep(0.2)  # polling a remote state on a human's behalf
    if args.json:
        print(json.dumps(info))
    else:
        print(f"snapshot {snapshot_id}: {info['state']}" + (f" ({info['detail']})" if info.get("detail") else ""))
    return 1 if info["state"] == "failed" else 0


def _snapshots(args: argparse.Namespace) -> int:
    with _client(args) as client:
        snapshots = client.snapshots()
    if args.json:
        print(json.dumps(snapshots))
        return 0
    now = time.time()
    rows = [
        [str(s["id"]), s["state"], _ago(s["started_unix_ms"], now),
         f"{len(s['reported'])}/{len(s['participants'])}", s["manifest"] or s["detail"]]
        for s in snapshots
    ]
    _table(f"{len(snapshots)} snapshots", ["id", "state", "started", "reported", "manifest / detail"], rows)
    return 0


def _shards(args: argparse.Namespace) -> int:
    with _client(args) as client:
        shards = client.shards()
    if args.json:
        print(json.dumps(shards))
        return 0
    rows = []
    for s in shards:
        versions = sorted(s["versions"].values())
        rows.append([str(s["shard_id"]), s["address"], s["error"] or s["model_state"],
                     f"{versions[0]}–{versions[-1]}" if versions else "", str(s["rounds"]), str(len(s["live_learners"]))])
    _table(f"{len(shards)} shards", ["shard", "address", "model", "versions", "rounds", "live learners"], rows)
    return 0


def _accept_initial_values(args: argparse.Namespace) -> int:
    if not args.yes:
        raise InvalidArgument(
            f"accept-initial-values makes shard {args.shard}'s missing fragments restart from a learner's initial model, "
            "discarding what they had trained; restarting the shard with --restore (a snapshot) loses less. "
            "Pass --yes to do it anyway"
        )
    with _client(args) as client:
        result = client.accept_initial_values(args.shard, args.reason)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"shard {args.shard}: fragments {result['fragments']} take the next learner's initial values "
              f"({result['model_state']})")
    return 0


def _export(args: argparse.Namespace) -> int:
    from diloco.cli.export import assemble, check_new_dir, export_model, save_pretrained

    if args.format == "hf":
        run = _run_config(args)  # before the fetch
        check_new_dir(Path(args.out))
        with _client(args) as client:
            exported = assemble(client.export_model(args.deadline_s))
        save_pretrained(run, exported.state, Path(args.out))
    else:
        with _client(args) as client:
            exported = export_model(client, Path(args.out), timeout_s=args.deadline_s)
    info = {
        "path": str(args.out),
        "tensors": len(exported.state),
        "parameters": sum(t.numel() for t in exported.state.values()),
        "versions": {str(f): v for f, v in sorted(exported.versions.items())},
        "not_exported": list(exported.skipped),
    }
    if args.json:
        print(json.dumps(info))
    else:
        versions = ", ".join(f"{f}@{v}" for f, v in info["versions"].items())
        print(f"wrote {info['path']}: {info['tensors']} tensors, {info['parameters']:,} values; fragment versions {versions}"
              + (f"; not exported (large non-float tensors): {', '.join(exported.skipped)}" if exported.skipped else ""))
    return 0


def _cleanup(args: argparse.Namespace) -> int:
    from diloco.coordinator import sites

    if os.geteuid() != 0:
        raise FailedPrecondition("diloco admin cleanup removes network namespaces and links: run it as root")
    removed = sites.remove_dead()
    if args.json:
        print(json.dumps(removed))
    else:
        print(f"removed {len(removed)}: {', '.join(removed)}" if removed else "nothing to remove: no run left emulated sites")
    return 0


def _join_credential(args: argparse.Namespace) -> int:
    from diloco import auth
    from diloco.cli.common import run_secret
    from diloco.coordinator.server import LAUNCH_CREDENTIAL_PREFIX, RUN_CREDENTIAL

    if args.name == RUN_CREDENTIAL or args.name.startswith(LAUNCH_CREDENTIAL_PREFIX):
        raise InvalidArgument(f"the names {RUN_CREDENTIAL!r} and {LAUNCH_CREDENTIAL_PREFIX}* are the coordinator's own: "
                              "choose another")
    run_dir = admin_run_dir(args)
    if not args.secret_file and not os.environ.get("DILOCO_SECRET") and run_dir is not None:
        args.secret_file = str(run_dir / "secret")
    print(auth.join_credential(run_secret(args), args.name, args.learners, args.tokens_per_s))
    return 0


def add_admin_parser(commands: argparse._SubParsersAction) -> None:
    admin = commands.add_parser(
        "admin",
        help="operate a running coordinator: members, add/remove learners, snapshots",
        description=(
            "Talk to a coordinator's admin RPCs. The address and token come from --coordinator / --token-file, "
            "else $DILOCO_COORDINATOR / $DILOCO_ADMIN_TOKEN, else the run directory (--run-dir, or the current "
            "directory if it holds endpoints.json): DIR/endpoints.json and DIR/admin-token."
        ),
    )
    admin.add_argument("--coordinator", metavar="HOST:PORT", help="the coordinator's address")
    admin.add_argument("--token-file", help="file holding the admin token")
    admin.add_argument("--run-dir", help="run directory holding endpoints.json and admin-token")
    admin.add_argument("--timeout-s", type=float, default=10.0, help="deadline of each call (default 10 s)")
    verbs = admin.add_subparsers(dest="admin", required=True, metavar="VERB")

    members = verbs.add_parser("members", help="list learners (id, state, pool, address, heartbeat, tokens, tokens/s, steps, lag, "
                                                   "train and eval loss)")
    members.add_argument("--all", action="store_true", help="include failed and departed learners")
    members.add_argument("--json", action="store_true", help="print a JSON list")
    members.set_defaults(func=_members)

    add = verbs.add_parser("add-learners", help="launch N learners through the coordinator's launcher")
    add.add_argument("count", type=int, metavar="N")
    add.add_argument("--pool", help="pool to launch into (default: the coordinator's first pool)")
    add.add_argument("--set", action="append", metavar="KEY=VALUE", help="learner flag override, e.g. device=cpu (repeatable)")
    add.add_argument("--wait-s", type=float, default=120.0, metavar="S",
                     help="wait up to S seconds for each learner to join, and say which failed and why; exit 1 "
                          "unless all joined (default 120; 0: return once launched)")
    add.add_argument("--json", action="store_true", help="print the launch results as JSON")
    add.set_defaults(func=_add_learners)

    remove = verbs.add_parser("remove-learners", help="remove learners by id, or the N newest")
    remove.add_argument("ids", nargs="*", metavar="ID", help="learner ids, e.g. L3 L4")
    remove.add_argument("--count", type=int, help="remove the N newest learners instead")
    remove.add_argument("--drain", action="store_true", help="let them finish in-flight pushes and leave")
    remove.add_argument("--json", action="store_true", help="print the removed ids as JSON")
    remove.set_defaults(func=_remove_learners)

    mint = verbs.add_parser(
        "join-credential", help="mint a join credential: N learners at once, each credited at most R tokens/s",
        description="Print a join credential signed with the run secret (--secret-file, else $DILOCO_SECRET, else "
                    "RUN_DIR/secret): the coordinator admits at most N learners with it at once (PERMISSION_DENIED "
                    "beyond) and credits each at most R tokens per second. Talks to no coordinator.")
    mint.add_argument("name", help="its name (lowercase letters, digits, '-'): admissions are counted by it")
    mint.add_argument("--learners", type=int, required=True, metavar="N", help="learners it admits at once")
    mint.add_argument("--tokens-per-s", type=float, default=0.0, metavar="R",
                      help="the most tokens per second credited to each of its learners (default 0: none)")
    mint.add_argument("--secret-file", help="file holding the run secret")
    mint.set_defaults(func=_join_credential)

    _add_state_verbs(verbs)
    _add_repair_verbs(verbs)


def _add_state_verbs(verbs: argparse._SubParsersAction) -> None:
    """What a run holds: its snapshots and shards."""
    snapshot = verbs.add_parser("snapshot", help="start a Chandy-Lamport snapshot")
    snapshot.add_argument("--wait-s", type=float, default=0.0, help="wait up to this long for it to finish (exit 1 if it failed)")
    snapshot.add_argument("--json", action="store_true", help="print {id, state} as JSON")
    snapshot.set_defaults(func=_snapshot)

    snapshots = verbs.add_parser("snapshots", help="list snapshots (running, complete, failed)")
    snapshots.add_argument("--json", action="store_true", help="print a JSON list")
    snapshots.set_defaults(func=_snapshots)

    shards = verbs.add_parser("shards", help="every shard's model state (serving, empty, recovering), versions and rounds")
    shards.add_argument("--json", action="store_true", help="print a JSON list")
    shards.set_defaults(func=_shards)


def _add_repair_verbs(verbs: argparse._SubParsersAction) -> None:
    """An operator's decisions and exports: a shard's fresh start, a cleanup, the model."""
    accept = verbs.add_parser(
        "accept-initial-values",
        help="let a shard that came back without its state (and got no learner's anchor) start its missing "
             "fragments from fresh initial values",
        description="A shard restarted without its state takes its fragments only from learners' anchors or a "
                    "snapshot (--restore). When neither exists, this operator decision lets the next learner's "
                    "initial values in: those fragments restart from an untrained model.",
    )
    accept.add_argument("shard", type=int, metavar="SHARD", help="the shard id (diloco admin shards)")
    accept.add_argument("--reason", default="", help="kept on the shard's tape")
    accept.add_argument("--yes", action="store_true", help="confirm: the fragments' training is lost")
    accept.add_argument("--json", action="store_true", help="print {shard_id, fragments, model_state} as JSON")
    accept.set_defaults(func=_accept_initial_values)

    cleanup = verbs.add_parser(
        "cleanup", help="remove what killed local runs left on this machine: emulated sites (network namespaces, "
                        "veth pairs, bridges) whose run is gone; a live run's are kept (root)")
    cleanup.add_argument("--json", action="store_true", help="print the removed names as a JSON list")
    cleanup.set_defaults(func=_cleanup)

    export = verbs.add_parser(
        "export", help="write the global model as model.safetensors (the keys of the task model's state_dict), or "
                       "as a Hugging Face checkpoint directory (--format hf)",
        description="Fetch the global model from the shards (through the coordinator) and write it as a "
                    "safetensors file that load_state_dict takes on a fresh instance of the task's model, or "
                    "(--format hf, a Hugging Face task) as a directory that from_pretrained loads, tokenizer included.",
    )
    export.add_argument("--out", required=True, metavar="PATH",
                        help="file to write, e.g. model.safetensors; with --format hf a new directory")
    export.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                        help="safetensors: one file of the state_dict; hf: config.json, model.safetensors and the "
                             "tokenizer, written by the task (default safetensors)")
    export.add_argument("--run-config", metavar="FILE",
                        help="with --format hf: the run's run.json, to build its task (default: the run directory's)")
    export.add_argument("--deadline-s", type=float, default=600.0, help="deadline of the whole export (default 600 s)")
    export.add_argument("--json", action="store_true", help="print {path, tensors, parameters, versions} as JSON")
    export.set_defaults(func=_export)
