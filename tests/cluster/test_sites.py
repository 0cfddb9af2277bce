"""Emulated sites (``diloco.coordinator.sites``) for real: namespaces, veth pairs and tc token
buckets made by the kernel, traffic timed across them, and nothing left behind."""

import ipaddress
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.coordinator import sites
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
    # Told apart: the frames' Ethernet headers, the segments' IP and TCP headers, and the stream
    # each way, which is the transfer (a SYN's, a FIN's and SACKs' longer options within 1 %).
    for way in ("up", "down"):
        kernel, frames, ip, segments = (after[k] - before[k] for k in (way, f"frames_{way}", f"ip_{way}", f"segments_{way}"))
        assert 0 <= kernel - frames * sites.ETHERNET_HEADER_BYTES - ip < 1000, way  # ARP at most
        stream = ip - segments * sites.SEGMENT_HEADER_BYTES
        assert nbytes <= stream <= 1.01 * nbytes, (way, stream)
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
        "import time; from diloco.coordinator import sites\n"
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


_CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5).close()
    print("connected")
except OSError as error:
    print(type(error).__name__)
"""


def _connect_from(netns: str, address: str, port: int) -> str:
    return subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", _CONNECT, address, str(port)],
                          capture_output=True, text=True, timeout=30).stdout.strip()


def test_faults_cut_a_sites_link_one_port_or_its_rate_and_heal(hub):
    """The primitives chaos uses (diloco/cli/chaos.py): each fault takes effect, leaves the rest
    of the link alone, and heals."""
    import socket

    on = sites.Sites(hub)
    site = on.add(20)
    servers = [socket.create_server((hub.address, 0)) for _ in range(2)]
    try:
        a, b = (s.getsockname()[1] for s in servers)
        assert _connect_from(site.netns, hub.address, a) == "connected"
        sites.block_port(site.netns, a, True)  # one port unreachable (no route: EINVAL at once), the other reached
        assert _connect_from(site.netns, hub.address, a) == "OSError"
        assert _connect_from(site.netns, hub.address, b) == "connected"
        sites.block_port(site.netns, a, False)
        assert _connect_from(site.netns, hub.address, a) == "connected"
        sites.set_link(site.host_iface, False)  # the whole link: nothing gets through
        assert _connect_from(site.netns, hub.address, b) == "TimeoutError"
        sites.set_link(site.host_iface, True)
        assert _connect_from(site.netns, hub.address, b) == "connected"
        assert sites.link_mbit(site.host_iface) == 20
        sites.set_rate(site.netns, site.host_iface, 0.2)
        assert sites.link_mbit(site.host_iface) == 0.2 and transfer_mbit(hub.address, 50_000, sender_netns=site.netns) < 0.3
        sites.set_rate(site.netns, site.host_iface, 20)
        assert sites.link_mbit(site.host_iface) == 20
        # A process is found on its site, and one outside every site is not.
        proc = subprocess.Popen(["ip", "netns", "exec", site.netns, "sleep", "30"])
        try:
            from tests.polling import poll

            assert poll(lambda: sites.site_of(proc.pid, hub), "the site of the process", 10) == (site.netns, site.host_iface)
        finally:
            proc.kill()
        assert sites.site_of(os.getpid(), hub) is None
    finally:
        for s in servers:
            s.close()
    # A freed number goes back into use last: what peers hold of its last holder has aged.
    second = on.add(20)
    on.remove(site)
    assert on.add(20).number == second.number + 1
    on.close()


def test_the_hubs_mac_stays_put_as_sites_come_and_go(hub):
    """A bridge would take the lowest MAC of its ports: the hub's is set at creation
    (``addr_assign_type`` 3), so the other sites' ARP entries for it stay right when a
    site is added or removed."""
    device = Path("/sys/class/net") / hub.bridge
    mac = (device / "address").read_text()
    assert (device / "addr_assign_type").read_text().strip() == "3"
    on = sites.Sites(hub)
    try:
        made = [on.add(10) for _ in range(4)]
        assert (device / "address").read_text() == mac
        on.remove(made[1])
        assert (device / "address").read_text() == mac
    finally:
        on.close()
