"""The built documentation site in a real headless browser: every page renders, no link 404s, search finds.

Needs Chromium (Debian's ``chromium``) and the ``site`` extra (``pip install -e '.[site]'``: playwright's
driver only; the browser is the system's). Builds the site, serves it on 127.0.0.1, visits every page and
every link between them, searches, and screenshots the quick start::

    .venv/bin/python scripts/check_site.py --screenshot quickstart.png
"""

from __future__ import annotations

import argparse
import functools
import http.server
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
# Chromium on a closed network: without these it tries Google's hosts at every start
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--screenshot", type=Path, default=Path("quickstart.png"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as built:
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", built],
                       cwd=ROOT, check=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=built))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        pages = sorted(str(p.parent.relative_to(built)) for p in Path(built).rglob("index.html")
                       if "assets" not in p.parts and p.parent.name != "search")
        problems: list[str] = []
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=args.chromium, args=FLAGS)
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            links: set[str] = set()
            for path in pages:
                url = urljoin(base, "" if path == "." else path + "/")
                response = page.goto(url)
                heading = page.locator("article h1").first.inner_text() if page.locator("article h1").count() else ""
                if response is None or response.status != 200 or not heading:
                    problems.append(f"{url}: status {response and response.status}, heading {heading!r}")
                print(f"{response and response.status}  {path:<28} {heading}")
                for href in page.eval_on_selector_all("article a[href]", "els => els.map(e => e.href)"):
                    target, _ = urldefrag(href)
                    if urlparse(target).netloc == urlparse(base).netloc:
                        links.add(target)
            for target in sorted(links):
                status = page.request.get(target).status
                if status != 200:
                    problems.append(f"link {target}: {status}")
            print(f"{len(links)} links between pages checked")

            page.goto(base)
            page.keyboard.press("/")  # Material's key for search, as a reader would
            page.keyboard.type("pin", delay=50)
            page.locator(".md-search-result__item").first.wait_for(timeout=15_000)
            found = page.locator(".md-search-result__item").count()
            print(f"search for 'pin': {found} results")
            if not found:
                problems.append("search for 'pin' found nothing")

            page.goto(urljoin(base, "quickstart/"))
            page.screenshot(path=str(args.screenshot), full_page=False)
            print(f"quick start screenshot: {args.screenshot}")
            problems += [f"a page's script raised: {error}" for error in errors]
            browser.close()
        server.shutdown()
    for problem in problems:
        print(f"PROBLEM {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
