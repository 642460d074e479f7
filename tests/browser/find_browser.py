"""Find the Chromium that the browser test drives, or install one, or say what to install.

`make test` runs this first (`make check-browser`), so a machine without a browser stops
in seconds instead of after the half hour of tests before the browser test. The browser
is looked for in this order:

1. ``BOOK_CHROMIUM``, when set: it must name a file that exists (no fallback, so a
   mistyped path is reported, not silently replaced);
2. Chromium or Chrome on ``PATH`` (``chromium``, ``chromium-browser``,
   ``google-chrome``, ``google-chrome-stable``, ``chrome``), then in the usual macOS
   and Windows places;
3. Playwright's own Chromium (what ``python -m playwright install chromium`` puts in
   its cache).

With ``--install`` and none found, it runs ``python -m playwright install chromium``
(needs a download, which fails quickly where there is none) and looks again. Last, it
starts the browser it found headless on a blank page, so a browser that cannot run
(missing system libraries) is reported here too.

    python tests/browser/find_browser.py [--install]

prints the browser's path and exits 0, or prints what to install and exits 1. It needs
only the standard library and Playwright.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import time

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
INSTALLED = (
    "/Applications/Chromium.app/Contents/MacOS/Chromium",
    "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome",
    "~/Applications/Chromium.app/Contents/MacOS/Chromium",
    "~/Applications/Google Chrome.app/Contents/MacOS/Google Chrome",
    r"C:\Program Files\Google\Chrome\Application\chrome.exe",
    r"C:\Program Files (x86)\Google\Chrome\Application\chrome.exe",
)
# headless Chromium on a machine with no outside network and no GPU: without the
# background-networking flags it keeps trying to reach Google's hosts
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
INSTALL_TIMEOUT_S = 600

HOW_TO_INSTALL = """\
The browser test (the last step of `make test`) needs Chromium or Google Chrome. Any one of:
  Debian/Ubuntu:  sudo apt-get install chromium      (what .ci/run does)
  macOS:          install Google Chrome, or: brew install --cask chromium
  anywhere with a network:  .venv/bin/python -m playwright install chromium
  or point BOOK_CHROMIUM at a Chromium or Chrome binary you have:
                  BOOK_CHROMIUM=/path/to/chrome make test"""


class NoBrowser(RuntimeError):
    """No usable Chromium: the message says what was looked for and what to install."""


def playwright_chromium() -> pathlib.Path | None:
    """The Chromium that Playwright installed into its cache, if it did."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    try:
        with sync_playwright() as pw:
            path = pathlib.Path(pw.chromium.executable_path)
    except Exception:  # Playwright's driver could not start: no browser from it
        return None
    return path if path.is_file() else None


def find() -> pathlib.Path:
    """The browser to drive: BOOK_CHROMIUM, else PATH, the usual places, Playwright's."""
    chosen = os.environ.get("BOOK_CHROMIUM")
    if chosen:
        path = pathlib.Path(chosen).expanduser()
        if not path.is_file():
            raise NoBrowser(f"BOOK_CHROMIUM={chosen} names no file; set it to a Chromium "
                            f"or Chrome binary, or unset it to search.\n{HOW_TO_INSTALL}")
        return path
    for name in NAMES:
        found = shutil.which(name)
        if found:
            return pathlib.Path(found)
    for place in INSTALLED:
        path = pathlib.Path(place).expanduser()
        if path.is_file():
            return path
    path = playwright_chromium()
    if path is not None:
        return path
    raise NoBrowser(f"no Chromium or Chrome found (BOOK_CHROMIUM unset; none of "
                    f"{', '.join(NAMES)} on PATH; not in the usual macOS or Windows "
                    f"places; no Playwright Chromium).\n{HOW_TO_INSTALL}")


def install() -> str:
    """Try `python -m playwright install chromium`; return what it said if it failed."""
    command = [sys.executable, "-m", "playwright", "install", "chromium"]
    print("no browser found; trying:", " ".join(command[1:]), flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"it did not finish in {INSTALL_TIMEOUT_S} s"
    if done.returncode == 0:
        return ""
    said = [line.strip() for line in (done.stderr + done.stdout).splitlines()]
    errors = [line for line in said if line.startswith("Error")] or said[-1:]
    return f"it failed (exit {done.returncode}): {errors[0] if errors else 'no output'}"


def launches(path: pathlib.Path) -> None:
    """Start the browser headless on a blank page; NoBrowser if it cannot."""
    from playwright.sync_api import sync_playwright

    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(path), args=ARGS,
                                         headless=True)
            try:
                browser.new_page().goto("about:blank")
            finally:
                browser.close()
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise NoBrowser(f"{path} is there but does not start headless: {first}\n"
                        f"{HOW_TO_INSTALL}") from None


def ensure(install_missing: bool) -> pathlib.Path:
    """find(), else (install_missing) install and find again; then check it starts."""
    try:
        path = find()
    except NoBrowser as missing:
        if not install_missing or os.environ.get("BOOK_CHROMIUM"):
            raise
        failed = install()
        if failed:
            raise NoBrowser(f"{missing}\n(`python -m playwright install chromium` was "
                            f"tried: {failed})") from None
        path = find()
    launches(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--install", action="store_true",
                        help="where none is found, try `playwright install chromium`")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = ensure(args.install)
    except NoBrowser as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"browser for the browser test: {path} "
          f"(found and started in {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
