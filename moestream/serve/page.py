"""The page of `moestream serve`: a chat and the expert stream drawn live.

Plain HTML, CSS and JavaScript in `static/` (package data, nothing fetched
from elsewhere, no build step); the page streams chats from the server's own
/v1/chat/completions and draws /stats/stream (live.py). Served from app.py's
handler by `answer`.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler
from importlib import resources

from .live import Served, parse_query, snapshot, stream_events

__all__ = [
    "PATHS", "answer", "page_file", "parse_query", "quiet_requests", "snapshot",
    "stream_events",
]  # fmt: skip

# What `answer` serves besides the page's files (/static/NAME).
PATHS = ("/", "/stats", "/stats/stream")

TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}


def page_file(path: str) -> tuple[bytes, str] | None:
    """The body and content type of the page's file at URL `path` (/ is the
    page itself, /static/NAME its parts); None for any other path."""
    name = "index.html" if path in ("/", "/index.html") else None
    if path.startswith("/static/"):
        name = path.removeprefix("/static/")
    if not name or "/" in name or name.startswith(".") or "\\" in name:
        return None
    kind = TYPES.get(name[name.rfind(".") :]) if "." in name else None
    f = resources.files(__package__) / "static" / name
    if kind is None or not f.is_file():
        return None
    return f.read_bytes(), kind


def quiet_requests(record: logging.LogRecord) -> bool:
    """A root-logger filter: mlx_lm.server's INFO lines of each request (its
    prompt cache, prefill progress) pass only at DEBUG (-vv)."""
    per_request = record.name == "root" and record.levelno == logging.INFO
    if not per_request or not record.pathname.endswith("mlx_lm/server.py"):
        return True
    return logging.getLogger().getEffectiveLevel() <= logging.DEBUG


def answer(
    handler: BaseHTTPRequestHandler, server: Served, stop: threading.Event
) -> bool:
    """Answer a GET of the page, /stats (a snapshot) or /stats/stream (SSE
    until the client goes or `stop` is set); False for any other path."""
    path, _, query = handler.path.partition("?")
    if path == "/stats":
        _send(handler, 200, json.dumps(snapshot(server)).encode(), "application/json")
    elif path == "/stats/stream":
        try:
            interval, count = parse_query(query)
        except ValueError as e:
            _send(
                handler, 400, json.dumps({"error": str(e)}).encode(), "application/json"
            )
            return True
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Cache-Control", "no-cache")
        handler.end_headers()

        def write(data: bytes) -> None:
            handler.wfile.write(data)
            handler.wfile.flush()

        stream_events(write, lambda: snapshot(server), interval, count, stop)
    elif (found := page_file(path)) is not None:
        _send(handler, 200, *found)
    else:
        return False
    return True


def _send(handler: BaseHTTPRequestHandler, status: int, body: bytes, kind: str) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", kind)
    handler.send_header("Content-Length", str(len(body)))
    handler.send_header("Cache-Control", "no-cache")
    handler.end_headers()
    handler.wfile.write(body)
