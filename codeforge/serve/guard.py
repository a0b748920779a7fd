"""What stands between the network and the server's handlers: the Guard middleware (Host and Origin checks
against DNS rebinding and cross-site pages, the API key, the body-size cap, request metrics, a last-resort
500 in the OpenAI shape), the parsing of --allowed-hosts / --allowed-origins, and the playground page's
security headers. app.py mounts the Guard around every route."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import re
import sys
import time
import traceback
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from .protocol import ApiError

OPEN_PATHS = ("/health", "/", "/favicon.ico")  # reachable without the API key
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def page_security_headers(page: bytes) -> dict:
    """The playground's Content-Security-Policy: its own inline script and style (by hash) and nothing else,
    connections to this origin alone (the page sends the API key with every request: a script or a `?base=`
    that reached another server would carry it there), no framing, no forms, no plugins."""
    def hashes(tag: str) -> str:
        bodies = re.findall(rb"<" + tag.encode() + rb"(?:\s[^>]*)?>(.*?)</" + tag.encode() + rb">", page,
                            re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b).digest()).decode()}'" for b in bodies) \
            or "'none'"
    csp = (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; img-src data:; "
           f"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return {"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header or an --allowed-hosts entry as (name, port): 'Example.com:8000' -> ('example.com', 8000),
    '[::1]:8000' -> ('::1', 8000), a bare '::1' or no port -> port None; None when it is not a host."""
    v = value.strip().lower()
    if v.startswith("["):
        name, close, rest = v[1:].partition("]")
        if not close or (rest and not rest.startswith(":")):
            return None
        sep, port = rest[:1], rest[1:]
    elif v.count(":") > 1:  # a bare IPv6 address
        name, sep, port = v, "", ""
    else:
        name, sep, port = v.partition(":")
    if not name or any(c in name for c in "/@?# \t\\") or (sep and not port.isdigit()):
        return None
    return name, int(port) if port else None


def _parse_entries(entries, split, flag: str, shape: str) -> frozenset | None:
    """Each entry of a command-line list through `split`; None when one is '*' (any); ValueError naming the
    flag and the expected shape for an entry `split` refuses."""
    out = set()
    for e in entries:
        if e.strip() == "*":
            return None
        got = split(e)
        if got is None:
            raise ValueError(f"{flag}: {e!r} is not {shape}")
        out.add(got)
    return frozenset(out)


def parse_hosts(entries) -> frozenset[tuple[str, int | None]] | None:
    """--allowed-hosts as a set of (name, port or None for any); None when it holds '*'."""
    return _parse_entries(entries, split_host, "--allowed-hosts",
                          "a host name or address (NAME, NAME:PORT, IP or [IPv6]:PORT)")


def parse_origins(entries) -> frozenset[tuple[str, str, int]] | None:
    """--allowed-origins as a set of (scheme, host, port); None when it holds '*'."""
    return _parse_entries(entries, split_origin, "--allowed-origins",
                          "an origin (scheme://host[:port], as a browser sends it, e.g. http://localhost:3000)")


def split_origin(value: str) -> tuple[str, str, int] | None:
    """An Origin header as (scheme, host, port with the scheme's default); None for 'null' or anything else
    that is not scheme://host[:port]."""
    try:
        u = urlsplit(value.strip().lower())
        port = u.port or {"http": 80, "https": 443}.get(u.scheme)
    except ValueError:
        return None
    if (
        u.scheme not in ("http", "https")
        or not u.hostname
        or u.path not in ("", "/")
        or u.query
        or u.fragment
    ):
        return None
    return u.scheme, u.hostname, port


class Guard:
    """Plain ASGI middleware around every request: Host and Origin, API key, body size, metrics, and a
    last-resort 500 in the OpenAI shape (the server never answers with a traceback or dies on a request).

    Host: a page on any site can make the user's browser send requests to 127.0.0.1, and with DNS rebinding
    (evil.example resolving to 127.0.0.1 after the page loaded) read the answers as its own; the browser
    then sends `Host: evil.example`. So the Host must name a loopback address, localhost, the --host the
    server is bound to or the address the connection arrived at, with the server's port, or an
    --allowed-hosts entry. Origin: browsers send it with cross-site requests (and same-origin POSTs); only
    the server's own origin (its playground page) and --allowed-origins are answered. Clients that are not
    browsers send no Origin and are not concerned."""

    def __init__(self, app, srv):  # srv: app.py's ServerState (app.py mounts the Guard; no import back)
        self.app, self.srv = app, srv
        opts = srv.opts
        self.hosts = parse_hosts(opts.allowed_hosts)
        self.origins = parse_origins(opts.allowed_origins)
        names = set(LOOPBACK_NAMES)
        if opts.host and opts.host not in ("0.0.0.0", "::", ""):
            names.add(opts.host.strip("[]").lower())
        self.own_names = frozenset(names)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status, started = [500], [False]

        async def send_w(msg):
            if msg["type"] == "http.response.start":
                status[0], started[0] = msg["status"], True
            await send(msg)

        limit, seen = self.srv.opts.max_body_bytes, [0]

        async def receive_w():
            msg = await receive()
            if msg["type"] == "http.request":
                seen[0] += len(msg.get("body", b""))
                if seen[0] > limit:
                    raise ApiError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)",
                                   code="body_too_large")
            return msg

        try:
            err = self._precheck(scope)
            if err is not None:
                if err.status == 413:
                    await _drain(receive, 64 << 20)  # read it, so the client gets to read the answer
                await error_response(err)(scope, receive, send_w)
            else:
                await self.app(scope, receive_w, send_w)
        except Exception as e:  # noqa: BLE001 - a request must never take the server down
            if isinstance(e, (OSError, ClientDisconnect)):
                return  # the client went away mid-response
            if not isinstance(e, ApiError):
                traceback.print_exc(file=sys.stderr)
                e = ApiError(500, f"internal error: {type(e).__name__}: {e}")
            if not started[0]:
                with contextlib.suppress(Exception):
                    await error_response(e)(scope, receive, send_w)
        finally:
            self.srv.metrics.observe_request(scope["path"], status[0], time.perf_counter() - t0)

    def _check_host(self, scope, host: str | None) -> ApiError | None:
        if self.hosts is None or host is None:  # '*', or no Host (HTTP/1.0; browsers always send one)
            return None
        h = split_host(host)
        server = scope.get("server") or ("", None)
        default_port = 443 if scope.get("scheme") == "https" else 80
        if h is not None:
            name, port = h[0], h[1] or default_port
            if (name in self.own_names or name == str(server[0]).lower()) and port == server[1]:
                return None
            if (name, None) in self.hosts or (name, port) in self.hosts:
                return None
        shown = h[0] if h else host
        return ApiError(400,
                        f"the Host header {host!r} is neither this machine's loopback nor the server's own "
                        "address and port: a web page can reach "
                        "a local server that way (DNS rebinding). "
                        f"If you reach the server by that name, start it with --allowed-hosts {shown} "
                        f"(comma-separated; '*' allows any)", param="Host", code="host_not_allowed")

    def _check_origin(self, scope, origin: str | None, host: str | None) -> ApiError | None:
        if origin is None or self.origins is None:
            return None
        o = split_origin(origin)
        if o is not None:
            if o in self.origins:
                return None
            h = split_host(host) if host else None
            scheme = scope.get("scheme", "http")
            if h is not None and o == (scheme, h[0], h[1] or (443 if scheme == "https" else 80)):
                return None  # the server's own page (the playground)
        return ApiError(403,
                        f"requests from web pages at {origin!r} are refused: a page on another site must not "
                        "use this server through your browser. To "
                        "allow that page, start the server with "
                        f"--allowed-origins {origin.strip() if o else 'ORIGIN'} (comma-separated; '*' "
                        f"allows any)", param="Origin", code="origin_not_allowed")

    def _precheck(self, scope) -> ApiError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        err = (self._check_host(scope, headers.get("host"))
               or self._check_origin(scope, headers.get("origin"), headers.get("host")))
        if err is not None:
            return err
        key = self.srv.opts.api_key
        preflight = scope["method"] == "OPTIONS" and "access-control-request-method" in headers
        if key and scope["path"] not in OPEN_PATHS and not preflight:  # a preflight never carries the key
            given = headers.get("authorization", "")
            token = given[7:].strip() if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), key.encode()):
                return ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' "
                                     "with the key the server was started with (--api-key)",
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.srv.opts.max_body_bytes:
            return ApiError(413, f"the request body ({length} bytes) is larger than "
                                 f"{self.srv.opts.max_body_bytes} "
                                 f"bytes (--max-body-bytes)", code="body_too_large")
        return None


async def _drain(receive, cap: int) -> None:
    got = 0
    while got <= cap:
        msg = await receive()
        if msg["type"] != "http.request":
            return
        got += len(msg.get("body", b""))
        if not msg.get("more_body"):
            return
