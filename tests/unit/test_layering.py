"""Architectural rules (README, "Layout"): the pure cores and the kernel's pure modules
never import grpc or protos; services (learner, syncer, coordinator) import the kernel
(diloco) and never each other or a tool; the kernel imports no service and no tool;
tools (tools/) sit above everything; and no module imports itself back through others."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "diloco.v1", "opentelemetry")
# The kernel's own service-side modules, allowed to touch grpc/protos (telemetry.py: the
# OpenTelemetry providers every process installs; core code never imports it; clients/:
# the services' clients).
KERNEL_SERVICE_MODULES = {"rpc.py", "convert.py", "telemetry.py"}
SERVICES = ("learner", "syncer", "coordinator")
TOOLS = "tools"
PACKAGES = ("diloco", *SERVICES, TOOLS)
# The command line's modules: the only ones that read the environment.
CLI = ROOT / TOOLS / "cli"
# ... and the public own-loop API, once: Learner.join hands os.environ to
# rpc.choose_transport, so $DILOCO_TLS_DIR / $DILOCO_INSECURE mean what they mean to the CLI.
ENVIRONMENT_READS = {ROOT / "learner" / "api.py": 1}


def core_modules():
    for path in sorted((ROOT / "diloco").rglob("*.py")):
        rel = path.relative_to(ROOT / "diloco")
        if rel.parts[0] in ("v1", "clients") or rel.name in KERNEL_SERVICE_MODULES:
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
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.parent == CLI or "v1" in path.parts:
                continue
            text = path.read_text()
            if text.count("os.environ") + text.count("getenv(") > ENVIRONMENT_READS.get(path, 0):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def test_a_shard_process_does_not_import_torch():
    """The syncer is CPU-only numpy and C: importing torch would cost a shard about 220 MB
    of memory and two seconds of start-up (its initial fragments come from the first
    learner, over the wire)."""
    code = (
        "import sys, tools.cli.main, syncer.server, syncer.service, syncer.core.snapshot\n"
        "tools.cli.main.build_parser()\n"
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
    return module.split(".")[0] == TOOLS


def kernel_modules():
    """diloco/ less its generated stubs and diloco/__init__.py: the public API's facade,
    which hands out diloco.Learner (learner.api) on first use."""
    for path in sorted((ROOT / "diloco").rglob("*.py")):
        rel = path.relative_to(ROOT / "diloco")
        if rel.parts[0] != "v1" and rel != Path("__init__.py"):
            yield path


def test_services_import_only_the_kernel_never_each_other():
    """A learner reaches a shard or the coordinator through the kernel's clients and wire
    types (diloco.clients, diloco.wire), never through the other service's code; and no
    service imports a tool (the command line is a tool: tools/cli)."""
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


def _module_graph() -> dict[str, set[str]]:
    """Every module of ours (the C kernel too) and the modules of ours it imports, at its
    top or inside a function: ``from package import name`` counts as an import of the
    submodule when ``name`` is one, else of the package."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            modules[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
        for path in (ROOT / package).rglob("*.c"):
            modules[".".join(path.relative_to(ROOT).with_suffix("").parts)] = None

    def ours(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        graph[module] = set()
        if path is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                names = subs + ([node.module] if len(subs) < len(node.names) else [])
            else:
                continue
            graph[module] |= {m for m in map(ours, names) if m is not None and m != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = _module_graph()
    assert {"tools.cli.main", "learner.api", "diloco.codec._int4"} <= set(graph)
    assert "tools.local.supervisor" in graph["tools.local.run"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not _cycles(graph)
