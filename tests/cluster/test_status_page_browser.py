"""The status page in a real browser (Debian's chromium, driven by Playwright) while a real
``diloco local`` trains: the members and their loss curves appear and move on, and when
the run stops the page says the coordinator does not answer."""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.test_local import TINY
from tests.required import require_binary

pytestmark = pytest.mark.cluster

STARTUP_S = 90


def _status_url(proc: subprocess.Popen, log: Path) -> str:
    """The URL ``diloco local`` prints once its coordinator serves."""
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline and proc.poll() is None:
        if match := re.search(r"^status page: (http://127\.0\.0\.1:\d+/)$", log.read_text(), re.MULTILINE):
            return match.group(1)
        time.sleep(0.2)
    raise AssertionError("diloco local printed no status page URL:\n" + log.read_text()[-3000:])


def _tokens(page) -> int:
    return int(re.match(r"([\d,]+) tokens trained", page.locator("#headline").inner_text()).group(1).replace(",", ""))


def test_the_page_shows_members_and_curves_updating(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    chromium = require_binary("chromium", "apt-get install -y chromium")
    # Long enough to outlast the checks; stopped by SIGTERM below (as Ctrl-C).
    log = tmp_path / "local.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "diloco", "local", "--learners", "2", "--shards", "2", "--steps", "100000",
             "--batch-size", "8", "--time-limit-s", "120", "--out", str(tmp_path / "run"), *TINY],
            stderr=stderr, stdout=subprocess.DEVNULL,
        )
    try:
        url = _status_url(proc, log)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--disable-gpu"])
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(url)
            expect(page.locator("#task")).to_have_text("diloco.tasks.byte_gpt:build", timeout=20_000)
            # Both learners listed and training.
            rows = page.locator("#members tr")
            expect(rows).to_have_count(3, timeout=30_000)  # the header and two learners
            for learner in ("L0", "L1"):
                expect(page.locator("#members tr", has_text=learner).locator("td.active")).to_have_text(
                    "active", timeout=30_000)
            # Each learner's curve, with a few points already.
            page.wait_for_function(
                """() => ["L0", "L1"].every((id) => {
                       const path = document.querySelector(`#chart path.curve[data-learner="${id}"]`);
                       return path && (path.getAttribute("d").match(/L/g) || []).length >= 2; })""",
                timeout=60_000)
            # Four fragments over two shards, each with a version.
            expect(page.locator("#shards tr")).to_have_count(5)
            first_tokens = _tokens(page)
            first_curve = page.locator('#chart path.curve[data-learner="L0"]').get_attribute("d")
            assert first_tokens > 0
            # It refreshes by itself: more tokens, a longer curve, without a reload.
            page.wait_for_function(
                f"""() => parseInt(document.getElementById("headline").textContent.replace(/,/g, "")) > {first_tokens}""",
                timeout=20_000)
            page.wait_for_function(
                """(before) => document.querySelector('#chart path.curve[data-learner="L0"]').getAttribute("d") !== before""",
                arg=first_curve, timeout=20_000)
            assert _tokens(page) > first_tokens
            assert "L0 active: first heartbeat" in page.locator("#events").inner_text()
            page.screenshot(path=str(tmp_path / "status.png"), full_page=True)
            assert (tmp_path / "status.png").stat().st_size > 20_000
            # The run stops: the page says so instead of showing stale figures as live.
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 130, log.read_text()[-3000:]  # interrupted, as after Ctrl-C
            expect(page.locator("#stale")).to_contain_text("the coordinator does not answer", timeout=20_000)
            expect(page.locator("#stale")).to_have_class("down")
            browser.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
