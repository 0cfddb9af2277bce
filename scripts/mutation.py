"""Mutation testing of the pure cores (issue: tests that can fail), with mutmut.

    python scripts/mutation.py run      # mutmut run (hours on 2 cores the first time; resumable)
    python scripts/mutation.py report   # docs/results/mutation.json from mutmut's results
    python scripts/mutation.py check TEST_FILE MUTANT...   # does this test file kill these?

Configuration: [tool.mutmut] in pyproject.toml (what is mutated, which tests judge it).
Survivors judged equivalent (no test can tell them apart from the original) are listed
with the reason in docs/results/mutation-equivalent.txt as ``<mutant>: <why>``; they
count in "equivalent" and not against the score. A timeout (the mutant hangs) counts
as killed; a mutant that no test reaches counts as survived.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "results"
PACKAGES = ("diloco/codec", "diloco/clock.py", "diloco/fragments.py", "diloco/syncer/core", "diloco/coordinator/core", "diloco/learner/core")
KILLED = {"killed", "timeout"}
CHECK_TIMEOUT_S = 120


def package_of(mutant: str) -> str:
    module = mutant.split(".x_")[0].split(".xǁ")[0]
    path = module.replace(".", "/")
    for package in PACKAGES:
        if path == package.removesuffix(".py") or path.startswith(package + "/"):
            return package
    raise ValueError(f"mutant {mutant} is outside the packages {PACKAGES}")


def results() -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            found[name] = status
    return found


def equivalents() -> dict[str, str]:
    path = OUT / "mutation-equivalent.txt"
    if not path.exists():
        return {}
    pairs = (line.split(": ", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {name.strip(): why.strip() for name, why in pairs}


def report() -> dict:
    statuses, equivalent = results(), equivalents()
    unknown = set(equivalent) - set(statuses)
    if unknown:
        raise SystemExit(f"mutation-equivalent.txt names mutants mutmut does not have: {sorted(unknown)[:5]}")
    by_package: dict[str, Counter] = defaultdict(Counter)
    survivors: dict[str, list[str]] = defaultdict(list)
    for name, status in sorted(statuses.items()):
        package = package_of(name)
        counts = by_package[package]
        counts["total"] += 1
        if status in KILLED:
            counts["killed"] += 1
            counts["timeout"] += status == "timeout"
        elif name in equivalent:
            counts["equivalent"] += 1
        elif status in ("survived", "no tests"):
            survivors[package].append(name)
        else:
            raise SystemExit(f"{name} is {status!r}: run `python scripts/mutation.py run` to the end first")
    doc = {}
    for package in PACKAGES:
        c = by_package[package]
        judged = c["total"] - c["equivalent"]
        doc[package] = {"killed": c["killed"], "total": c["total"], "equivalent": c["equivalent"],
                        "timeout": c["timeout"], "survived": len(survivors[package]),
                        "score": round(c["killed"] / judged, 4) if judged else None,
                        "survivors": survivors[package]}
    return doc


def check(test_file: str, mutants: list[str]) -> int:
    """Run one test file against each mutant in mutmut's tree (``mutants/``, made by a
    run), without the rest of the suite: KILLED when the file fails, SURVIVED when it passes.
    The file must pass on the original code first."""
    test = Path(test_file).resolve().relative_to(ROOT)
    tree = ROOT / "mutants"
    if not tree.is_dir():
        raise SystemExit("no mutants/ tree: run `python scripts/mutation.py run` once first")
    shutil.copytree(ROOT / "tests", tree / "tests", dirs_exist_ok=True)  # as mutmut run copies them

    def passes(mutant: str) -> bool:
        env = {**os.environ, "MUTANT_UNDER_TEST": mutant}
        args = [sys.executable, "-m", "pytest", str(test), "-x", "-q", "-n", "0", "-p", "no:cacheprovider"]
        try:
            return subprocess.run(args, cwd=tree, env=env, capture_output=True, timeout=CHECK_TIMEOUT_S).returncode == 0
        except subprocess.TimeoutExpired:  # the mutant hangs the tests: caught, as a run's timeout is
            return False

    if not passes("none.none"):
        raise SystemExit(f"{test} fails on the original code")
    survived = 0
    for mutant in mutants:
        ok = passes(mutant)
        survived += ok
        print(f"{'SURVIVED' if ok else 'KILLED  '} {mutant}", flush=True)
    return 1 if survived else 0


def main() -> int:
    command = sys.argv[1] if len(sys.argv) > 1 else "report"
    if command == "run":
        return subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", "2"], cwd=ROOT).returncode
    if command == "check" and len(sys.argv) > 3:
        return check(sys.argv[2], sys.argv[3:])
    if command != "report":
        raise SystemExit(__doc__)
    doc = report()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "mutation.json").write_text(json.dumps(doc, indent=1) + "\n")
    for package, c in doc.items():
        print(f"{package:22} killed {c['killed']:4} of {c['total'] - c['equivalent']:4} "
              f"({c['equivalent']} equivalent, {c['timeout']} by timeout): {100 * (c['score'] or 0):.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
