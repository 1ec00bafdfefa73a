"""A loopback reverse proxy in front of a real `mlflow server` that checks a bearer token, as an authenticating
gateway does (MLflow's own auth app, an ingress with OIDC): requests carrying `Authorization: Bearer <token>` for
the current token are forwarded, every other one is answered 401 with MLflow auth's wording (but /health, which
MLflow's auth app leaves open too). `revoke()` replaces
the token (an expired or rotated one) and `restore()` takes the old one back; `revoke_when(predicate)` revokes
once a forwarded request matches (an event in the run, not a moment in time).

Used by tests/test_outage.py: the MLflow client reads MLFLOW_TRACKING_TOKEN at each request and sends it as
that bearer token.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

NOT_AUTHENTICATED = ("You are not authenticated. Please see https://www.mlflow.org/docs/latest/auth/index.html"
                     "#authenticating-to-mlflow on how to authenticate.")
HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
       "transfer-encoding", "upgrade", "content-length"}


class AuthProxy:
    def __init__(self, upstream: str, token: str):
        self.upstream = urlsplit(upstream)
        self.token, self._old = token, token
        self.refused = 0  # requests answered 401
        self.revoked = threading.Event()
        self._when = None
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                # /health is open, as in MLflow's auth app (_UNPROTECTED_PATH_PREFIXES)
                if not self.path.startswith("/health") and not proxy._allowed(self.headers.get("Authorization", "")):
                    data = NOT_AUTHENTICATED.encode()
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Bearer realm="mlflow"')
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=120)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                proxy._forwarded(self.command, self.path, body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def _allowed(self, header: str) -> bool:
        with self._lock:
            ok = header == f"Bearer {self.token}"
            self.refused += not ok
            return ok

    def _forwarded(self, method: str, path: str, body: bytes) -> None:
        with self._lock:
            when = self._when
        if when is not None and when(method, path, body):
            self.revoke()

    def revoke_when(self, predicate) -> None:
        """Revoke the token once a forwarded request (method, path, body) satisfies `predicate`."""
        with self._lock:
            self._when = predicate

    def revoke(self, new: str = "rotated") -> None:
        with self._lock:
            self._when, self.token = None, new
        self.revoked.set()

    def restore(self) -> None:
        with self._lock:
            self.token = self._old

    def __enter__(self) -> AuthProxy:
        threading.Thread(target=self._server.serve_forever, name="authproxy", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
