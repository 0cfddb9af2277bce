"""Emulated sites: each learner (or baseline worker) in a network namespace of its own,
joined to the run's hub by a veth pair whose two directions are shaped by the kernel
(``tc`` token bucket filters), so that a run's traffic crosses links of a given rate.

The hub is a bridge in this (the root) namespace with the first address of a /24 taken
from the benchmarking range 198.18.0.0/15; the coordinator, the shards, the DP store and
the torchft lighthouse listen on that address, and each site holds one more address of
the same /24 and no other route: a site reaches the hub and the other sites of its run,
and nothing else (no default route, no forwarding, nothing leaves the machine).

::

    site netns dl<tag>-<n>          root namespace
      uplink 198.18.X.n  <-- veth -->  dl<tag>h<n> -- bridge dl<tag>br 198.18.X.1
      (tbf: the site's uplink)         (tbf: the site's downlink)

The kernel adds no delay or loss here (``netem`` is not available everywhere): latency
stays the learners' own ``--delay-ms``. Needs root (``CAP_NET_ADMIN``): ``check`` says
in one line why sites cannot be made.

Every hub is recorded in ``STATE_DIR/<tag>.json`` (its owner's pid and start time)
before anything is made, so that the leftovers of a run that died without cleaning up
(SIGKILL) can be told from a live run's: ``remove_dead`` removes the hubs whose owner
is gone, with their sites, and nothing else.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import json
import logging
import os
import secrets
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from diloco.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

logger = logging.getLogger(__name__)

RANGE = ipaddress.ip_network("198.18.0.0/15")
"""RFC 2544's benchmarking range: every emulated address comes from here."""
STATE_DIR = Path("/run/diloco-sites")
SITE_IFACE = "uplink"
"""The site's end of its veth, the same name in every site (``GLOO_SOCKET_IFNAME``)."""
MAX_MBIT = 100_000.0
MIN_MBIT = 0.01
_CLONE_NEWNET = 0x40000000


ETHERNET_HEADER_BYTES = 14
SEGMENT_HEADER_BYTES = 20 + 32
"""Per TCP segment on a site's link: an IPv4 header without options and a TCP header with
the timestamps option (Linux's default; a SYN's and a SACK's options are longer, and are
counted as the segment's payload)."""


def proc_net_counters(text: str) -> dict[str, dict[str, int]]:
    """``/proc/net/snmp`` and ``/proc/net/netstat`` (each group a line of names, then a line
    of values) as {group: {name: value}}."""
    lines = [line.split() for line in text.splitlines() if line.strip()]
    counters: dict[str, dict[str, int]] = {}
    for names, values in zip(lines[::2], lines[1::2]):
        if names[0] != values[0] or not names[0].endswith(":"):
            raise FailedPrecondition(f"unreadable network counters: {' '.join(names[:3])} / {' '.join(values[:3])}")
        counters[names[0].rstrip(":")] = {n: int(v) for n, v in zip(names[1:], values[1:])}
    return counters


def check_mbit(value: float, what: str = "--link-mbit") -> float:
    if not (MIN_MBIT <= value <= MAX_MBIT):
        raise InvalidArgument(f"{what} must be between {MIN_MBIT:g} and {MAX_MBIT:g} Mbit/s, got {value:g}")
    return value


def _run(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise FailedPrecondition(f"{' '.join(argv)}: {result.stderr.strip() or f'exit code {result.returncode}'}")
    return result.stdout


def check() -> None:
    """Raise FailedPrecondition with one line when sites cannot be made here (not root,
    no ``ip`` or ``tc``, namespaces or links refused: root without CAP_NET_ADMIN)."""
    if os.geteuid() != 0:
        raise FailedPrecondition("emulated sites (--link-mbit) need root: network namespaces, veth pairs and tc "
                                 "shaping need CAP_NET_ADMIN")
    probe = f"dlprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "-n", probe, "link", "set", "lo", "up")  # links need CAP_NET_ADMIN (root without it: refused)
        _run("tc", "-n", probe, "qdisc", "show")
    except FileNotFoundError as error:
        raise FailedPrecondition(f"emulated sites need iproute2 ('ip' and 'tc'): {error.filename} not found") from None
    except FailedPrecondition as error:
        raise FailedPrecondition(f"emulated sites are not available here (they need CAP_NET_ADMIN, network namespaces "
                                 f"and tc): {error}") from None
    finally:
        with contextlib.suppress(FileNotFoundError, FailedPrecondition):
            _run("ip", "netns", "del", probe)


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a pid from its reuse)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@contextlib.contextmanager
def _locked():
    STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(STATE_DIR / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _shaping(mbit: float) -> list[str]:
    """A token bucket at ``mbit``: a burst of 10 ms of traffic (at least 16 KB: a few
    packets) and a queue of 100 ms (at least 64 KB), enough for TCP to fill the link
    without a standing delay of seconds."""
    rate = mbit * 1e6 / 8  # bytes per second
    burst, limit = max(int(rate * 0.010), 16 * 1024), max(int(rate * 0.100), 64 * 1024)
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "limit", str(limit)]


@dataclass(frozen=True)
class Site:
    number: int
    netns: str
    address: str
    host_iface: str
    """The veth's end at the hub: its received bytes are the site's uplink, its sent bytes
    its downlink."""
    mbit: float


@dataclass(frozen=True)
class HubSpec:
    """What a process needs to add sites to a hub another process made (the coordinator's
    launcher: the supervisor made the hub)."""

    tag: str
    network: str

    def __str__(self) -> str:
        return f"{self.tag}/{self.network}"

    @classmethod
    def parse(cls, text: str) -> HubSpec:
        tag, _, network = text.partition("/")
        return cls(tag, network)

    @property
    def bridge(self) -> str:
        return f"dl{self.tag}br"

    @property
    def address(self) -> str:
        return str(next(ipaddress.ip_network(self.network).hosts()))

    @property
    def prefix(self) -> str:
        """Every namespace of this hub starts with it."""
        return f"dl{self.tag}-"

    def host_iface(self, number: int) -> str:
        """The hub-side end of site ``number``'s veth."""
        return f"dl{self.tag}h{number}"


@dataclass
class Sites:
    """Sites on one hub, made and removed by this process (one process adds sites to a
    hub; addresses are its to hand out)."""

    hub: HubSpec
    sites: dict[int, Site] = field(default_factory=dict)
    last: int = 1
    """The number given last: the next site takes the next free one after it, so that a
    freed address (and namespace name) goes back into use as late as possible: what the
    hub's neighbours and the peers' connections still hold of its last holder has aged."""

    def add(self, mbit: float) -> Site:
        check_mbit(mbit)
        hosts = list(ipaddress.ip_network(self.hub.network).hosts())[1:]
        numbers = range(2, len(hosts) + 2)
        after = [n for n in numbers if n > self.last] + [n for n in numbers if n <= self.last]
        number = next((n for n in after if n not in self.sites), None)
        if number is None:
            raise ResourceExhausted(f"the hub {self.hub.bridge} has no address left for another site ({len(hosts)} in use)")
        site = Site(number, f"{self.hub.prefix}{number}", str(hosts[number - 2]), self.hub.host_iface(number), mbit)
        inner = f"dl{self.hub.tag}s{number}"
        prefix_len = ipaddress.ip_network(self.hub.network).prefixlen
        _run("ip", "netns", "add", site.netns)
        self.sites[number], self.last = site, number
        try:
            _run("ip", "link", "add", site.host_iface, "type", "veth", "peer", "name", inner, "netns", site.netns)
            # One TCP segment a frame, as on a wire: a veth otherwise passes segmentation-offload
            # packets of up to 64 KiB with one set of headers, and its counts hold fewer
            # header bytes than the link would carry.
            _run("ip", "link", "set", site.host_iface, "gso_max_segs", "1")
            _run("ip", "-n", site.netns, "link", "set", inner, "gso_max_segs", "1")
            _run("ip", "link", "set", site.host_iface, "master", self.hub.bridge, "up")
            _run("ip", "-n", site.netns, "link", "set", inner, "name", SITE_IFACE)
            _run("ip", "-n", site.netns, "addr", "add", f"{site.address}/{prefix_len}", "dev", SITE_IFACE)
            _run("ip", "-n", site.netns, "link", "set", SITE_IFACE, "up")
            _run("ip", "-n", site.netns, "link", "set", "lo", "up")
            _run("tc", "-n", site.netns, "qdisc", "add", "dev", SITE_IFACE, "root", *_shaping(mbit))  # uplink
            _run("tc", "qdisc", "add", "dev", site.host_iface, "root", *_shaping(mbit))  # downlink
        except BaseException:
            self.remove(site)
            raise
        logger.info("site %s: %s at %g Mbit/s each way", site.netns, site.address, mbit)
        return site

    def counters(self, site: Site) -> dict[str, int]:
        """What the kernel counted on the site's link, ``up`` from the site to the hub and
        ``down`` from the hub to the site: bytes (Ethernet frames, every header included)
        and frames, from the hub's end of the veth; and from the site's namespace (one
        learner's), the IP bytes and TCP segments each way and the TCP segments it sent
        again (``SEGMENT_HEADER_BYTES``: what they add up to)."""
        stats = Path("/sys/class/net") / site.host_iface / "statistics"
        counted = {"up": int((stats / "rx_bytes").read_text()), "down": int((stats / "tx_bytes").read_text()),
                   "frames_up": int((stats / "rx_packets").read_text()),
                   "frames_down": int((stats / "tx_packets").read_text())}
        proc = proc_net_counters(_run("ip", "netns", "exec", site.netns, "cat", "/proc/net/snmp", "/proc/net/netstat"))
        return counted | {"ip_up": proc["IpExt"]["OutOctets"], "ip_down": proc["IpExt"]["InOctets"],
                          "segments_up": proc["Tcp"]["OutSegs"], "segments_down": proc["Tcp"]["InSegs"],
                          "resent_up": proc["Tcp"]["RetransSegs"]}

    def remove(self, site: Site) -> None:
        """Delete the site's veth pair (both qdiscs go with it), then its namespace. The pair
        first: a namespace's devices go when the kernel gets to it, later, and the next site
        with this number must be able to take the name at once."""
        self.sites.pop(site.number, None)
        with contextlib.suppress(FailedPrecondition):
            _run("ip", "link", "del", site.host_iface)
        with contextlib.suppress(FailedPrecondition):
            _run("ip", "netns", "del", site.netns)

    def close(self) -> None:
        for site in list(self.sites.values()):
            self.remove(site)


def create_hub() -> HubSpec:
    """A bridge with a fresh /24 of the benchmarking range, recorded as this process's."""
    check()
    with _locked():
        taken = {json.loads(p.read_text())["network"] for p in STATE_DIR.glob("*.json")}
        in_use = [ipaddress.ip_interface(a["local"] + "/" + str(a["prefixlen"])).network
                  for link in json.loads(_run("ip", "-j", "-4", "addr"))
                  for a in link.get("addr_info", [])]
        network = next((str(n) for n in RANGE.subnets(new_prefix=24)
                        if str(n) not in taken and not any(n.overlaps(u) for u in in_use)), None)
        if network is None:
            raise ResourceExhausted(f"every /24 of {RANGE} is in use by other hubs")
        while (STATE_DIR / f"{(tag := secrets.token_hex(2))}.json").exists():
            pass
        hub = HubSpec(tag, network)
        record = {"tag": tag, "network": network, "pid": os.getpid(), "start": _start_time(os.getpid())}
        (STATE_DIR / f"{tag}.json").write_text(json.dumps(record))
    try:
        _run("ip", "link", "add", hub.bridge, "type", "bridge")
        # A bridge takes the lowest MAC of its ports unless its own was set: adding or
        # removing a site could then change the hub's MAC under every other site's ARP
        # entry, and their traffic to the hub went nowhere until it aged (a learner lost
        # its coordinator for 5 s when another site was removed). Setting it pins it.
        mac = (Path("/sys/class/net") / hub.bridge / "address").read_text().strip()
        _run("ip", "link", "set", hub.bridge, "address", mac)
        _run("ip", "addr", "add", f"{hub.address}/24", "dev", hub.bridge)
        _run("ip", "link", "set", hub.bridge, "up")
    except BaseException:
        remove_hub(hub)
        raise
    logger.info("hub %s: %s on %s", hub.bridge, hub.address, network)
    return hub


def new_hub(say: Callable[[str], None]) -> HubSpec:
    """A run's hub, after removing what killed runs left (``remove_dead``); ``say`` hears
    what was removed and where the hub is."""
    check()
    if removed := remove_dead():
        say(f"removed what killed runs left of their emulated sites: {', '.join(removed)}")
    hub = create_hub()
    say(f"emulated sites: hub {hub.bridge} at {hub.address}, each worker on a site of its own")
    return hub


def hub_namespaces(hub: HubSpec) -> list[str]:
    return sorted(n.split()[0] for n in _run("ip", "netns", "list").splitlines() if n.startswith(hub.prefix))


def remove_hub(hub: HubSpec) -> list[str]:
    """Remove the hub's sites, its bridge and its record; returns what was removed."""
    removed = []
    for netns in hub_namespaces(hub):
        with contextlib.suppress(FailedPrecondition):
            _run("ip", "netns", "del", netns)
            removed.append(netns)
    with contextlib.suppress(FailedPrecondition):
        _run("ip", "link", "del", hub.bridge)
        removed.append(hub.bridge)
    (STATE_DIR / f"{hub.tag}.json").unlink(missing_ok=True)
    return removed


def remove_dead() -> list[str]:
    """Remove every hub (and its sites) whose owner process is gone: the leftovers of runs
    that were killed. Returns what was removed. Hubs of live runs are left alone."""
    if not STATE_DIR.exists():
        return []
    removed = []
    with _locked():
        for path in sorted(STATE_DIR.glob("*.json")):
            try:
                record = json.loads(path.read_text())
                hub, pid, start = HubSpec(record["tag"], record["network"]), int(record["pid"]), record["start"]
            except (OSError, ValueError, KeyError, TypeError):
                logger.warning("ignoring %s: not a hub record", path)
                continue
            if (alive := _start_time(pid)) is not None and alive == start:
                continue
            removed += remove_hub(hub)
    return removed


def enter(netns: str) -> None:
    """Move this process into ``netns`` (at its start, before it opens a socket or starts
    a thread: a thread's namespace is the one it was started in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    except OSError as error:
        raise FailedPrecondition(f"cannot enter network namespace {netns}: {error.strerror}") from None
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise FailedPrecondition(f"cannot enter network namespace {netns}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


# --- faults (chaos on a live site; diloco.cli.chaos schedules them) ---------------------------

BLACKHOLE_PREF = 100
"""Priority of the policy rules that cut a site off one port (``block_port``)."""


def site_of(pid: int, hub: HubSpec) -> tuple[str, str] | None:
    """The site (namespace, hub-side interface) process ``pid`` runs in, if it runs in one
    of ``hub``'s sites."""
    with contextlib.suppress(FailedPrecondition):
        for name in _run("ip", "netns", "identify", str(pid)).split():
            if name.startswith(hub.prefix) and name.removeprefix(hub.prefix).isdigit():
                return name, hub.host_iface(int(name.removeprefix(hub.prefix)))
    return None


def set_link(host_iface: str, up: bool) -> None:
    """Cut (``up`` False) or restore a site's link: both directions, as a pulled cable."""
    _run("ip", "link", "set", "dev", host_iface, "up" if up else "down")


def link_mbit(host_iface: str) -> float:
    """The rate a site's downlink is shaped to now."""
    for qdisc in json.loads(_run("tc", "-j", "qdisc", "show", "dev", host_iface)):
        if qdisc.get("kind") == "tbf":
            return qdisc["options"]["rate"] * 8 / 1e6
    raise FailedPrecondition(f"{host_iface} has no token bucket: not a site's link")


def set_rate(netns: str, host_iface: str, mbit: float) -> None:
    """Shape both directions of a site's link to ``mbit`` (a starved link, and back)."""
    _run("tc", "-n", netns, "qdisc", "change", "dev", SITE_IFACE, "root", *_shaping(mbit))
    _run("tc", "qdisc", "change", "dev", host_iface, "root", *_shaping(mbit))


def block_port(netns: str, port: int, blocked: bool) -> None:
    """Drop (``blocked``) or let through what the site sends to TCP port ``port`` on the hub:
    one service (a shard, the coordinator) unreachable from that site while the rest of its
    link works. A policy rule with a blackhole route: a new connection fails at once (no
    route), an established one stalls, its packets dropped; nothing reaches the service."""
    _run("ip", "-n", netns, "rule", "add" if blocked else "del", "pref", str(BLACKHOLE_PREF), "ipproto", "tcp",
         "dport", str(port), "blackhole")
