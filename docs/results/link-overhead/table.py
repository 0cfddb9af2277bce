"""The per-cause table of ``run.sh``'s runs: python table.py RUN/summary.json..."""

import json
import sys
from pathlib import Path

CAUSES = ("ethernet", "not_ip", "segment_headers", "above_payload")


def main(paths: list[str]) -> None:
    print("| run | way | payload | kernel | kernel / payload - 1 | Ethernet headers | not IP | IPv4 + TCP headers "
          "| TCP stream beyond the payload | segments | frames | segments resent |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for path in paths:
        links = json.loads(Path(path).read_text())["links"]
        for way in ("up", "down"):
            b = links[f"breakdown_{way}"]
            shares = " | ".join(f"{b[c]:,} ({b[c + '_share']:+.1%})" for c in CAUSES)
            print(f"| {Path(path).parent.name} | {way} | {b['payload']:,} | {b['kernel']:,} | "
                  f"{links[f'overhead_{way}']:+.1%} | {shares} | {b['segments']:,} | {b['frames']:,} | "
                  f"{b.get('resent_segments', '')} |")


if __name__ == "__main__":
    main(sys.argv[1:])
