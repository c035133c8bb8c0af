"""uvicorn's h11 connection with the limits it lacks: a header read timeout and a 431.

Why a subclass and not an option: uvicorn's `timeout_keep_alive` runs only between
requests, so a client that sends its headers a byte at a time (slow loris) holds its
connection for ever; and h11's `max_incomplete_event_size` (the header size limit, which we
set) ends in uvicorn's plain-text 400 and an immediate close, which the kernel turns into a
TCP reset while the client is still sending, so the client never reads it. Here a request's
head must arrive within `HEAD_TIMEOUT_S` of the connection opening (or of the previous
response), an oversized head is answered 431 with an OpenAI error body, and after any
refusal the rest of what the client sends is read and dropped for a moment before the
close, so the answer reaches it. h11 rather than httptools: it is what uvicorn picks here
(httptools is not a dependency) and it exposes the size limit.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 64 * 1024  # h11's own default is 16 KiB; browsers' cookies can need more
LINGER_S = 2.0


def _error_bytes(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_timer = None
        self._head_bytes = 0
        self._waiting_after = None  # the cycle before the request whose head is awaited
        self._dropping = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._dropping:
            return
        if self.conn.their_state is h11.IDLE:
            self._head_bytes += len(data)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._head_bytes = 0
        self._waiting_after = self.cycle
        self._arm_head_timer()  # the next request's head has the same time to arrive

    def send_400_response(self, msg: str) -> None:
        if self.cycle is self._waiting_after and self._head_bytes > MAX_HEAD_BYTES:  # the head never parsed
            self._refuse(_error_bytes(431, "Request Header Fields Too Large",
                                      f"the request's headers are larger than {MAX_HEAD_BYTES} bytes",
                                      "headers_too_large"))
        else:
            self._refuse(_error_bytes(400, "Bad Request", "the request is not valid HTTP/1.1", "invalid_http"))

    def _refuse(self, response: bytes) -> None:
        self._cancel_head_timer()
        self._dropping = True
        self.transport.write(response)
        self.loop.call_later(LINGER_S, self.transport.close)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        if not self.transport.is_closing():
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._head_bytes:  # part of a request came: say why it ends
                self._refuse(_error_bytes(408, "Request Timeout",
                                          f"the request's headers did not arrive within {HEAD_TIMEOUT_S:g} s",
                                          "request_timeout"))
            else:
                self.transport.close()
