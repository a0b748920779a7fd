"""Connections under clients that never finish: deadlines for the request head and body, and a cap on
open connections below the process's file-descriptor limit, in a subclass of uvicorn's h11 protocol.

Why here and not in ASGI middleware or a uvicorn option: middleware runs only once a request head has been
parsed, and uvicorn bounds only the idle time between requests (timeout_keep_alive), a timer that any byte
cancels. A client that sends a header line now and then, or its body a byte a second, holds a connection
(a file descriptor) for ever; a few hundred of them exhaust RLIMIT_NOFILE, accept() fails with EMFILE
(asyncio then stops accepting for a second at a time) and every other client, /health included, waits.
uvicorn's limit_concurrency does not help: it answers 503 only to a *request* that arrives over the limit.

What a connection may do (the deadlines are absolute: trickling bytes does not extend them):

  head        --header-timeout seconds from the connection's start, or from the first byte of a later
              request on a kept-alive connection, to the end of the request head; then it is closed.
  body        --body-timeout seconds from the end of the head to the end of the body; then it is closed
              and the handler waiting on the body sees the client gone.
  idle        --keep-alive seconds between a response and the next request's first byte (uvicorn's own
              timeout_keep_alive); the timer this module's protocol cancels whatever way the connection
              ends (uvicorn cancels it only on a clean close, so a reset left it pinning the protocol).
  answering   no limit here: the request is in, and --request-timeout bounds the generation.

--max-connections counts open connections. One arriving at the cap displaces the connection that has
waited longest on its client (sending a head or a body, or idle between requests), so slow clients cannot
lock others out however many they open; only when every connection is being answered is the newcomer
answered 503 and closed at once. The default cap comes from the file limit (connection_budget).
"""

from __future__ import annotations

import json
import os
import resource
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_DEFAULT_CONNECTIONS = 1024  # the default cap where the file limit allows more (memory stays small)
TIMEOUT_REASON = {"head": "header_timeout", "body": "body_timeout"}
LISTEN_QUEUE = 2048  # connections the kernel holds before accept(); the kernel caps it at net.core.somaxconn
RESERVED_FDS = 32  # files the server opens while serving: /proc reads for /metrics, logs, tokenizer, torch


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive: float = 5.0
    max_connections: int = MAX_DEFAULT_CONNECTIONS
    max_body_pieces: int = 4096  # chunks of one request's body (body_pieces() sizes it from --max-body-bytes)


MIN_BODY_PIECE = 256  # bytes: a body may come in one chunk per this many bytes of the body limit (or 4,096)


def body_pieces(max_body_bytes: int) -> int:
    """How many chunks one request's body may come in: a 1 MB body sent as a million 1-byte chunks cost ~7 s
    of the event loop (h11 parses each chunk in Python; the second hostile review), while honest clients send
    a body in a few large ones."""
    return max(4096, max_body_bytes // MIN_BODY_PIECE)


def _fragmented_response(n: int) -> bytes:
    body = json.dumps({"error": {"message": f"the request body arrives in more than {n:,} chunks; send it in "
                                            f"larger ones", "type": "invalid_request_error", "param": None,
                                 "code": "body_too_fragmented"}}).encode()
    return (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: a generous guess
        return 64


def connection_budget() -> tuple[int, int, int, int]:
    """(the most connections the file limit allows, uvicorn's backlog, the soft RLIMIT_NOFILE, files open
    now). asyncio accepts up to `backlog` connections per event-loop turn before any of them reaches the
    protocol that may close it, and up to three turns pass before it does, so 3 x backlog descriptors are
    kept free beside RESERVED_FDS and the files already open (the kernel's listen queue, deepened by Server,
    costs none)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft > 1 << 20:
        soft = 1 << 20
    now = open_fds()
    headroom = soft - now
    backlog = max(8, min(128, headroom // 8))
    return headroom - 3 * backlog - RESERVED_FDS, backlog, soft, now


class Server(uvicorn.Server):
    """uvicorn's server with a listen queue deeper than its accept batch. asyncio uses one number for both
    (uvicorn's config.backlog): it takes up to that many connections off the queue per event-loop turn, and
    those cost descriptors (connection_budget keeps room for them), while connections still in the kernel's
    queue cost none. A shallow queue drops the SYNs of a burst, and each dropped SYN costs its client a 1 s
    retransmit, so the queue is deepened once the server listens."""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        for sock in sockets or []:
            sock.listen(max(LISTEN_QUEUE, self.config.backlog))


def _busy_response(n: int) -> bytes:
    body = json.dumps({"error": {"message": f"the server has {n} connections open, all being answered "
                                            f"(--max-connections); retry shortly", "type": "server_error",
                                 "param": None, "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class ConnectionGuard:
    """The limits, the open connections and what happened to them (for /metrics): one per server."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.live: set = set()  # protocols accepted and not yet closed by us or the client
        # those waiting on their client, longest-waiting first (a protocol moves to the end when it starts
        # waiting), so finding whom to displace costs O(1) however many are open
        self.waiting: dict = {}
        self.closed = {"header_timeout": 0, "body_timeout": 0, "displaced": 0, "refused": 0, "fragmented": 0}

    def make_room(self) -> bool:
        """Close the connection that has waited longest on its client; False when every one is being
        answered."""
        if not self.waiting:
            return False
        next(iter(self.waiting)).expire("displaced")
        return True

    def protocol_class(self) -> type:
        """uvicorn's H11Protocol with this guard's deadlines and cap (pass as uvicorn.Config(http=...))."""
        guard, limits = self, self.limits

        class GuardedH11Protocol(H11Protocol):
            refused = False
            phase = "new"  # head | body | idle (between requests) | answering
            deadline = None

            def connection_made(self, transport) -> None:
                if len(guard.live) >= limits.max_connections and not guard.make_room():
                    self.refused = True
                    guard.closed["refused"] += 1
                    transport.write(_busy_response(len(guard.live)))
                    transport.close()
                    return
                guard.live.add(self)
                super().connection_made(transport)
                self.wait("head", limits.header_timeout)
                self.pieces = 0
                parse = self.conn.next_event

                def next_event():  # counts a request's body chunks as h11 parses them; past the cap, closes
                    ev = parse()
                    if isinstance(ev, h11.Request):
                        self.pieces = 0
                    elif isinstance(ev, h11.Data):
                        self.pieces += 1
                        if self.pieces > limits.max_body_pieces and not self.transport.is_closing():
                            guard.closed["fragmented"] += 1
                            if not self.cycle or not self.cycle.response_started:
                                self.transport.write(_fragmented_response(limits.max_body_pieces))
                            self.expire("fragmented")
                            return h11.NEED_DATA  # uvicorn stops reading; the handler sees the client gone
                    return ev
                self.conn.next_event = next_event

            def data_received(self, data: bytes) -> None:
                if self.refused:
                    return
                if self.phase == "idle":  # the first byte of the next request on a kept-alive connection
                    self.wait("head", limits.header_timeout)
                super().data_received(data)
                self.follow()

            def on_response_complete(self) -> None:
                super().on_response_complete()  # arms the keep-alive timer, runs a pipelined request
                if not self.transport.is_closing():
                    if self.conn.their_state is h11.IDLE:
                        self.wait("idle", None)  # uvicorn's keep-alive timer bounds it
                    else:
                        self.follow()

            def connection_lost(self, exc: Exception | None) -> None:
                guard.live.discard(self)
                guard.waiting.pop(self, None)
                self.cancel_deadline()
                if self.refused:
                    return
                super().connection_lost(exc)
                self._unset_keepalive_if_required()

            # -- the deadlines ------------------------------------------------------------------------------
            def follow(self) -> None:
                """Move to the phase h11's state of the client's side says."""
                if self.transport.is_closing():
                    return
                their = self.conn.their_state
                if their is h11.SEND_BODY:
                    if self.phase != "body":
                        self.wait("body", limits.body_timeout)
                elif their is not h11.IDLE and self.phase in ("head", "body"):
                    self.cancel_deadline()  # the request is in: answering it is not the client's time
                    self.phase = "answering"
                    guard.waiting.pop(self, None)

            def wait(self, phase: str, seconds: float | None) -> None:
                self.cancel_deadline()
                self.phase = phase
                guard.waiting.pop(self, None)
                guard.waiting[self] = None  # to the end: the latest to start waiting
                if seconds:
                    self.deadline = self.loop.call_later(seconds, self.expire, TIMEOUT_REASON[phase])

            def cancel_deadline(self) -> None:
                if self.deadline is not None:
                    self.deadline.cancel()
                    self.deadline = None

            def expire(self, reason: str) -> None:
                """Close the connection (a handler waiting on the body gets http.disconnect)."""
                self.cancel_deadline()
                guard.live.discard(self)
                guard.waiting.pop(self, None)
                if not self.transport.is_closing():
                    self.transport.close()
                    if reason != "fragmented":  # counted where it is found
                        guard.closed[reason] += 1

        return GuardedH11Protocol
