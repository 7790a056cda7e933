"""The README's picture of the serve page, on purpose, from a model that writes
readable text (the demo model, after `make demo`):

    python scripts/page_screenshot.py build/stdlib-moe docs/serve-page.png

Serves OUT on 127.0.0.1 with 4 slots a layer, asks the page two prompts in
Chromium (Playwright, as `make test-ui` installs them), waits for the charts
to take a few samples, and writes a full-page PNG.
"""

from __future__ import annotations

import argparse

from playwright.sync_api import sync_playwright

from moestream.runtime import RuntimeConfig
from moestream.serve import Server, ServerOptions

PROMPTS = ("def quicksort(xs):", "class LRUCache:")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a converted model OUT")
    p.add_argument("png", help="where the screenshot goes")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args()
    config = RuntimeConfig(cache_experts=4, context=512)
    options = ServerOptions(max_tokens=80, temp=0.7)
    with Server(args.model, config, options, port=0) as server, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(60_000)
        page.goto(server.url + "/")
        page.wait_for_selector("#status.live")
        page.fill("#max-tokens", "80")
        page.fill("#temperature", "0.7")
        for i, prompt in enumerate(PROMPTS):
            page.fill("#prompt", prompt)
            page.press("#prompt", "Enter")
            page.locator(".msg.assistant").nth(i).and_(
                page.locator("[data-done]")
            ).wait_for()
        page.wait_for_timeout(1500)  # a few samples after the answers
        page.screenshot(path=args.png, full_page=True)
        browser.close()


if __name__ == "__main__":
    main()
