"""The bandwidth sweep's pure parts: its rates, which rate a system keeps its pace down
to, the targets read from the cells, and the table."""

import pytest

from diloco.errors import InvalidArgument
from diloco.lab.bandwidth import lowest_kept_rate, parse_rates, table, targets


def test_rates_are_checked_and_fastest_first():
    assert parse_rates("5,1000,20") == (1000.0, 20.0, 5.0)
    for bad in ("", "fast", "5,5", "0", "1,200000"):
        with pytest.raises(InvalidArgument, match="--bandwidth-sweep"):
            parse_rates(bad)


def _cell(tokens_per_s, wall_s=40.0, eval_final=2.5, limited=False, overhead=None, beyond=None):
    run = {"tokens_per_s": tokens_per_s, "wall_s": wall_s, "eval_loss_final": None if limited else eval_final,
           "time_limited": limited, "links_overhead": overhead, "links_beyond_headers": beyond}
    return {**run, "spread": {}, "seeds": [run]}


def test_the_rate_kept_is_the_lowest_with_90_percent_of_the_fastest_pace_and_every_rate_above_it():
    cells = {1000.0: _cell(100), 100.0: _cell(95), 20.0: _cell(91), 5.0: _cell(50), 1.0: _cell(92)}
    assert lowest_kept_rate(cells) == 20.0  # 1 Mbit/s's 92 does not count: 5 Mbit/s lost the pace
    assert lowest_kept_rate({1000.0: _cell(100), 100.0: _cell(89.9)}) == 1000.0
    assert lowest_kept_rate({1000.0: _cell(None)}) is None


def test_targets_are_read_from_the_cells_and_missed_ones_say_so():
    results = {"cells": {
        "1000": {"decoupled": _cell(100, 40, 2.50, overhead={"up": 0.03, "down": 0.05}), "dp": _cell(100),
                 "torchft": _cell(100)},
        "100": {"decoupled": _cell(99), "dp": _cell(95), "torchft": _cell(98)},
        "5": {"decoupled": _cell(95, 44, 2.52, overhead={"up": 0.02, "down": 0.12}, beyond={"up": 0.05, "down": 0.04}),
              "dp": _cell(10, limited=True),
              "torchft": _cell(60)},
    }}
    checks = {name: (ok, said) for name, ok, said in targets(results)}
    wall = checks["Decoupled's wall time at 5 Mbit/s <= 1.15x its time at 1000 Mbit/s"]
    assert wall == (True, "44.0 s vs 40.0 s: 1.10x")
    assert checks["Decoupled's eval at 5 Mbit/s within 3 % of its 1000 Mbit/s value"][0] is True
    kept = next(v for k, v in checks.items() if k.startswith("the lowest rate"))
    assert kept[0] is True and kept[1].endswith(": 20x") and "dp 100 Mbit/s" in kept[1]
    assert checks["... and lower than torchft's"][0] is True
    counters = next(v for k, v in checks.items() if k.startswith("kernel byte counters"))
    assert counters == (False, "worst +12.0% (down, 5 Mbit/s)")
    assert next(v for k, v in checks.items() if k.startswith("... or, the Ethernet")) == (True, "worst +5.0% (up, 5 Mbit/s)")
    lines = table(results).splitlines()
    assert "| 5 | dp | 1 | 1 | 40 | 10 | – |" in "\n".join(lines)
