"""Architectural rule: core modules and the shared kernel never import grpc or protos."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "diloco.v1", "opentelemetry")
# The kernel's own service-side modules, allowed to touch grpc/protos (telemetry.py: the
# OpenTelemetry providers every process installs; core code never imports it).
KERNEL_SERVICE_MODULES = {"rpc.py", "convert.py", "cli.py", "telemetry.py"}


def core_modules():
    for path in sorted((ROOT / "diloco").rglob("*.py")):
        rel = path.relative_to(ROOT / "diloco")
        if rel.parts[0] in ("v1", "bench") or rel.name in KERNEL_SERVICE_MODULES:
            continue
        yield path
    for package in ("learner", "syncer", "coordinator"):
        yield from sorted((ROOT / package).rglob("core*.py"))
        core_dir = ROOT / package / "core"
        if core_dir.is_dir():
            yield from sorted(core_dir.rglob("*.py"))


def imported_modules(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_core_does_not_import_grpc_or_protos():
    modules = list(core_modules())
    assert any(p.name == "fragments.py" for p in modules)
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in modules
        for name in imported_modules(path)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
    ]
    assert not offenders, offenders


def test_only_cli_reads_environment():
    offenders = []
    for package in ("diloco", "learner", "syncer", "coordinator"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "cli.py" or "v1" in path.parts:
                continue
            if "os.environ" in path.read_text() or "getenv(" in path.read_text():
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def test_a_shard_process_does_not_import_torch():
    """The syncer is CPU-only numpy and C: importing torch would cost a shard about 220 MB
    of memory and two seconds of start-up (its initial fragments come from the first
    learner, over the wire)."""
    code = (
        "import sys, diloco.cli, syncer.server, syncer.service, syncer.core.snapshot\n"
        "diloco.cli.build_parser()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "[]", done.stdout


def test_syncer_and_coordinator_import_no_model_code():
    """Shards and the coordinator plan from the model manifest a learner registers: no
    module of theirs imports the task package (the built-in byte GPT included) or a
    learner module, directly or through the kernel (torch is imported only by the
    learner-side client and the codec's fallback paths, never by a serving process)."""
    code = (
        "import sys, syncer.server, syncer.service, syncer.runtime, coordinator.server, coordinator.service\n"
        "print(sorted(m for m in sys.modules if m.startswith(('diloco.tasks', 'learner', 'torch'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "[]", done.stdout
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for package in ("syncer", "coordinator")
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in imported_modules(path)
        if name.startswith(("diloco.tasks", "diloco.task", "learner"))
    ]
    assert not offenders, offenders
