"""`diloco local --link-mbit`: every learner on an emulated site of its own, as a user
runs it (real processes, real namespaces and shaped links)."""

import json
import re
import shlex
import subprocess
import sys

import pytest

from tests.cluster.test_local import TINY
from tests.netsites import bridges, namespaces, require_sites, transfer_mbit
from tests.polling import poll
from tests.required import require_binary

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(300)
def test_local_on_20_mbit_sites_trains_and_its_links_really_limit(tmp_path):
    require_sites()
    before = namespaces(), bridges()
    out, log = tmp_path / "run", tmp_path / "local.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "diloco", "local", "--learners", "2", "--shards", "2", "--steps", "150",
             "--batch-size", "8", "--link-mbit", "20", "--out", str(out), *TINY], stderr=stderr, stdout=subprocess.DEVNULL)
    try:
        hub = poll(lambda: re.search(r"hub (dl\w+)br at (198\.1[89]\.\d+\.1)", log.read_text()), "the hub", 60,
                   [("diloco local", proc)])
        prefix, address = hub.group(1) + "-", hub.group(2)
        site = poll(lambda: sorted(n for n in namespaces() if n.startswith(prefix)), "a learner's site", 60,
                    [("diloco local", proc)])[0]
        # A bulk upload from inside a learner's site, while it trains, runs at the link's
        # rate; the same upload from this namespace is not limited by the machine.
        assert transfer_mbit(address, 2_500_000, sender_netns=site) <= 21
        assert transfer_mbit(address, 2_500_000) > 100
        assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss_final"] < summary["eval_loss_start"] - 0.5
    links = summary["links"]
    assert sorted(s["learner"] for s in links["sites"]) == ["L0", "L1"]
    assert all(s["mbit"] == 20 and s["address"].startswith(address.rsplit(".", 1)[0] + ".") for s in links["sites"])
    # The kernel saw every byte the learners counted, plus the headers and the control traffic.
    assert links["kernel_up"] >= links["payload_up"] > 0 and links["kernel_down"] >= links["payload_down"] > 0
    assert links["not_counted"] == []
    assert "links: 2 sites at 20 Mbit/s" in log.read_text()
    assert (namespaces(), bridges()) == before  # every namespace, veth and bridge is gone


@pytest.mark.timeout(300)
def test_sites_without_cap_net_admin_are_refused_in_one_line_and_leave_the_out_directory_as_it_was(tmp_path):
    """Root without CAP_NET_ADMIN (a container's root, capsh --drop) may make network
    namespaces but no link in them: the check says so before anything is written, so the
    same --out works once the run is given the capability."""
    require_sites()
    capsh = require_binary("capsh", "apt-get install -y libcap2-bin")
    new, given = tmp_path / "new", tmp_path / "given"
    given.mkdir()
    for out in (new, given):
        command = [sys.executable, "-m", "diloco", "local", "--learners", "1", "--shards", "1", "--steps", "2",
                   "--link-mbit", "5", "--out", str(out), *TINY]
        proc = subprocess.run([capsh, "--drop=cap_net_admin", "--", "-c", shlex.join(command)], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.startswith("diloco: error: emulated sites are not available here (they need CAP_NET_ADMIN")
        assert proc.stderr.count("\n") == 1 and "Operation not permitted" in proc.stderr, proc.stderr[-3000:]
    assert not new.exists() and list(given.iterdir()) == []


@pytest.mark.timeout(300)
def test_a_sigkilled_runs_sites_are_removed_by_admin_cleanup_and_nothing_else(tmp_path):
    """SIGKILL reaches no handler: the coordinator (which watches its parent) removes its
    learners' sites as it stops, and the hub (bridge and record) stays until the next start
    or `diloco admin cleanup` removes it; a live run's hub is not touched."""
    from diloco.coordinator import sites

    require_sites()
    before = namespaces(), bridges()
    live = sites.create_hub()  # another run's, alive (this process)
    try:
        log = tmp_path / "local.log"
        with open(log, "w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "diloco", "local", "--learners", "2", "--steps", "2000", "--batch-size", "8",
                 "--link-mbit", "50", "--out", str(tmp_path / "run"), *TINY], stderr=stderr, stdout=subprocess.DEVNULL)
        try:
            prefix = poll(lambda: re.search(r"hub (dl\w+)br at", log.read_text()), "the hub", 60,
                          [("diloco local", proc)]).group(1)
            poll(lambda: len([n for n in namespaces() if n.startswith(prefix + "-")]) == 2, "two sites", 60,
                 [("diloco local", proc)])
        finally:
            proc.kill()
            proc.wait()
        poll(lambda: not any(n.startswith(prefix + "-") for n in namespaces()), "the coordinator removing the sites", 60)
        assert prefix + "br" in bridges()
        cleanup = subprocess.run([sys.executable, "-m", "diloco", "admin", "cleanup", "--json"],
                                 capture_output=True, text=True, timeout=60)
        assert cleanup.returncode == 0, cleanup.stderr
        assert json.loads(cleanup.stdout) == [prefix + "br"]
        assert live.bridge in bridges()
    finally:
        sites.remove_hub(live)
    assert (namespaces(), bridges()) == before


@pytest.mark.timeout(300)
def test_replacements_and_scavenged_learners_land_on_sites_of_their_own(tmp_path):
    """A killed learner's replacement and a scavenged learner each get a new site (a new
    namespace, a new address); the killed one's site is counted and removed when it ends."""
    require_sites()
    before = namespaces(), bridges()
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "local", "--learners", "2", "--steps", "400", "--batch-size", "8",
         "--link-mbit", "50", "--link", "L1:10", "--kill-learner-every", "4", "--max-kills", "1", "--scavenge", "1@3",
         "--chaos-seed", "1", "--out", str(out), *TINY], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    # (a replacement takes its victim's pool: when the scavenged learner is the one killed,
    # two learners of the scavenged pool joined)
    assert summary["learners_killed"] == 1 and summary["learners_joined"] == 4 and summary["learners_scavenged"] >= 1
    sites_of = {s["learner"]: s for s in summary["links"]["sites"]}
    # Every learner that joined had a site of its own: the two launched, the replacement, the scavenged one.
    assert set(sites_of) == {l["id"] for l in summary["learners"]} and len(sites_of) == 4
    assert len({s["netns"] for s in sites_of.values()}) == 4 and len({s["address"] for s in sites_of.values()}) == 4
    assert sorted(s["mbit"] for s in sites_of.values()) == [10, 50, 50, 50]  # launch index 1 alone at 10
    killed = next(l["id"] for l in summary["learners"] if l["state"] == "failed")
    assert sites_of[killed]["up"] > 0 and summary["links"]["not_counted"] == [killed]  # no summary: listed, not counted
    assert (namespaces(), bridges()) == before
