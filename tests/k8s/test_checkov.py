"""checkov, run once over everything the chart renders (every preset and value
combination), the learner pods the coordinator's launcher makes from the chart's pod
templates, the Jobs of every rendered and launched JobSet (checkov skips JobSets, a
kind it does not know), and both Dockerfiles: no failed check beyond k8s/checkov-skips.yaml, and no
entry there that matches nothing. checkov runs offline (--skip-download, and any HTTP(S)
it tried would go to a closed local port)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.k8s.chart import ROOT, jobset_jobs, matches_any

SKIPS = yaml.safe_load((ROOT / "k8s" / "checkov-skips.yaml").read_text())["skips"]
DOCKERFILES = ("Dockerfile", "Dockerfile.tpu")


def _resource(result: dict) -> str:
    """'Kind/name' for a Kubernetes object, the file name for a Dockerfile."""
    if result["check_type"] == "dockerfile":
        return Path(result["file_path"]).name
    kind, *_, name = result["resource"].split(".")
    return f"{kind}/{name}"


@pytest.fixture(scope="session")
def checkov(renders, launched, launched_slices, tmp_path_factory):
    scan = tmp_path_factory.mktemp("checkov")
    for name, rendered in renders.items():
        jobs = [job for jobset in rendered.all("JobSet") for job in jobset_jobs(jobset)]
        (scan / f"{name.removesuffix('.yaml')}.yaml").write_text(yaml.safe_dump_all(rendered.objects + jobs))
    for name, (pods, _) in launched.items():
        (scan / f"{name.removesuffix('.yaml')}-launched.yaml").write_text(yaml.safe_dump_all(pods))
    for name, (jobsets, _) in launched_slices.items():
        jobs = [job for jobset in jobsets for job in jobset_jobs(jobset)]
        (scan / f"{name.removesuffix('.yaml')}-launched.yaml").write_text(yaml.safe_dump_all(jobs))
    (scan / "images").mkdir()
    for dockerfile in DOCKERFILES:
        shutil.copy(ROOT / "k8s" / "images" / dockerfile, scan / "images" / dockerfile)
    closed = "http://127.0.0.1:9"
    env = {**os.environ, "HTTP_PROXY": closed, "HTTPS_PROXY": closed, "NO_PROXY": "", "BC_API_KEY": ""}
    done = subprocess.run(
        [str(Path(sys.executable).parent / "checkov"), "--directory", ".", "--framework", "kubernetes", "dockerfile",
         "--output", "json", "--compact", "--skip-download"],
        cwd=scan, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]
    reports = json.loads(done.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    by_type = {r["check_type"]: r for r in reports}
    failed = [{**f, "check_type": t} for t, r in by_type.items() for f in r["results"]["failed_checks"]]
    passed = [{**p, "check_type": t} for t, r in by_type.items() for p in r["results"]["passed_checks"]]
    return by_type, failed, passed


def test_no_failed_check_beyond_the_skip_list(checkov):
    _, failed, _ = checkov
    unexpected = sorted(
        {f"{f['check_id']} {_resource(f)}: {f['check_name']}" for f in failed
         if not any(s["check"] == f["check_id"] and matches_any(s["resources"], _resource(f)) for s in SKIPS)}
    )
    assert unexpected == []


def test_every_skip_is_still_needed(checkov):
    _, failed, _ = checkov
    stale = [s["check"] for s in SKIPS
             if not any(f["check_id"] == s["check"] and matches_any(s["resources"], _resource(f)) for f in failed)]
    assert stale == []


def test_every_skip_says_why():
    for skip in SKIPS:
        assert set(skip) == {"check", "title", "resources", "reason"}, skip
        assert skip["resources"] and len(skip["reason"].split()) >= 10, skip


def test_the_scan_covered_the_chart_the_launched_pods_and_the_images(checkov, renders, launched, launched_slices):
    by_type, failed, passed = checkov
    assert set(by_type) == {"kubernetes", "dockerfile"}
    assert all(r["summary"]["parsing_errors"] == 0 for r in by_type.values())
    scanned = {_resource(r) for r in failed + passed}
    assert {"StatefulSet/diloco-syncer", "Deployment/diloco-coordinator", "Deployment/diloco-validator",
            "Role/diloco-learner-launcher", "Pod/diloco-test-health", *DOCKERFILES} <= scanned
    assert any(r.startswith("Job/diloco-learner-") for r in scanned)
    launched_pods = {f"Pod/{p['metadata']['name']}" for pods, _ in launched.values() for p in pods}
    assert launched_pods <= scanned
    static_slices = {f"Job/{j['metadata']['name']}-slice-0" for rendered in renders.values() for j in rendered.all("JobSet")}
    # One JobSet per static learner: every learner's slice is scanned, not only the first.
    assert len(static_slices) == sum(r.values["learners"]["replicas"] for r in renders.values() if r.all("JobSet"))
    launched_slice_jobs = {f"Job/{j['metadata']['name']}-slice-0" for jobsets, _ in launched_slices.values() for j in jobsets}
    assert static_slices and launched_slice_jobs and static_slices | launched_slice_jobs <= scanned
    assert by_type["kubernetes"]["summary"]["passed"] > 500


def test_digests_satisfy_the_digest_check(checkov):
    """Why CKV_K8S_43 is skipped: with image digests set (restore-pinned) it passes."""
    _, failed, passed = checkov
    pinned = [p for p in passed if p["check_id"] == "CKV_K8S_43" and "restore-pinned" in p["file_path"]]
    assert pinned
    assert not [f for f in failed if f["check_id"] == "CKV_K8S_43" and "restore-pinned" in f["file_path"]]
