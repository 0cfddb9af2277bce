"""The product's command line: the top-level flags, the product's commands and how a
command runs (``run``); ``diloco.command`` adds the lab's commands to the same parser.

Parsers are built without importing torch or grpc so ``diloco --help`` stays instant;
each subcommand imports its implementation when it runs. This is the only module that
configures logging handlers; only the modules of diloco/cli read environment variables.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence

from diloco import __version__
from diloco.errors import DilocoError, InvalidArgument
from diloco.cli.coordinator import add_admin_parser, add_coordinator_parser, admin_run_dir, check_admin_target
from diloco.cli.runs import add_certs, add_local, add_run_tools, add_tape
from diloco.cli.services import add_learner, add_syncer, add_validator
from diloco.cli.settings import apply_config, read_config

logger = logging.getLogger(__name__)


COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_local, add_certs, add_run_tools, add_syncer, add_learner, add_validator, add_tape, add_coordinator_parser, add_admin_parser,
)
"""The product's commands, in the order ``diloco --help`` lists them."""


def build_parser(commands: Sequence[Callable[[argparse._SubParsersAction], None]] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco",
        description="Decoupled DiLoCo over gRPC: learners, syncer shards and a coordinator.",
    )
    parser.add_argument("--version", action="version", version=f"diloco {__version__}")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level for messages on stderr (default WARNING)",
    )
    parser.add_argument(
        "--exit-with-parent", action="store_true",
        help="stop (as on SIGTERM) when the parent process is gone (diloco local starts every process of its run so)",
    )
    transport = parser.add_mutually_exclusive_group()
    transport.add_argument(
        "--tls-dir", metavar="DIR",
        help="mutual TLS for every server and channel of this process: DIR holds ca.crt, tls.crt and tls.key "
             "(`diloco certs`, or a cert-manager Secret; default $DILOCO_TLS_DIR)",
    )
    transport.add_argument(
        "--insecure", dest="plaintext", action="store_true",
        help="plaintext gRPC for this process: tokens and credentials cross the network in clear "
             "(default $DILOCO_INSECURE). coordinator, syncer, learner and admin refuse to start "
             "with neither this nor --tls-dir",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in commands:
        add(subparsers)
    return parser


def _exit_with_parent() -> None:
    """SIGTERM this process (its graceful shutdown) once its parent process is gone: a
    run's processes never outlive the process that started them, however it ended
    (SIGKILL included, which no handler of the parent sees)."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)  # nothing to wait on: the kernel reparents us without telling
        logger.warning("parent process %d is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="diloco-parent-watch", daemon=True).start()


def _deepest_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command given, so its usage, not the top level's, is shown."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            if chosen is not None:
                return _deepest_parser(chosen, args)
    return parser


_NETWORKED = ("coordinator", "syncer", "learner", "admin")
"""The commands that open gRPC servers or channels: they need --tls-dir or --insecure."""


def _choose_transport(args: argparse.Namespace) -> None:
    """Mutual TLS from --tls-dir, or plaintext only when asked for (--insecure), or what
    $DILOCO_TLS_DIR / $DILOCO_INSECURE say (``rpc.choose_transport``, which
    ``Learner.join`` shares). The choice is kept as ``args.transport`` (flags), so what the
    process launches (the coordinator's local learners) talks the same way."""
    from diloco import rpc

    transport = rpc.choose_transport(args.tls_dir, args.plaintext, os.environ)
    if transport is not None:
        rpc.use_tls(transport.tls)
        args.transport = list(transport.flags)
        if transport.tls is None and args.command in _NETWORKED:
            logger.warning("--insecure: plaintext gRPC, tokens and credentials cross the network in clear")
    elif args.command in _NETWORKED and not (args.command == "admin" and (admin_run_dir(args) or args.admin in ("cleanup", "join-credential"))):
        # (admin on a run directory, --run-dir or this one, follows the run: its RUN_DIR/tls,
        # or plaintext for a run made --insecure)
        if args.command == "admin":
            check_admin_target(args)  # nothing named to talk to: that, not the transport, is what is missing
        raise InvalidArgument(
            f"{args.command} refuses plaintext gRPC: give --tls-dir DIR (mutual TLS; `diloco certs --out DIR` "
            "makes one for a run) or --insecure (tokens and credentials then cross the network in clear); "
            "both go before the command, e.g. `diloco --tls-dir DIR " + args.command + " ...`")


def _fork_server(argv: list[str]) -> int:
    """``diloco learner --fork-server``, a launcher's fork server (``diloco.coordinator.forks``): load
    what every learner loads before it can join (torch, the learner's code, the compiler
    front end torch loads at its first optimizer), then fork a learner per launch, each
    running as ``argv`` (less --fork-server) with the launch's arguments."""
    import importlib
    import time

    from diloco.coordinator import forks

    answers = forks.claim_stdout()
    started = time.monotonic()
    importlib.import_module("diloco.learner.server").preload()
    logger.info("fork server: loaded in %.1f s, waiting for launches", time.monotonic() - started)
    given = forks.serve(answers)
    if given is None:  # stdin closed: the launcher is gone
        return 0
    try:
        code = run([a for a in argv if a != forks.FLAG] + given)
    except SystemExit as exit_:  # argparse's
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # what the interpreter would print before exiting 1
        traceback.print_exc()
        code = 1
    # A forked learner ends here, as a forked child should (multiprocessing's do too):
    # without the interpreter's teardown, which would touch every object the server
    # loaded (copy-on-write page faults over the whole heap: 2-4 s measured per learner).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


BLAS_THREADS = {"OPENBLAS_NUM_THREADS": "1"}
"""numpy's BLAS runs on its calling thread in every diloco process. A shard's dot products
are memory-bound, and a BLAS worker thread spins for work after every call: at 4 learners
it took two thirds of a shard's CPU (56 ms per push, 19 ms without; ``diloco bench load``).
numpy reads it when it loads (building the parser loads it), so ``main`` sets it first;
an operator's own setting wins. Learners compute with torch, whose threads are its own."""


def run(argv: Sequence[str] | None = None, commands: Sequence[Callable] = COMMANDS) -> int:
    """Parse ``argv`` (the process's own arguments when None) with ``commands`` and run the
    command: a ``DilocoError`` is one line and exit code 2, an interrupt 130."""
    for name, value in BLAS_THREADS.items():
        os.environ.setdefault(name, value)
    parser = build_parser(commands)
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "config", None):  # the file's settings become the command's defaults
        try:
            apply_config(_deepest_parser(parser, args), read_config(args.config), args.config)
        except DilocoError as error:
            print(f"diloco: error: {error}", file=sys.stderr)
            return 2
        args, unknown = parser.parse_known_args(argv)
    if unknown:
        _deepest_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if args.exit_with_parent:
        _exit_with_parent()
    # A supervisor that gives up on a process sends SIGUSR1 before SIGKILL: the stacks of
    # every thread go to the log, so a hang says where it was.
    with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):  # stderr not a file: in-process callers
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        _choose_transport(args)
        if getattr(args, "serve_forks", False):
            return _fork_server(list(sys.argv[1:] if argv is None else argv))
        return args.func(args)
    except DilocoError as error:
        print(f"diloco: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("diloco: interrupted", file=sys.stderr)
        return 130

