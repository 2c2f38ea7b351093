"""Screenshots of the built site, to look at it as a reader does.

    python docs/screenshots.py [--site site] [--out site/_screenshots]

Serves ``--site`` (made by ``make docs``) on 127.0.0.1 and has a headless Chromium
(Debian's ``chromium`` package) save the index, the DiLoCo page and the shoal.optim API
page as PNGs in ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

PAGES = {
    "index": "",
    "diloco": "algorithms/diloco/",
    "optim": "api/optim/",
    "tutorial": "tutorials/07_diloco/",
}
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    # Let the page's scripts run (MathJax typesets the tutorials' TeX after the load).
    "--virtual-time-budget=10000",
]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # print only the files written
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=Path("site"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    parser.add_argument("--height", type=int, default=1600, help="window height in pixels")
    parser.add_argument(
        "--page", action="append", metavar="NAME=PATH", help="more pages, e.g. cli=cli/"
    )
    args = parser.parse_args()
    out = args.out or args.site / "_screenshots"
    out.mkdir(parents=True, exist_ok=True)
    pages = dict(PAGES, **dict(p.split("=", 1) for p in args.page or ()))

    handler = functools.partial(_Quiet, directory=str(args.site.resolve()))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        for name, path in pages.items():
            png = (out / f"{name}.png").resolve()
            # A fresh profile each time: no state carried between pages.
            with tempfile.TemporaryDirectory() as profile:
                cmd = [
                    args.chromium,
                    *CHROMIUM_FLAGS,
                    f"--window-size=1280,{args.height}",
                    f"--user-data-dir={profile}",
                    f"--screenshot={png}",
                    base + path,
                ]
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            print(png)
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
