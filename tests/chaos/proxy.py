"""An HTTP proxy in front of an S3 endpoint that throttles: S3's 503 SlowDown on every n-th request."""
from __future__ import annotations

import http.client
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FlakyProxy(ThreadingHTTPServer):
    """An HTTP proxy in front of an S3 endpoint that answers every `every`-th request of each
    method with 503 SlowDown (S3's throttling error) instead of forwarding it."""

    daemon_threads = True

    def __init__(self, upstream: str, every: int = 4):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.every = every
        self.seen: Counter = Counter()
        self.failed: Counter = Counter()
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def should_fail(self, method: str) -> bool:
        with self.lock:
            self.seen[method] += 1
            fail = self.seen[method] % self.every == 0
            if fail:
                self.failed[method] += 1
            return fail


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        body = self._body()
        if self.server.should_fail(self.command):
            error = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                     b"<Message>Please reduce your request rate.</Message></Error>")
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(error)))
            self.end_headers()
            self.wfile.write(error if self.command != "HEAD" else b"")
            return
        conn = http.client.HTTPConnection(*self.server.upstream, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "expect")}
        headers["Content-Length"] = str(len(body))
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(k, v)
        # HEAD answers carry the object's length, not the (empty) body's.
        length = resp.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
