"""The dashboard in a real headless Chromium, over the simulated cluster (`make e2e`).

Starts `kvroute demo` (simulated vLLM instances, kvroute in proxy mode, a workload of
prompts sharing system prompts: what `make run` shows), opens `/dashboard` in Debian's
`chromium` driven by Playwright (its own browser download is never used), and checks
what a person would look at: a row per worker naming each instance with its state
`live`, the ready badge, charts that have drawn lines (pixels of the series colour, not
only the axes), predicted and actual cached tokens filled in, and that the page asked
nothing of any other origin. The screenshot is kept in `e2e-out/dashboard.png`.

Run from the repository root: ``.venv/bin/python -m e2e.dashboard``. Exit status 0 only
when every check passed. Chromium is installed by `make e2e` (apt-get) when missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import httpx

from e2e.ports import free_port
from e2e.processes import ManagedProcess, ProcessSet, install_signal_handlers

ROOT = Path(__file__).resolve().parent.parent
INSTANCES = 3
# The series colour of the charts (--a in style.css): a chart with a line has such pixels.
SERIES_RGB = (0x2F, 0x6F, 0xD0)
COUNT_SERIES_PIXELS = """([id, rgb]) => {
  const canvas = document.getElementById(id);
  const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  let n = 0;
  for (let i = 0; i < data.length; i += 4) {
    if (data[i + 3] > 200 && [0, 1, 2].every((c) => Math.abs(data[i + c] - rgb[c]) < 40)) n++;
  }
  return n;
}"""
CHARTS = ("chart-rate", "chart-latency", "chart-events", "chart-hits")


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise SystemExit("e2e dashboard: FAILED: Debian's chromium is not installed "
                         "(`make e2e` installs it: apt-get install chromium)")
    return path


def wait_for_fleet(base: str, demo: ManagedProcess, timeout: float) -> dict:
    """The dashboard's JSON once every instance is live and requests were routed."""
    deadline = time.monotonic() + timeout
    last: dict = {}
    with httpx.Client(timeout=10.0) as http:
        while time.monotonic() < deadline:
            if demo.exited() is not None:
                raise SystemExit(f"e2e dashboard: FAILED: kvroute demo exited:\n"
                                 f"{demo.log_tail()}")
            try:
                last = http.get(f"{base}/v1/dashboard").json()
            except (httpx.HTTPError, ValueError):
                time.sleep(0.2)
                continue
            states = [w["state"] for i in last["instances"] for w in i["workers"]]
            if (len(last["instances"]) == INSTANCES and states
                    and all(s == "live" for s in states) and last["routes"]["routed"] >= 10):
                return last
            time.sleep(0.2)
    raise SystemExit(f"e2e dashboard: FAILED: the fleet did not come up within "
                     f"{timeout:.0f}s: {last}")


def check_page(base: str, expected: dict, screenshot: Path, timeout: float) -> list[str]:
    """What is wrong with the rendered dashboard (nothing: an empty list)."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    foreign: list[str] = []
    errors: list[str] = []
    ids = sorted(i["id"] for i in expected["instances"])
    args = ["--no-sandbox"] if os.geteuid() == 0 else []  # Chromium refuses root otherwise
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), headless=True,
                                             args=args)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 900})
            page.on("request", lambda r: None if r.url.startswith(base) else
                    foreign.append(r.url))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(f"{base}/dashboard")
            try:
                # Every worker's row live, and at least 10 samples in the history (one a
                # second), so that each chart has a line to draw.
                page.wait_for_function(
                    """([n]) => {
                      const rows = [...document.querySelectorAll('#instances tr.worker')];
                      const live = rows.filter((r) => r.dataset.state === 'live').length;
                      const points = Number(document.getElementById('chart-rate')
                                                    .dataset.points || 0);
                      return rows.length === n && live === n && points >= 10;
                    }""", arg=[len(ids)], timeout=timeout * 1000)
            except PlaywrightError as exc:
                problems.append(f"the page did not render {len(ids)} live workers and a "
                                f"chart within {timeout:.0f}s: {exc.message.splitlines()[0]}")
            rows = page.eval_on_selector_all(
                "#instances tr.worker",
                "rows => rows.map(r => [r.dataset.instance, r.dataset.state, "
                "r.querySelector('td.state').textContent])")
            shown = sorted(instance for instance, _, _ in rows)
            if shown != ids:
                problems.append(f"instances shown {shown}, registered {ids}")
            if any(state != "live" or text != "live" for _, state, text in rows):
                problems.append(f"worker states shown: {rows}")
            if page.text_content("#ready") != "ready":
                problems.append(f"the ready badge says {page.text_content('#ready')!r}")
            for chart in CHARTS:
                pixels = page.evaluate(COUNT_SERIES_PIXELS, [chart, list(SERIES_RGB)])
                if pixels < 20:
                    problems.append(f"{chart} has drawn no line ({pixels} series pixels)")
            hits = page.eval_on_selector_all(
                "#instances tr.worker", "rows => rows.map(r => r.cells[16].textContent)")
            if not any("/" in text for text in hits):
                problems.append(f"no worker shows predicted / actual cached tokens: {hits}")
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    if foreign:
        problems.append(f"the page asked other origins: {sorted(set(foreign))[:5]}")
    if errors:
        problems.append(f"errors in the page: {errors[:5]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "e2e-out",
                        help="where the screenshot and kvroute's log go (default e2e-out/)")
    parser.add_argument("--timeout", type=float, default=90.0)
    args = parser.parse_args(argv)
    install_signal_handlers()
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs = ProcessSet()
    started = time.monotonic()
    binary = Path(sys.executable).parent / "kvroute"
    try:
        demo = procs.start(ManagedProcess(
            "kvroute-demo", [str(binary), "demo", "--port", str(port), "--instances",
                             str(INSTANCES), "--duration", str(args.timeout * 3)],
            dict(os.environ), args.out / "dashboard-demo.log"))
        expected = wait_for_fleet(base, demo, args.timeout)
        print(f"[{time.monotonic() - started:5.1f}s] kvroute demo at {base}: "
              f"{len(expected['instances'])} instances live, "
              f"{expected['routes']['routed']} requests routed; opening {base}/dashboard "
              f"in {chromium()}", flush=True)
        screenshot = args.out / "dashboard.png"
        problems = check_page(base, expected, screenshot, args.timeout)
    finally:
        procs.stop_all()
    for problem in problems:
        print(f"          {problem}")
    verdict = "PASS" if not problems else "FAIL"
    print(f"{verdict}  dashboard in headless Chromium: {INSTANCES} instances live, charts "
          f"drawn; screenshot {screenshot} ({time.monotonic() - started:.0f}s)")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
