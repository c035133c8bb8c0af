"""`thermocline serve`: the loaded model over the OpenAI API (chat and text completions, streamed or not)."""

from __future__ import annotations

import os
import sys

from engine.errors import UserError

from .common import add_model_options, load_engine

API_KEY_ENV = "THERMOCLINE_API_KEY"


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve a model over the OpenAI API")
    add_model_options(parser, sampling=False)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: loopback; anything else needs --api-key)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    parser.add_argument("--api-key", default=None,
                        help=f"key every request must carry as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    parser.add_argument("--queue", type=int, default=8, metavar="N",
                        help="requests that may wait behind the running one; more get 429 (default 8)")
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="a web page origin (scheme://host[:port], or *) whose scripts may call the server; "
                             "repeatable; adds to the server.allowed_origins setting (default: none, only "
                             "the server's own pages and non-browser clients)")
    parser.set_defaults(handler=run)


def allowed_origins_setting() -> list[str]:
    from app.settings import Settings

    return Settings()["server.allowed_origins"]


def _tell_kernels(engine, log_line) -> None:
    """On a first start: a line now that the kernels compile (requests are answered meanwhile),
    and one when they are in."""
    import threading

    from app.kernel_words import READY_LINE, preparing_line

    prep = getattr(engine, "kernel_preparation", None)
    if prep is None:
        return
    log_line(f"{preparing_line(prep.compiled(), prep.total)}; requests are answered meanwhile, more slowly")

    def when_ready() -> None:
        prep.wait()
        if prep.error is None:
            log_line(READY_LINE)
        else:  # those compiled are in; the rest stay on the torch paths
            log_line(f"warning: some fast CPU kernels could not be prepared ({prep.error}); "
                     "requests stay on slower paths")

    threading.Thread(target=when_ready, name="thermocline-kernels-note", daemon=True).start()


def run(args) -> int:
    import uvicorn

    from app.kernel_words import kernels_choice
    from app.server.api import build_app
    from app.server.guard import check_origins
    from app.server.runner import base_url, bind_socket, check_bind, make_config

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    check_bind(args.host, api_key)  # before the model loads: a refusal should be instant
    if not 0 <= args.port <= 65535:
        raise UserError(f"port {args.port} is not a TCP port (0-65535)")
    if args.queue < 0:
        raise UserError("--queue must be 0 or more")
    origins = check_origins([*allowed_origins_setting(), *args.allow_origin])
    # A first start answers on slower paths while the fast kernels compile, as the chat does:
    # waiting for them held every request of a fresh install for minutes (the demo's first 8
    # streamed requests: 100 s to their first token on a 2-core host).
    engine = load_engine(args, kernels_choice())
    model_id = args.model

    def log_line(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    app = build_app(lambda: engine, lambda: model_id, api_key=api_key, max_waiting=args.queue, on_request=log_line,
                    host=args.host, allowed_origins=origins)
    server = uvicorn.Server(make_config(app, args.host, args.port))
    sock = bind_socket(args.host, args.port)
    port = sock.getsockname()[1]
    sys.stderr.write(f"serving {model_id} ({engine.mode} mode, context {engine.ctx}) at "
                     f"{base_url(args.host, port)}{' (API key required)' if api_key else ''}\n")
    sys.stderr.flush()
    _tell_kernels(engine, log_line)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        app.state.gate.close()
    return 0
