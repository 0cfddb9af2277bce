"""The house's plan (docs/ARCHITECTURE.md, "The house"), checked on the imports of every
module of the one package ``diloco``, from the ground up:

- the kernel (``diloco/*.py``, ``codec``, ``clients``, ``tasks``) imports none of the rooms
  above it; its pure modules and the services' ``core`` never import grpc or protos;
- the services (``diloco.learner``, ``diloco.syncer``, ``diloco.coordinator``) import the
  kernel, never each other, the product's command line or the lab;
- the product's command line (``diloco.cli``) imports the kernel and the services, never
  the lab;
- the lab (``diloco.lab``) may import everything below it;
- the public API (``diloco/__init__.py``: ``diloco.Learner``, ``diloco.Task``) is for the
  product, the lab and users, never for the kernel or a service;
- ``diloco.command`` (the ``diloco`` command) alone puts the product's and the lab's
  commands together, and nothing imports it;
- no module imports itself back through others, and only the command line reads the
  environment."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "diloco"
FORBIDDEN = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "diloco.v1", "opentelemetry")
# The kernel's own service-side modules, allowed to touch grpc/protos (telemetry.py: the
# OpenTelemetry providers every process installs; core code never imports it; clients/:
# the services' clients).
KERNEL_SERVICE_MODULES = {"rpc.py", "convert.py", "telemetry.py"}
SERVICES = ("learner", "syncer", "coordinator", "validator")
PRODUCT = "cli"
LAB = "lab"
TOP = ("command.py", "__main__.py", "__init__.py")
"""diloco/__init__.py (the public API's facade, which hands out diloco.Learner on first
use), command.py and __main__.py (the ``diloco`` command): above every room."""
ROOMS = (*SERVICES, PRODUCT, LAB)
PIN = PACKAGE / "coordinator" / "pin.py"
"""The coordinator's ``--pin-model``: builds the model from the task when it is called
(importing torch and the task there, never at its top)."""
# The command line's modules: the only ones that read the environment ...
CLI = PACKAGE / PRODUCT
# ... and the public own-loop API, once: Learner.join hands os.environ to
# rpc.choose_transport, so $DILOCO_TLS_DIR / $DILOCO_INSECURE mean what they mean to the CLI.
ENVIRONMENT_READS = {PACKAGE / "learner" / "api.py": 1}


def room_of(path: Path) -> str:
    """The room a file of the package stands in: a service, ``cli``, ``lab``, ``v1``,
    ``top`` or ``kernel``."""
    rel = path.relative_to(PACKAGE)
    if len(rel.parts) == 1:
        return "top" if rel.name in TOP else "kernel"
    if rel.parts[0] in (*ROOMS, "v1"):
        return rel.parts[0]
    return "kernel"


def room_of_module(name: str) -> str | None:
    """The room a module name stands in (None: not ours)."""
    parts = name.split(".")
    if parts[0] != "diloco":
        return None
    if len(parts) == 1:
        return "api"  # diloco/__init__.py: diloco.Learner, diloco.Task, what a user imports
    if parts[1] in ("command", "__main__"):
        return "top"
    return parts[1] if parts[1] in (*ROOMS, "v1") else "kernel"


def files(*rooms: str):
    for path in sorted(PACKAGE.rglob("*.py")):
        if room_of(path) in rooms:
            yield path


def core_modules():
    for path in files("kernel"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] != "clients" and rel.name not in KERNEL_SERVICE_MODULES:
            yield path
    for service in SERVICES:
        yield from sorted((PACKAGE / service / "core").rglob("*.py"))


def imported_modules(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "diloco":
            yield from (f"diloco.{alias.name}" for alias in node.names)  # from diloco import rpc
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def offenders(paths, allowed: set[str]) -> list[str]:
    """Each import of ours, by the files given, of a room outside ``allowed``."""
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in paths
        for name in imported_modules(path)
        if room_of_module(name) not in (None, *allowed)
    ]


def test_room_of_places_each_kind_of_file():
    assert room_of(PACKAGE / "fragments.py") == "kernel"
    assert room_of(PACKAGE / "codec" / "int4.py") == "kernel"
    assert room_of(PACKAGE / "syncer" / "core" / "shard.py") == "syncer"
    assert room_of(PACKAGE / "cli" / "local" / "run.py") == "cli"
    assert room_of(PACKAGE / "lab" / "compare.py") == "lab"
    assert room_of(PACKAGE / "command.py") == "top"
    assert room_of_module("diloco.lab.compare") == "lab"
    assert room_of_module("diloco.cli.main") == "cli"
    assert room_of_module("diloco.wire") == "kernel"
    assert room_of_module("diloco.command") == "top"
    assert room_of_module("diloco") == "api"
    assert room_of_module("torch") is None
    # a lab import in the product is caught
    assert offenders([PACKAGE / "command.py"], {"kernel", "cli"}) != []


def test_core_does_not_import_grpc_or_protos():
    modules = list(core_modules())
    assert any(p.name == "fragments.py" for p in modules)
    assert any(p.name == "shard.py" for p in modules)
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in modules
        for name in imported_modules(path)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
    ]
    assert not found, found


def test_only_cli_reads_environment():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if CLI in path.parents or room_of(path) == "v1":
            continue
        text = path.read_text()
        if text.count("os.environ") + text.count("getenv(") > ENVIRONMENT_READS.get(path, 0):
            found.append(str(path.relative_to(ROOT)))
    assert not found, found


def test_a_shard_process_does_not_import_torch():
    """The syncer is CPU-only numpy and C: importing torch would cost a shard about 220 MB
    of memory and two seconds of start-up (its initial fragments come from the first
    learner, over the wire)."""
    code = (
        "import sys, diloco.command, diloco.syncer.server, diloco.syncer.service, diloco.syncer.core.snapshot\n"
        "diloco.command.build_parser()\n"
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
        "import sys, diloco.syncer.server, diloco.syncer.service, diloco.syncer.runtime, "
        "diloco.coordinator.server, diloco.coordinator.service\n"
        "print(sorted(m for m in sys.modules if m.startswith(('diloco.tasks', 'diloco.learner', 'torch'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "[]", done.stdout
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files("syncer", "coordinator")
        if path != PIN  # --pin-model: the operator asked the coordinator to build the model
        for name in imported_modules(path)
        if name.startswith(("diloco.tasks", "diloco.task", "diloco.learner"))
    ]
    assert not found, found
    assert not any(line.startswith(("import ", "from diloco.task")) for line in PIN.read_text().splitlines()
                   if "torch" in line or "diloco.task" in line), "pin.py imports the model code at its top"


def test_the_kernel_imports_no_room_above_it():
    kernel = list(files("kernel"))
    assert {"wire.py", "syncer.py", "coordinator.py", "fragments.py"} <= {p.name for p in kernel}
    found = offenders(kernel, {"kernel", "v1"})
    assert not found, found


def test_services_import_only_the_kernel_never_each_other():
    """A learner reaches a shard or the coordinator through the kernel's clients and wire
    types (diloco.clients, diloco.wire), never through the other service's code; and no
    service imports the command line or the lab."""
    assert any(p.name == "streamer.py" for p in files("learner"))
    found = [line for service in SERVICES for line in offenders(files(service), {"kernel", "v1", service})]
    assert not found, found


def test_the_product_imports_nothing_of_the_lab():
    product = list(files(PRODUCT))
    assert any(p.name == "run.py" for p in product)
    found = offenders(product, {"kernel", "v1", *SERVICES, PRODUCT, "api"})
    assert not found, found


def test_the_lab_imports_everything_but_the_command():
    lab = list(files(LAB))
    assert any(p.name == "compare.py" for p in lab)
    found = offenders(lab, {"kernel", "v1", *SERVICES, PRODUCT, LAB, "api"})
    assert not found, found


def test_one_top_level_package():
    """The wheel installs ``diloco`` and nothing beside it: no other package of ours at the
    repository's top (a folder there with an __init__.py would be a second name on a
    user's path)."""
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")
    assert packages == ["diloco"], packages


def _module_graph() -> dict[str, set[str]]:
    """Every module of ours (the C kernel too) and the modules of ours it imports, at its
    top or inside a function: ``from package import name`` counts as an import of the
    submodule when ``name`` is one, else of the package."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        modules[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    for path in PACKAGE.rglob("*.c"):
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
            # ``import diloco.x`` also runs diloco/__init__.py: not an edge of its own.
            graph[module] |= {m for m in map(ours, names) if m is not None and m not in (module, "diloco")}
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
    assert {"diloco.command", "diloco.learner.api", "diloco.codec._int4"} <= set(graph)
    assert "diloco.cli.local.supervisor" in graph["diloco.cli.local.run"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not _cycles(graph)


def test_nothing_imports_the_command():
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "__main__.py"
        for name in imported_modules(path)
        if name in ("diloco.command", "diloco.__main__")
    ]
    assert not found, found
