"""The ``/metrics`` HTTP server: prometheus-client's as is without an auth file (also with a
``--token`` alone, as before); with one, only ``GET /metrics`` answers, and only to ``Authorization: Bearer`` of an admin
or reader token (401 otherwise, 404 for any other path)."""

from __future__ import annotations

import gzip
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.exposition import choose_encoder

from .auth import Access

__all__ = ["serve_metrics"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    registry: CollectorRegistry
    access: Access


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        if urlsplit(self.path).path != "/metrics":
            self._send(404, b"not found: only /metrics answers\n", "text/plain; charset=utf-8", body)
            return
        addr, port = self.client_address[:2]
        peer = f"ipv6:[{addr}]:{port}" if ":" in addr else f"ipv4:{addr}:{port}"
        why = self.server.access.metrics_refusal(self.headers.get("Authorization"), peer)
        if why is not None:
            self._send(401, f"unauthorized: {why}\n".encode(), "text/plain; charset=utf-8", body, bearer=True)
            return
        encoder, content_type = choose_encoder(self.headers.get("Accept"))
        output = encoder(self.server.registry)
        gzipped = "gzip" in (self.headers.get("Accept-Encoding") or "")
        self._send(200, gzip.compress(output) if gzipped else output, content_type, body, gzipped=gzipped)

    def _send(
        self, code: int, data: bytes, content_type: str, body: bool, bearer: bool = False, gzipped: bool = False
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if bearer:
            self.send_header("WWW-Authenticate", 'Bearer realm="eplb metrics"')
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # refusals go to the audit log (throttled); a line per scrape would be noise


def serve_metrics(host: str, port: int, registry: CollectorRegistry, access: Access | None) -> HTTPServer:
    """Serves ``registry`` on ``host:port`` in a daemon thread; ``OSError`` when it cannot bind."""
    if access is None:
        httpd, _ = start_http_server(port, addr=host, registry=registry)
        return httpd
    bare = host.strip("[]")
    server_class = _Server6 if ":" in bare else _Server
    httpd = server_class((bare, port), _Handler)
    httpd.registry, httpd.access = registry, access
    threading.Thread(target=httpd.serve_forever, name="eplb-metrics", daemon=True).start()
    return httpd
