"""Emulated sites (``diloco.sites``) for real: namespaces, veth pairs and tc token
buckets made by the kernel, traffic timed across them, and nothing left behind."""

import ipaddress
import json
import os
import signal
import subprocess
import sys

import pytest

from diloco import sites
from tests.netsites import bridges, namespaces, require_sites, transfer_mbit

pytestmark = pytest.mark.cluster


@pytest.fixture
def hub():
    require_sites()
    before = namespaces()
    made = sites.create_hub()
    yield made
    sites.remove_hub(made)
    assert namespaces() == before and made.bridge not in bridges()


def test_a_site_link_is_shaped_both_ways_and_the_kernel_counts_its_bytes(hub):
    on = sites.Sites(hub)
    site = on.add(20)
    assert site.netns.startswith(hub.prefix) and site.netns in namespaces()
    nbytes = 2_500_000  # 1 s at 20 Mbit/s
    before = on.counters(site)
    up = transfer_mbit(hub.address, nbytes, sender_netns=site.netns)
    down = transfer_mbit(site.address, nbytes, receiver_netns=site.netns)
    after = on.counters(site)
    free = transfer_mbit(hub.address, nbytes)  # the same transfer, not through a site: the machine is not the limit
    assert 12 < up <= 21 and 12 < down <= 21, (up, down)
    assert free > 5 * 20, free
    # Every frame: the payload plus TCP/IP and Ethernet headers (and the acks the other way).
    assert nbytes <= after["up"] - before["up"] <= 1.1 * nbytes
    assert nbytes <= after["down"] - before["down"] <= 1.1 * nbytes
    on.close()
    assert site.netns not in namespaces()


def test_a_site_reaches_its_hub_and_nothing_else(hub):
    on = sites.Sites(hub)
    site = on.add(100)
    routes = subprocess.run(["ip", "-n", site.netns, "-4", "route"], capture_output=True, text=True, check=True).stdout
    assert routes.split()[0] == hub.network and "default" not in routes, routes
    addresses = json.loads(subprocess.run(["ip", "-n", site.netns, "-j", "-4", "addr"], capture_output=True, text=True,
                                          check=True).stdout)
    assert {a["local"] for link in addresses for a in link["addr_info"]} == {"127.0.0.1", site.address}
    assert ipaddress.ip_network(hub.network).subnet_of(sites.RANGE)
    on.close()


def test_sites_of_a_killed_run_are_removed_and_a_live_runs_are_not(hub):
    """A supervisor SIGKILLed leaves its hub and sites; the next start (``remove_dead``)
    removes them, and only them."""
    live = sites.Sites(hub)
    live_site = live.add(50)
    owner = subprocess.Popen([sys.executable, "-c", (
        "import time; from diloco import sites\n"
        "hub = sites.create_hub(); site = sites.Sites(hub).add(10)\n"
        "print(hub, site.netns, flush=True); time.sleep(600)")], stdout=subprocess.PIPE, text=True)
    line = owner.stdout.readline().split()
    dead_hub, dead_site = sites.HubSpec.parse(line[0]), line[1]
    assert dead_site in namespaces() and dead_hub.bridge in bridges()
    assert sites.remove_dead() == []  # its owner is alive
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    assert sorted(sites.remove_dead()) == sorted([dead_site, dead_hub.bridge])
    assert dead_site not in namespaces() and dead_hub.bridge not in bridges()
    assert live_site.netns in namespaces() and hub.bridge in bridges()
    live.close()
