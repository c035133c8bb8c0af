"""uvicorn on its own thread: the window's "Local server" switch, the tests and the benchmark.

`thermocline serve` runs uvicorn on the main thread instead (signals, Ctrl-C); both go
through `make_config`, so they serve the same application the same way.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from typing import Any, Callable

from engine.errors import UserError

from .api import build_app


def is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def check_bind(host: str, api_key: str | None) -> None:
    """Loopback by default; anywhere else only with a key, which every request must then carry."""
    if not is_loopback(host) and not api_key:
        raise UserError(f"listening on {host} makes the server reachable from other machines: "
                        "set an API key (--api-key KEY) or listen on 127.0.0.1")


def make_config(app, host: str, port: int):
    import uvicorn

    from .http_limits import MAX_HEAD_BYTES, GuardedH11Protocol

    # lifespan off: the application keeps no start-up state; access log off: ours names the tokens.
    # The h11 protocol with a header timeout and a 431 (http_limits.py says why not uvicorn's own).
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                          timeout_graceful_shutdown=3, http=GuardedH11Protocol,
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES)


def base_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/v1"


BACKLOG = 2048  # uvicorn's own default


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket on host:port (port 0: a free one); UserError when taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another port") from None
    # Listening now, not when uvicorn's startup gets to it: `thermocline serve` prints its
    # address before the server runs, and a client that connected at once was refused
    # (bench.serve's smoke test, twice in a row on one machine). Connections wait in the backlog.
    sock.listen(BACKLOG)
    return sock


class ServerThread:
    """A running server: `start()` returns once it listens (or raises why not), `stop()` ends it."""

    def __init__(self, get_engine: Callable[[], Any], get_model_id: Callable[[], str | None], *,
                 host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None, max_waiting: int = 8,
                 on_request: Callable[[str], None] | None = None, allowed_origins: tuple[str, ...] = (),
                 max_batch: int = 8):
        check_bind(host, api_key)
        self.host, self.port = host, port
        self.app = build_app(get_engine, get_model_id, api_key=api_key, max_waiting=max_waiting, max_batch=max_batch,
                             on_request=on_request, host=host, allowed_origins=allowed_origins)
        self._server = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return base_url(self.host, self.port)

    @property
    def state(self):
        return self.app.state

    def start(self, timeout: float = 20.0) -> "ServerThread":
        import uvicorn

        sock = bind_socket(self.host, self.port)
        self.port = sock.getsockname()[1]  # port 0 means a free one
        self._server = uvicorn.Server(make_config(self.app, self.host, self.port))

        def run() -> None:
            try:
                self._server.run(sockets=[sock])
            except BaseException as exc:  # noqa: BLE001 - reported by start()
                self._error = exc
            finally:
                sock.close()

        self._thread = threading.Thread(target=run, name="thermocline-serve", daemon=True)
        self._thread.start()
        waited = 0.0
        while not self._server.started:
            if not self._thread.is_alive() or waited > timeout:
                raise UserError(f"the server did not start on {self.host}:{self.port}: {self._error or 'timed out'}")
            self._thread.join(0.02)
            waited += 0.02
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.app.state.gate.close()
