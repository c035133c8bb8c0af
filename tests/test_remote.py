"""Remote models (`models add-remote`, `remote/NAME`): pointed at our own `serve` on 127.0.0.1, and at
a real HTTP server that fails the ways remote servers fail (500, 401, cut streams)."""

from __future__ import annotations

import asyncio
import io
import json
import threading

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from app.cli import main
from app.server.runner import ServerThread, bind_socket, make_config

CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(autouse=True)
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv("THERMOCLINE_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("THERMOCLINE_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.delenv("REMOTE_TEST_KEY", raising=False)


@pytest.fixture(scope="module")
def served(engine):
    """Our own server, with a key, as the remote machine."""
    srv = ServerThread(lambda: engine, lambda: "demo", port=0, api_key="remote-key").start()
    yield srv
    srv.stop()


def run_cli(capsys, *argv, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def direct(engine, prompt, **kw):
    from engine import SamplingParams

    return engine.generate(prompt, SamplingParams(**kw))


# -- the registry ---------------------------------------------------------------------------------
def test_add_list_remove_remote(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "models", "add-remote", "box", "--url", "http://10.0.0.5:8000",
                           "--model", "llama", "--api-key-env", "BOX_KEY", "--json")
    assert code == 0
    entry = json.loads(out)
    assert entry == {"name": "box", "url": "http://10.0.0.5:8000/v1", "model": "llama",
                     "api_key_env": "BOX_KEY", "id": "remote/box"}
    code, out, _ = run_cli(capsys, "models", "list", "--json")
    assert [r["id"] for r in json.loads(out)["remotes"]] == ["remote/box"]
    saved = (tmp_path / "cfg" / "registry.json").read_text()
    assert "BOX_KEY" in saved and "remotes" in saved
    code, out, _ = run_cli(capsys, "models", "remove", "remote/box")
    assert code == 0 and "removed remote/box" in out
    code, _, err = run_cli(capsys, "generate", "--model", "remote/box", "--prompt", "hi")
    assert code == 2 and err.startswith("error: no remote model named 'box'")


@pytest.mark.parametrize("argv, words", [
    (["bad name", "--url", "http://x"], "remote name"),
    (["box", "--url", "ftp://x"], "not an http(s) URL"),
    (["box", "--url", "http://user:pw@x"], "environment variable"),
    (["box", "--url", "http://x", "--api-key-env", "NOT-A-VAR"], "not an environment variable"),
])
def test_add_remote_bad_input(capsys, argv, words):
    code, _, err = run_cli(capsys, "models", "add-remote", *argv)
    assert code == 2 and err.startswith("error: ") and words in err


# -- against our own serve -----------------------------------------------------------------------
def test_generate_and_chat_through_our_server(capsys, monkeypatch, served, engine):
    run_cli(capsys, "models", "add-remote", "local", "--url", served.url, "--api-key-env", "REMOTE_TEST_KEY")
    monkeypatch.setenv("REMOTE_TEST_KEY", "remote-key")
    code, out, err = run_cli(capsys, "generate", "--model", "remote/local", "--prompt", CHAT[0]["content"],
                             "--chat", "--json", "--temperature", "0", "--max-new-tokens", "12")
    assert code == 0, err
    report = json.loads(out)
    expected = direct(engine, CHAT, max_new_tokens=12, temperature=0)
    assert report["text"] == expected.text
    assert report["mode"] == "remote" and report["device"] == "remote"
    assert report["new_tokens"] == expected.stats.new_tokens
    assert report["prompt_tokens"] == len(engine.encode_prompt(CHAT))
    assert report["ttft_s"] > 0 and report["finish_reason"] in ("stop", "length")

    # A stop string is honoured on the server's side.
    stop = expected.text[4:7]
    code, out, _ = run_cli(capsys, "generate", "--model", "remote/local", "--prompt", CHAT[0]["content"], "--chat",
                           "--json", "--temperature", "0", "--max-new-tokens", "12", "--stop", stop)
    assert json.loads(out)["text"] == expected.text[:expected.text.index(stop)]

    # The terminal chat: the same answer, then a second turn carrying the first.
    code, out, err = run_cli(capsys, "chat", "--model", "remote/local", "--system", "", "--temperature", "0",
                             "--max-new-tokens", "12", stdin=CHAT[0]["content"] + "\nand then?\n/quit\n",
                             monkeypatch=monkeypatch)
    assert code == 0, err
    assert "· remote/local · remote · reads 256 tokens." in out.splitlines()[0]  # the served context length
    assert f"bot> {expected.text}" in out
    second = direct(engine, CHAT + [{"role": "assistant", "content": expected.text.strip()},
                                    {"role": "user", "content": "and then?"}], max_new_tokens=12, temperature=0)
    assert f"bot> {second.text}" in out


def test_key_refused_and_unset(capsys, monkeypatch, served):
    run_cli(capsys, "models", "add-remote", "local", "--url", served.url, "--api-key-env", "REMOTE_TEST_KEY")
    code, _, err = run_cli(capsys, "generate", "--model", "remote/local", "--prompt", "hi")
    assert code == 2 and "refused the API key (401" in err and "$REMOTE_TEST_KEY is not set" in err
    monkeypatch.setenv("REMOTE_TEST_KEY", "wrong")
    code, _, err = run_cli(capsys, "generate", "--model", "remote/local", "--prompt", "hi")
    assert code == 2 and "holds a key the server refused" in err and "wrong" not in err


def test_unknown_model_and_unreachable_host(capsys, monkeypatch, served):
    monkeypatch.setenv("REMOTE_TEST_KEY", "remote-key")
    run_cli(capsys, "models", "add-remote", "local", "--url", served.url, "--model", "nope",
            "--api-key-env", "REMOTE_TEST_KEY")
    code, _, err = run_cli(capsys, "generate", "--model", "remote/local", "--prompt", "hi")
    assert code == 2 and "has no model 'nope'" in err and "demo" in err
    sock = bind_socket("127.0.0.1", 0)  # a port nobody listens on
    port = sock.getsockname()[1]
    sock.close()
    run_cli(capsys, "models", "add-remote", "gone", "--url", f"http://127.0.0.1:{port}/v1")
    code, _, err = run_cli(capsys, "generate", "--model", "remote/gone", "--prompt", "hi")
    assert code == 2 and "cannot reach" in err and "is the server running" in err
    assert "Traceback" not in err


# -- a server that fails ---------------------------------------------------------------------
FAKE_MODELS = ["fail", "cut", "abort", "garbled", "strict"]


def failing_app(require_key: str | None = None, seen: list | None = None) -> Starlette:
    """A real HTTP server that fails like broken remotes do ("strict" refuses fields beyond OpenAI's)."""

    def denied(request) -> bool:
        return require_key is not None and request.headers.get("authorization") != f"Bearer {require_key}"

    async def models(request):
        if denied(request):
            return JSONResponse({"error": {"message": "Invalid API key"}}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": m, "object": "model"} for m in FAKE_MODELS]})

    def chunk(text: str) -> bytes:
        return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode() + b"\n\n"

    async def chat(request):
        body = await request.json()
        model = body["model"]
        if seen is not None:
            seen.append(body)
        if model == "strict":
            extra = [k for k in ("top_k", "min_p", "repetition_penalty") if k in body]
            if extra:
                return JSONResponse({"error": {"message": f"Unrecognized request argument supplied: {extra[0]}"}},
                                    status_code=400)

            async def fine():
                yield chunk("Hello")
                yield b"data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(fine(), media_type="text/event-stream")
        if model == "fail":
            return JSONResponse({"error": {"message": "CUDA out of memory", "type": "server_error"}}, status_code=500)

        async def cut():
            yield chunk("Once upon")
            yield chunk(" a time")
            await asyncio.sleep(0.05)
            if model == "abort":
                raise RuntimeError("worker died")  # the connection drops mid-body
            if model == "garbled":
                yield b"data: {not json\n\n"
            # "cut": the body ends cleanly but with no finish_reason and no [DONE]

        return StreamingResponse(cut(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.fixture(scope="module")
def failing_server():
    import uvicorn

    servers = []

    def start(app):
        sock = bind_socket("127.0.0.1", 0)
        server = uvicorn.Server(make_config(app, "127.0.0.1", sock.getsockname()[1]))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not server.started:
            thread.join(0.02)
        servers.append((server, thread))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


def test_500_401_and_cut_streams_get_clear_messages(capsys, failing_server):
    url = failing_server(failing_app())
    for m in FAKE_MODELS:
        run_cli(capsys, "models", "add-remote", m, "--url", url, "--model", m)
    code, _, err = run_cli(capsys, "generate", "--model", "remote/fail", "--prompt", "hi", "--chat")
    assert code == 2 and "the server failed (500: CUDA out of memory)" in err
    for model, words in (("cut", "closed before the answer ended"), ("abort", "connection broke midway"),
                         ("garbled", "broken event")):
        code, out, err = run_cli(capsys, "generate", "--model", f"remote/{model}", "--prompt", "hi", "--chat", "--json")
        assert code == 2 and words in err, (model, err)
        report = json.loads(out)  # the partial answer is kept
        assert report["text"] == "Once upon a time" and report["finish_reason"] == "interrupted"
        assert words in report["error"]

    denied_url = failing_server(failing_app(require_key="k"))
    run_cli(capsys, "models", "add-remote", "denied", "--url", denied_url, "--model", "cut")
    code, _, err = run_cli(capsys, "generate", "--model", "remote/denied", "--prompt", "hi")
    assert code == 2 and "refused the API key (401: Invalid API key)" in err and "no key is configured" in err


def test_cut_stream_in_the_terminal_chat_keeps_the_partial_answer(capsys, monkeypatch, failing_server):
    url = failing_server(failing_app())
    run_cli(capsys, "models", "add-remote", "abort", "--url", url, "--model", "abort")
    code, out, _ = run_cli(capsys, "chat", "--model", "remote/abort", stdin="hello\n/quit\n", monkeypatch=monkeypatch)
    assert code == 0
    assert "bot> Once upon a time [interrupted: remote/abort: the connection broke midway" in out


def test_key_comes_from_env_and_is_never_stored(capsys, monkeypatch, served, tmp_path):
    from models_registry.remotes import api_key_for, get_remote

    run_cli(capsys, "models", "add-remote", "local", "--url", served.url, "--api-key-env", "REMOTE_TEST_KEY")
    monkeypatch.setenv("REMOTE_TEST_KEY", "remote-key")
    assert api_key_for(get_remote("remote/local")) == "remote-key"
    code, out, err = run_cli(capsys, "generate", "--model", "remote/local", "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 0
    for path in (tmp_path / "cfg").rglob("*"):
        if path.is_file():
            assert b"remote-key" not in path.read_bytes()
    assert "remote-key" not in out + err


def test_a_server_that_refuses_extensions_gets_openai_fields_only(capsys, failing_server):
    seen: list[dict] = []
    url = failing_server(failing_app(seen=seen))
    run_cli(capsys, "models", "add-remote", "strict", "--url", url, "--model", "strict")
    code, out, err = run_cli(capsys, "generate", "--model", "remote/strict", "--prompt", "hi", "--chat", "--json",
                             "--top-k", "40", "--temperature", "0.5")
    assert code == 0, err
    assert json.loads(out)["text"] == "Hello" and json.loads(out)["finish_reason"] == "stop"
    assert [("top_k" in b) for b in seen] == [True, False]


def test_an_answer_asks_for_no_more_tokens_than_the_servers_context(capsys, failing_server):
    """vLLM answers max_tokens > max_model_len with a 400 ("max_tokens=512 cannot be greater
    than max_model_len=256"), seen through `vllm serve` with the chat's default 512 tokens."""
    seen: list[dict] = []

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "short", "object": "model", "max_model_len": 256}]})

    async def chat(request):
        body = await request.json()
        seen.append(body)
        if body["max_tokens"] > 256:
            return JSONResponse({"error": {"message": f"max_tokens={body['max_tokens']} cannot be greater than "
                                                      "max_model_len=256."}}, status_code=400)

        async def fine():
            yield b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "Hello"},
                                                       "finish_reason": "stop"}]}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(fine(), media_type="text/event-stream")

    url = failing_server(Starlette(routes=[Route("/v1/models", models),
                                           Route("/v1/chat/completions", chat, methods=["POST"])]))
    run_cli(capsys, "models", "add-remote", "short", "--url", url)
    code, out, err = run_cli(capsys, "generate", "--model", "remote/short", "--prompt", "hi", "--chat", "--json",
                             "--max-new-tokens", "512")
    assert code == 0, err
    assert json.loads(out)["text"] == "Hello" and [b["max_tokens"] for b in seen] == [256]
