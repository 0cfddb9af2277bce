"""What the emulated-site tests share: they need root (network namespaces, veth pairs,
tc). Where ``diloco.coordinator.sites.check`` refuses they skip with its reason, except under
``DILOCO_REQUIRE_SITES=1`` (``.ci/run``, which runs as root), where that is a failure:
no silent loss of coverage (``tests/required.py``)."""

import subprocess
import sys

from diloco.coordinator import sites
from diloco.errors import FailedPrecondition
from tests.required import SITES, skip_or_fail


def require_sites() -> None:
    """Skip (or fail) where sites cannot be made; then remove what killed runs left, as every
    run does at its start, so that a test's before-and-after compare of the machine's
    namespaces and bridges sees only what it made (a run killed on this machine earlier
    left its sites behind, and the test's own run removed them: a red CI)."""
    try:
        sites.check()
    except FailedPrecondition as error:
        skip_or_fail(str(error), SITES)
    sites.remove_dead()


def namespaces() -> set[str]:
    return {line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                       check=True).stdout.splitlines() if line.strip()}


def bridges() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


_RECEIVE = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
started, got = time.monotonic(), 0
while chunk := conn.recv(1 << 20):
    got += len(chunk)
print(got, time.monotonic() - started, flush=True)
conn.sendall(b"k")
"""
_SEND = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
left, chunk = int(sys.argv[3]), b"x" * 65536
while left > 0:
    s.sendall(chunk[:min(left, 65536)])
    left -= 65536
s.shutdown(socket.SHUT_WR)
s.recv(1)
"""


def transfer_mbit(host: str, nbytes: int, receiver_netns: str | None = None, sender_netns: str | None = None) -> float:
    """Mbit/s of one TCP transfer of ``nbytes`` to a receiver listening on ``host`` in
    ``receiver_netns``, from a sender in ``sender_netns`` (None: this namespace), timed
    by the receiver from its accept to the end of the stream."""
    def inside(netns):
        return ["ip", "netns", "exec", netns] if netns else []

    receiver = subprocess.Popen([*inside(receiver_netns), sys.executable, "-c", _RECEIVE, host],
                                stdout=subprocess.PIPE, text=True)
    try:
        port = receiver.stdout.readline().strip()
        subprocess.run([*inside(sender_netns), sys.executable, "-c", _SEND, host, port, str(nbytes)],
                       check=True, timeout=120)
        got, seconds = receiver.stdout.readline().split()
    finally:
        receiver.kill()
        receiver.wait()
    assert int(got) == nbytes
    return nbytes * 8 / float(seconds) / 1e6
