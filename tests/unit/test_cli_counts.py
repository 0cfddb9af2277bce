"""Counts on the command line: ``--params 1Mi`` as the help shows them, bad ones refused in
one line by argparse."""

import argparse
import subprocess
import sys

import pytest

from diloco.cli.common import parse_count


@pytest.mark.parametrize("text,value", [("1048576", 1048576), ("1Mi", 2**20), ("64Mi", 64 * 2**20), ("4M", 4_000_000),
                                        ("2Ki", 2048), ("1G", 10**9), ("3Gi", 3 * 2**30)])
def test_parse_count_reads_plain_decimal_and_binary_suffixes(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["", "0", "-1", "1Mx", "1.5M", "Mi", "1iM", "1 Mi Mi", "0Ki"])
def test_parse_count_refuses_what_is_not_a_positive_count(text):
    with pytest.raises(argparse.ArgumentTypeError, match="positive whole number"):
        parse_count(text)


def test_bench_syncer_refuses_a_bad_params_in_one_line_before_starting():
    proc = subprocess.run([sys.executable, "-m", "diloco", "bench", "syncer", "--params", "1Mx"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "argument --params: expected a positive whole number" in proc.stderr
