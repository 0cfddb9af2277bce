"""A stand-in for ``diloco learner`` that the coordinator's LocalProcessLauncher can start
in tests: it takes the launcher's flags, Joins and Heartbeats through the real RPCs,
reports snapshot markers, and Leaves on a drain directive or SIGTERM. No torch, so it
starts in a fraction of a second.
"""

import argparse
import asyncio
import faulthandler
import json
import os
import signal
import sys
from pathlib import Path

# Python put tests/ first on the path, where tests/grpc would shadow the grpc package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from diloco.coordinator import forks  # noqa: E402
from diloco.clients.coordinator import LearnerSession  # noqa: E402
from diloco.errors import DilocoError  # noqa: E402


def forked() -> bool:
    """With ``--fork-server`` (a launcher's fork server), serve launches: True in each
    forked child, its launch's arguments added to ``sys.argv``; False in the server once
    its stdin closes."""
    if forks.FLAG not in sys.argv:
        return True
    if "--refuse-fork-server" in sys.argv:  # a command that cannot serve forks
        sys.exit("fork server refused")
    given = forks.serve(forks.claim_stdout())
    if given is None:
        return False
    sys.argv = [a for a in sys.argv if a != forks.FLAG] + given
    return True


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--join-token-file", required=True)
    parser.add_argument("--pool", default="")
    parser.add_argument("--launch-id", default="")
    parser.add_argument("--heartbeat-s", type=float, default=0.1)
    parser.add_argument("--ignore-sigterm", default="")
    args, unknown = parser.parse_known_args()
    print(json.dumps({"argv": sys.argv[1:], "unknown": unknown}), flush=True)

    stop = asyncio.Event()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # as diloco's processes do
    else:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    session = LearnerSession(args.coordinator, timeout_s=5)
    token = Path(args.join_token_file).read_text().strip()
    reply = await session.join(token, pool=args.pool, address=f"localhost:{os.getpid()}", launch_id=args.launch_id)
    print(f"joined as {reply.learner_id}", flush=True)
    reason = "terminated"
    while not stop.is_set():
        try:
            beat = await session.heartbeat(tokens=1, inner_steps=1)
        except DilocoError:
            if not args.ignore_sigterm:
                raise
            await asyncio.Event().wait()  # a hung learner: only SIGKILL ends it
        for directive in beat.directives:
            if directive.HasField("drain"):
                reason = "drained"
                stop.set()
            elif directive.HasField("snapshot"):
                await session.report_snapshot(directive.snapshot.snapshot_id)
        try:
            await asyncio.wait_for(stop.wait(), args.heartbeat_s)
        except asyncio.TimeoutError:
            pass
    await session.leave(reason)
    print(f"left: {reason}", flush=True)
    await session.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()) if forked() else 0)
