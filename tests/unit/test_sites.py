"""The emulated sites' settings and accounting, without root: what a link override, a
hub spec and a sites file must look like, and how the kernel's counts are compared."""

import json

import pytest

from diloco.coordinator.config import LocalLauncherConfig
from diloco.coordinator.launcher import LINK_OVERRIDE, override_args
from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.coordinator.sites import HubSpec, check_mbit
from diloco.cli.chaos import parse_link
from diloco.cli.local.config import LocalConfig
from diloco.cli.metrics import link_bytes


def test_a_link_override_is_the_launchers_checked_and_never_a_learner_flag():
    assert override_args({LINK_OVERRIDE: "5", "steps": "10"}) == ["--steps", "10"]
    for bad, why in (("abc", "not a number"), ("0", "between"), ("1e9", "between"), ("nan", "between")):
        with pytest.raises(InvalidArgument, match=why):
            override_args({LINK_OVERRIDE: bad})
    with pytest.raises(InvalidArgument, match="set by the launcher"):
        override_args({"netns": "elsewhere"})  # a launch cannot pick its namespace


def test_link_flags_are_checked_before_anything_starts():
    assert parse_link("L1:5") == (1, 5.0) and parse_link("0:0.5") == (0, 0.5)
    for bad in ("L1", "x:5", "1:fast", "-1:5"):
        with pytest.raises(InvalidArgument, match="--link"):
            parse_link(bad)
    assert not LocalConfig().sites and LocalConfig(link_mbit=20).sites and LocalConfig(links=((0, 5.0),)).sites
    with pytest.raises(InvalidArgument, match="only 3 learners"):
        LocalConfig(links=((3, 5.0),))
    with pytest.raises(InvalidArgument, match="--link-mbit must be between"):
        LocalConfig(link_mbit=0)
    with pytest.raises(InvalidArgument, match="--link must be between"):
        LocalConfig(links=((0, -1.0),))
    assert check_mbit(1000) == 1000


def test_a_hub_spec_round_trips_and_only_the_benchmarking_range_is_taken():
    hub = HubSpec("ab12", "198.19.7.0/24")
    assert HubSpec.parse(str(hub)) == hub and hub.address == "198.19.7.1" and hub.bridge == "dlab12br"
    assert LocalLauncherConfig(site_hub=str(hub)).site_hub == "ab12/198.19.7.0/24"
    for bad in ("ab12/10.0.0.0/24", "ab12/198.20.0.0/24", "AB12/198.18.0.0/24", "ab12/198.18.0.0/16", "ab12"):
        with pytest.raises(InvalidArgument, match="site hub"):
            LocalLauncherConfig(site_hub=bad)


def test_the_kernels_counts_are_compared_with_each_learners_own(tmp_path):
    sites_file = tmp_path / "sites.jsonl"
    assert link_bytes(sites_file, {}, {}) is None  # no site: no links section
    sites_file.write_text("".join(json.dumps(r) + "\n" for r in (
        {"launch_id": "a", "netns": "dlab12-2", "address": "198.18.0.2", "mbit": 20.0, "up": 1100, "down": 550},
        {"launch_id": "b", "netns": "dlab12-3", "address": "198.18.0.3", "mbit": 5.0, "up": 2200, "down": 1100},
        {"launch_id": "c", "netns": "dlab12-4", "address": "198.18.0.4", "mbit": 5.0, "up": 99, "down": 99},
    )))
    summaries = {"L0": {"bytes_up": 900, "bytes_initialize": 100, "bytes_down": 500},
                 "L1": {"bytes_up": 2000, "bytes_down": 1000}}
    links = link_bytes(sites_file, summaries, {"a": "L0", "b": "L1", "c": "L2"})  # L2 was killed: no summary
    assert [s["learner"] for s in links["sites"]] == ["L0", "L1", "L2"]
    assert links["sites"][0]["payload_up"] == 1000 and "payload_up" not in links["sites"][2]
    assert (links["kernel_up"], links["payload_up"], links["kernel_down"], links["payload_down"]) == (3300, 3000, 1650, 1500)
    assert links["overhead_up"] == 0.1 and links["overhead_down"] == 0.1 and links["not_counted"] == ["L2"]


def test_a_launcher_without_sites_refuses_a_link_and_adds_no_flag(tmp_path):
    from diloco.coordinator.launcher import LocalProcessLauncher

    launcher = LocalProcessLauncher(LocalLauncherConfig(), "127.0.0.1:1", lambda _: "token", tmp_path, lambda *_: None)
    with pytest.raises(InvalidArgument, match="no emulated sites"):
        launcher._site("a", {LINK_OVERRIDE: "5"})
    assert launcher._site("a", {"steps": "3"}) == []


def test_without_root_sites_are_refused_in_one_line_before_anything_starts(monkeypatch, tmp_path):
    import os

    from diloco.coordinator import sites
    from diloco.errors import FailedPrecondition
    from diloco.cli.local.run import run_local

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(FailedPrecondition, match=r"^emulated sites \(--link-mbit\) need root: .*CAP_NET_ADMIN$"):
        sites.check()
    out = tmp_path / "run"
    with pytest.raises(FailedPrecondition, match="need root"):
        run_local(LocalConfig(link_mbit=20, out=out))
    assert not out.exists()


def test_what_the_kernel_counted_beyond_the_payload_is_told_apart_by_cause(tmp_path):
    from diloco.coordinator.sites import proc_net_counters

    sites_file = tmp_path / "sites.jsonl"
    # Up: 1,000 frames holding 42 bytes that are not IP, 1,000 segments, 60,000 bytes of payload the
    # learner counted and 2,000 more in its TCP stream.
    record = {"launch_id": "a", "netns": "n", "address": "198.18.0.2", "mbit": 5.0,
              "up": 14_000 + 52_000 + 62_000 + 42, "frames_up": 1000, "ip_up": 52_000 + 62_000, "segments_up": 1000,
              "resent_up": 3, "down": 1400 + 5200, "frames_down": 100, "ip_down": 5200, "segments_down": 100}
    sites_file.write_text(json.dumps(record) + "\n")
    links = link_bytes(sites_file, {"L0": {"bytes_up": 60_000, "bytes_down": 0}}, {"a": "L0"})
    up = links["breakdown_up"]
    assert (up["ethernet"], up["not_ip"], up["segment_headers"], up["above_payload"]) == (14_000, 42, 52_000, 2000)
    assert up["above_payload_share"] == round(2000 / 60_000, 4) and up["resent_segments"] == 3
    assert up["ethernet"] + up["not_ip"] + up["segment_headers"] + up["above_payload"] + up["payload"] == up["kernel"]
    assert links["breakdown_down"]["payload"] == 0 and links["breakdown_down"]["ethernet_share"] is None
    # A record from before these counters: the totals, no breakdown.
    sites_file.write_text(json.dumps({k: record[k] for k in ("launch_id", "netns", "address", "mbit", "up", "down")}) + "\n")
    assert link_bytes(sites_file, {"L0": {"bytes_up": 1, "bytes_down": 1}}, {"a": "L0"})["breakdown_up"] is None
    # /proc/net/snmp's and /proc/net/netstat's pairs of lines; anything else is refused.
    text = "Tcp: InSegs OutSegs RetransSegs\nTcp: 5 7 1\nIpExt: InOctets OutOctets\nIpExt: 300 400\n"
    assert proc_net_counters(text) == {"Tcp": {"InSegs": 5, "OutSegs": 7, "RetransSegs": 1},
                                       "IpExt": {"InOctets": 300, "OutOctets": 400}}
    with pytest.raises(FailedPrecondition, match="unreadable network counters"):
        proc_net_counters("Tcp: InSegs\nIp: 5\n")
