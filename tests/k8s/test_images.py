"""The container build files (Docker cannot build here): hadolint finds nothing at its
strictest threshold, and the essentials the chart relies on hold: multi-stage builds on
a pinned base, a non-root user that is the chart's runAsUser, `diloco` as the entry
point (the chart passes only args), every package of the project copied in, and
torch pinned (with torch_xla at the same version in the TPU image)."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.k8s.chart import ROOT, container

IMAGES = ROOT / "k8s" / "images"
DOCKERFILES = ("Dockerfile", "Dockerfile.tpu")
HADOLINT = Path(sys.executable).parent / "hadolint"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def hadolint(path: Path) -> list[dict]:
    done = subprocess.run([str(HADOLINT), "--no-color", "--failure-threshold", "style", "--format", "json", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=path.parent)
    assert done.returncode in (0, 1), done.stderr
    return json.loads(done.stdout or "[]")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for instruction in instructions(path):
        if instruction[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(instruction)
    return result


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name):
    assert hadolint(IMAGES / name) == []


def test_hadolint_would_find_something(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\n")
    assert {finding["code"] for finding in hadolint(bad)} >= {"DL3007", "DL3013"}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_multi_stage_on_a_pinned_base(name):
    build, runtime = stages(IMAGES / name)
    build_image, _, alias = build[0][1].partition(" AS ")
    assert alias == "build"
    runtime_image = runtime[0][1]
    pinned = re.compile(r"^python:(3\.\d+\.\d+)-(slim-)?([a-z]+)$")
    b, r = pinned.match(build_image), pinned.match(runtime_image)
    assert b and r, (build_image, runtime_image)
    # The venv moves from one stage to the other: same Python, same Debian release.
    assert (b.group(1), b.group(3)) == (r.group(1), r.group(3)) and r.group(2) == "slim-"
    requires = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    assert tuple(map(int, b.group(1).split(".")[:2])) >= tuple(map(int, requires.split(".")))
    assert ("COPY", "--from=build /opt/venv /opt/venv") in runtime


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runs_as_the_charts_non_root_user_with_diloco_as_entry_point(presets, name):
    _, runtime = stages(IMAGES / name)
    users = [args for word, args in runtime if word == "USER"]
    assert users == ["10001:10001"]
    for rendered in presets.values():
        for pod in rendered.workload_pods().values():
            context = pod["spec"]["securityContext"]
            assert f"{context['runAsUser']}:{context['runAsGroup']}" == users[0]
    assert [args for word, args in runtime if word == "ENTRYPOINT"] == ['["diloco"]']
    # The chart gives args only (no command) to every diloco container.
    for rendered in presets.values():
        sts = rendered.one("StatefulSet")
        assert "command" not in container({"spec": sts["spec"]["template"]["spec"]}, "syncer")
        assert container({"spec": sts["spec"]["template"]["spec"]}, "syncer")["args"][2] == "syncer"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copies_every_package_of_the_project(name):
    build, _ = stages(IMAGES / name)
    copied = set()
    for word, args in build:
        if word == "COPY" and not args.startswith("--from"):
            copied.update(p.rstrip("/") for p in args.split()[:-1])
    top_level = {p.split(".")[0] for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert top_level | {"pyproject.toml", "README.md"} <= copied
    ignore = (IMAGES / f"{name}.dockerignore").read_text().splitlines()
    assert "*" in ignore and {f"!{p}/" for p in top_level} <= set(ignore), "the build context must carry them"


def test_cpu_image_installs_the_pinned_torch_and_the_launcher():
    text = " ".join(args for word, args in instructions(IMAGES / "Dockerfile") if word == "RUN")
    assert re.search(r"^torch==\d", (ROOT / "constraints.txt").read_text(), re.M)
    assert '--index-url "${TORCH_INDEX_URL}" -c constraints.txt --no-deps torch' in text
    extras = re.search(r'-c constraints.txt "\.\[([a-z0-9,-]+)\]"', text).group(1).split(",")
    optional = PYPROJECT["project"]["optional-dependencies"]
    assert set(extras) <= set(optional)
    # The coordinator's Kubernetes launcher and the Prometheus endpoint the chart can turn on.
    assert any(d.startswith("kubernetes") for d in optional["k8s"]) and "k8s" in extras
    assert any(d.startswith("opentelemetry-exporter-prometheus") for d in optional["metrics"]) and "metrics" in extras


def test_tpu_image_pins_torch_and_torch_xla_together():
    found = instructions(IMAGES / "Dockerfile.tpu")
    [version] = [args.partition("=")[2] for word, args in found if word == "ARG" and args.startswith("TORCH_VERSION=")]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    run = " ".join(args for word, args in found if word == "RUN")
    assert '"torch==${TORCH_VERSION}"' in run and '"torch-xla[tpu]==${TORCH_VERSION}"' in run
    assert not re.search(r"torch(-xla)?(\[tpu\])?==\d", run), "one version, in the ARG"
    # The TPU image runs what the XLA tests ran (constraints-xla.txt, on PJRT's CPU client).
    tested = (ROOT / "constraints-xla.txt").read_text()
    assert re.search(rf"^torch=={re.escape(version)}$", tested, re.M) and re.search(rf"^torch-xla=={re.escape(version)}$", tested, re.M)
