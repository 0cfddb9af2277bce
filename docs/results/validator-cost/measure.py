"""What the validator process costs: run `diloco local --validator ARGS...` and sample the
validator's process (found by its config file, RUN_DIR/validator.json) every 0.5 s from
/proc: CPU seconds (user + system), resident memory and bytes read (rchar: every read
call's bytes, sockets and files alike, so an upper bound on what it received from the
shards). Writes OUT/samples.csv, the
validator's log (OUT/validator.log) and a summary as JSON (OUT/summary.json, also printed);
the run directory itself is a temporary one.

    python docs/results/validator-cost/measure.py OUT [diloco local flags...]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def find(marker: str) -> int | None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    return int(entry.name)
            except OSError:
                continue
    return None


def sample(pid: int) -> tuple[float, int, int, int] | None:
    """(CPU seconds, RSS KiB, peak RSS KiB, bytes read) of a live process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        io = dict(line.split(": ", 1) for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    except OSError:
        return None
    if "VmRSS" not in status:  # exited, not yet reaped
        return None
    cpu = (int(stat[11]) + int(stat[12])) / TICK  # utime, stime (fields 14, 15)
    return cpu, int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0]), int(io["rchar"])


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="validator-cost-")) / "run"
    command = [sys.executable, "-m", "diloco", "local", "--validator", "--out", str(run_dir), "--json", *sys.argv[2:]]
    started = time.monotonic()
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    marker = str(run_dir / "validator.json")
    pid, rows, last = None, [], None
    while run.poll() is None:
        pid = pid or find(marker)
        if pid is not None and (s := sample(pid)) is not None:
            last = s
            rows.append((round(time.monotonic() - started, 2), *s))
        time.sleep(0.5)
    summary_text = run.stdout.read()
    (out / "samples.csv").write_text("t_s,cpu_s,rss_kib,peak_rss_kib,read_bytes\n" + "".join(f"{t},{c},{r},{h},{b}\n" for t, c, r, h, b in rows))
    alive = rows[-1][0] - rows[0][0] if len(rows) > 1 else 0.0
    result = {
        "command": " ".join(command[1:]), "exit": run.returncode, "validator_samples": len(rows),
        "validator_alive_s": round(alive, 1), "validator_cpu_s": last[0] if last else None,
        "validator_mean_cores": round((rows[-1][1] - rows[0][1]) / alive, 2) if alive else None,
        "validator_peak_rss_mib": round(last[2] / 1024, 1) if last else None,
        # Over the second half of its life: past its start (imports read files too).
        "validator_read_mib_per_s_second_half": round(
            (rows[-1][4] - rows[len(rows) // 2][4]) / (rows[-1][0] - rows[len(rows) // 2][0]) / 2**20, 2) if alive else None,
        "host_cpus": os.cpu_count(),
    }
    log = run_dir / "logs" / "validator.log"
    shutil.copy(log, out / "validator.log")
    scored = [line.rsplit(": ", 1)[1] for line in log.read_text().splitlines() if line.endswith("pushes scored")]
    result["validator_log_tail"] = scored[-1] if scored else None
    try:
        result["run"] = {k: v for k, v in json.loads(summary_text).items()
                         if not isinstance(v, (list, dict)) and k not in ("run_dir", "started_unix")}
    except json.JSONDecodeError:
        result["run_stdout_tail"] = summary_text[-2000:]
    shutil.rmtree(run_dir.parent, ignore_errors=True)
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
