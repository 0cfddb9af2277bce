"""Architectural rules: the pure cores and the kernel's pure modules never import grpc or
protos; services (learner, syncer, coordinator) never import each other, only the
kernel (diloco, less its tools); the kernel imports no service and no tool."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "diloco.v1", "opentelemetry")
# The kernel's own service-side modules, allowed to touch grpc/protos (telemetry.py: the
# OpenTelemetry providers every process installs; core code never imports it; clients/:
# the services' clients).
KERNEL_SERVICE_MODULES = {"rpc.py", "convert.py", "cli.py", "telemetry.py"}
SERVICES = ("learner", "syncer", "coordinator")
# What drives or measures a run: it lives in diloco/ for now (issue: a package of its own)
# and may import services; the kernel may not import it.
TOOLS = {"cli.py", "cli_coordinator.py", "local.py", "local_config.py", "compare.py", "chaos.py", "replay.py", "timeline.py", "export.py",
         "baseline", "bench", "simulate"}


def core_modules():
    for path in sorted((ROOT / "diloco").rglob("*.py")):
        rel = path.relative_to(ROOT / "diloco")
        if rel.parts[0] in ("v1", "bench", "clients") or rel.name in KERNEL_SERVICE_MODULES:
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
            if path.name in ("cli.py", "cli_coordinator.py") or "v1" in path.parts:
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


def _imports(path):
    return [(path.relative_to(ROOT), name) for name in imported_modules(path)]


def _is_tool(module: str) -> bool:
    return any(module == f"diloco.{t.removesuffix('.py')}" or module.startswith(f"diloco.{t.removesuffix('.py')}.")
               for t in TOOLS)


def kernel_modules():
    """diloco/ less its generated stubs, its tools and diloco/__init__.py: the public API's
    facade, which hands out diloco.Learner (learner.api) on first use."""
    for path in sorted((ROOT / "diloco").rglob("*.py")):
        rel = path.relative_to(ROOT / "diloco")
        if rel.parts[0] != "v1" and rel.parts[0] not in TOOLS and rel != Path("__init__.py"):
            yield path


def test_services_import_only_the_kernel_never_each_other():
    """A learner reaches a shard or the coordinator through the kernel's clients and wire
    types (diloco.clients, diloco.wire), never through the other service's code; and no
    service imports a tool (the command lines are tools: diloco/cli*.py)."""
    offenders = [
        f"{rel} imports {name}"
        for service in SERVICES
        for path in sorted((ROOT / service).rglob("*.py"))
        for rel, name in _imports(path)
        if (name.split(".")[0] in SERVICES and name.split(".")[0] != service) or _is_tool(name)
    ]
    assert any(p.name == "streamer.py" for p in (ROOT / "learner").rglob("*.py"))
    assert not offenders, offenders


def test_the_kernel_imports_no_service_and_no_tool():
    kernel = list(kernel_modules())
    assert {"wire.py", "syncer.py", "coordinator.py", "fragments.py"} <= {p.name for p in kernel}
    offenders = [
        f"{rel} imports {name}"
        for path in kernel
        for rel, name in _imports(path)
        if name.split(".")[0] in SERVICES or _is_tool(name)
    ]
    assert not offenders, offenders
