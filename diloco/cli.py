"""The ``diloco`` command line: one entry point, one subcommand per job.

Parsers are built without importing torch or grpc so ``diloco --help`` stays instant;
each subcommand imports its implementation when it runs. This is the only module that
configures logging handlers (and, later, reads environment variables).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence

from diloco import __version__
from diloco.errors import DilocoError

logger = logging.getLogger(__name__)

Handler = Callable[[argparse.Namespace], int]


def _bench_codec(args: argparse.Namespace) -> int:
    from diloco.bench import codec

    result = codec.run(size_mib=args.size_mib, repeats=args.repeats)
    _print_result(result, args.json)
    return 0


def _print_result(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    Console().print(table)


def _add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print ratios measured side by side")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    codec = kinds.add_parser("codec", help="int4 quantize/dequantize and zstd framing vs memcpy")
    codec.add_argument("--size-mib", type=int, default=64, help="fp32 data per measurement (default 64 MiB)")
    codec.add_argument("--repeats", type=int, default=5, help="timed repetitions; the best is reported")
    codec.add_argument("--json", action="store_true", help="print one JSON object")
    codec.set_defaults(func=_bench_codec)


def _simulate(args: argparse.Namespace) -> int:
    from diloco import simulate

    return simulate.run(args)


def _add_simulate(commands: argparse._SubParsersAction) -> None:
    from diloco.simulate import add_arguments

    parser = commands.add_parser(
        "simulate",
        help="goodput and uptime of DP, elastic DP and Decoupled DiLoCo at scale (discrete-event simulation)",
        description="Simulate chip failures at the paper's scale and report goodput and uptime.",
    )
    add_arguments(parser)
    parser.set_defaults(func=_simulate)


def build_parser() -> argparse.ArgumentParser:
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
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_bench(commands)
    _add_simulate(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        return args.func(args)
    except DilocoError as error:
        print(f"diloco: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("diloco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
