"""A fault-injecting HTTP proxy in front of a GCS emulator: storage that fails now and then, or goes away for a
while, as the client libraries see it (503s or dropped connections). The data tests, the checkpoint-outage tests
and the real node's fault tests (bound to the host's address, where pods reach it) share it."""

from __future__ import annotations

import http.client
import re
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# google-cloud-storage's small uploads name the object in the body's JSON part, not in the URL.
_MULTIPART_NAME = re.compile(rb'"name":\s*"([^"]+)"')
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "upgrade"}


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that gave up mid-answer (its timeout, our outage) is what this proxy is for


class FlakyProxy:
    """HTTP proxy in front of the emulator that breaks every ``fail_every``-th object download.

    ``mode`` "503" answers Service Unavailable; "drop" closes the connection without an answer. Counters show how
    many downloads went through and how many were broken.
    """

    def __init__(self, target: str, fail_every: int, mode: str = "503", host: str = "127.0.0.1") -> None:
        self.target = target.removeprefix("http://")
        self.fail_every, self.mode = fail_every, mode
        self.downloads = self.injected = 0
        self.down_until = 0.0
        self.requests: list[str] = []  # "METHOD unquoted-path [uploaded object]" of every request, in order
        self.outages: list[tuple[str, float]] = []  # (the request that started it, monotonic start)
        self._trigger: tuple[str, str, float] | None = None
        self._lock = threading.Lock()
        self.server = _QuietServer((host, 0), self._handler())
        self.server.daemon_threads = True
        self.address = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def go_down(self, seconds: float) -> None:
        """An outage: for ``seconds`` every request fails (``mode`` "503": Service Unavailable; "drop": the
        connection closes unanswered)."""
        self.down_until = time.monotonic() + seconds

    def go_down_on(self, match: str, seconds: float, method: str = "") -> None:
        """An outage of ``seconds`` that starts with the first request (of ``method``, if given) whose unquoted path,
        or the object a multipart upload names, contains ``match`` (that request already fails)."""
        self._trigger = (f"{method} " if method else "", match, seconds)

    def should_fail(self, method: str, path: str, body: bytes = b"") -> bool:
        seen = f"{method} {urllib.parse.unquote(path)}"
        if "uploadType=multipart" in path and (name := _MULTIPART_NAME.search(body[:4096])):
            seen += f" [{name[1].decode(errors='replace')}]"
        with self._lock:
            self.requests.append(seen)
            if self._trigger is not None and seen.startswith(self._trigger[0]) and self._trigger[1] in seen:
                self.outages.append((seen, time.monotonic()))
                self.down_until, self._trigger = time.monotonic() + self._trigger[2], None
        if time.monotonic() < self.down_until:
            with self._lock:
                self.injected += 1
            return True
        if method != "GET" or "alt=media" not in path or self.fail_every <= 0:
            return False
        with self._lock:
            self.downloads += 1
            fail = self.downloads % self.fail_every == 0
            self.injected += int(fail)
            return fail

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.should_fail(self.command, self.path, body):
                    if proxy.mode == "drop":
                        self.connection.shutdown(socket.SHUT_RDWR)
                        self.close_connection = True
                        return
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                conn = http.client.HTTPConnection(proxy.target, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
