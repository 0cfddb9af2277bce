"""The status page's stored screenshot (README, "Watch a run"): README's command 1
(`diloco local`, its embedded defaults) with the page it prints opened in Debian's
chromium through Playwright once every learner has reported a few training-loss points;
saved with the status.json the page drew and the run's console output.

Usage: python docs/results/status-page/capture.py [OUT_DIR]   (default: beside this file)
Needs: the dev extra (playwright) and `apt-get install -y chromium`.
"""

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

POINTS = 6
"""Training-loss points each learner's curve has when the page is captured."""


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    chromium = shutil.which("chromium") or sys.exit("chromium is not installed (as root: apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    run_dir = Path(tempfile.mkdtemp()) / "run"
    log = out / "local-output.txt"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "local", "--out", str(run_dir)],
                                stderr=stderr, stdout=subprocess.DEVNULL)
    while not (match := re.search(r"^status page: (\S+)$", log.read_text(), re.MULTILINE)):
        if proc.poll() is not None:
            sys.exit(f"diloco local ended before printing its status page:\n{log.read_text()}")
        time.sleep(0.2)
    url = match.group(1)
    while True:  # every learner has a few points
        status = json.loads(urllib.request.urlopen(url + "status.json", timeout=10).read())
        curves = status["curves"]
        if status["members"] and all(len(curves.get(m["id"], ())) >= POINTS for m in status["members"]):
            break
        time.sleep(0.5)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(url)
        page.wait_for_selector('#chart path.curve')
        page.wait_for_timeout(500)
        page.screenshot(path=str(out / "status-page.png"), full_page=True)
        (out / "status.json").write_text(
            json.dumps(json.loads(urllib.request.urlopen(url + "status.json", timeout=10).read()), indent=1) + "\n")
        browser.close()
    print(f"captured {url} -> {out / 'status-page.png'}; the run goes on to its end")
    sys.exit(proc.wait())


if __name__ == "__main__":
    main()
