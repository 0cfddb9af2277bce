"""Ports for servers that must be told their address before they start."""

import socket

from diloco import rpc


def test_free_ports_are_distinct_listenable_and_outside_the_ephemeral_range():
    low, _ = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    ports = rpc.free_ports("127.0.0.1", 8)
    assert len(set(ports)) == 8 and all(p in rpc.LISTEN_PORTS and p < low for p in ports)
    with socket.socket() as taken:  # one taken is never handed out
        taken.bind(("127.0.0.1", ports[0]))
        taken.listen()
        assert ports[0] not in rpc.free_ports("127.0.0.1", len(rpc.LISTEN_PORTS) // 64)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
