"""`thermocline serve`: the real uvicorn on 127.0.0.1 (a free port), driven by the official `openai`
client and by raw HTTP, over the embedded demo model."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from app.server.runner import ServerThread

CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def direct(engine, prompt, **kw):
    """The same request straight to the engine: what the server must answer."""
    from engine import SamplingParams

    return engine.generate(prompt, SamplingParams(**kw))


def wait_idle(server, timeout=30.0):
    deadline = time.monotonic() + timeout
    while server.state.gate.outstanding and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.state.gate.outstanding == 0


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert client.models.retrieve("demo").id == "demo"
    health = httpx.get(server.url.removesuffix("/v1") + "/health").json()
    assert health["status"] == "ok" and health["model"] == "demo" and health["loaded"] is True


def test_chat_matches_the_engine_and_reports_usage(client, engine):
    resp = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=12, temperature=0)
    expected = direct(engine, CHAT, max_new_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens == len(engine.encode_prompt(CHAT))
    assert resp.usage.completion_tokens == expected.stats.new_tokens
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    ours = resp.model_extra["thermocline"]
    assert ours["mode"] == "dense" and ours["ttft_s"] > 0
    for key in ("decode_tok_s", "ffn_active_fraction", "hot_hit_fraction", "prefill_tok_s"):
        assert key in ours


def test_chat_stream_with_usage(client, engine):
    stream = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    expected = direct(engine, CHAT, max_new_tokens=12, temperature=0)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == expected.stats.new_tokens
    assert "decode_tok_s" in last.model_extra["thermocline"]
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_stream_is_sse_ending_in_done(server):
    body = {"model": "demo", "messages": CHAT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_completions_whole_and_streamed(client, engine):
    prompt = "Once upon a time"
    resp = client.completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0)
    expected = direct(engine, prompt, max_new_tokens=10, temperature=0)
    assert resp.choices[0].text == expected.text
    assert resp.usage.prompt_tokens == len(engine.encode_prompt(prompt))
    streamed = client.completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text
    default = client.completions.create(model="demo", prompt=prompt, temperature=0)
    assert default.usage.completion_tokens <= 16  # OpenAI's default length for completions


def test_stop_strings(client, engine):
    full = direct(engine, CHAT, max_new_tokens=40, temperature=0).text
    assert len(full) > 8, full
    stop = full[4:7]
    cut = full[:full.index(stop)]
    resp = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=40, temperature=0, stop=[stop])
    assert resp.choices[0].message.content == cut
    assert resp.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=40, temperature=0,
                                              stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut


def test_seed_reproducibility(client):
    def sample(seed):
        return client.chat.completions.create(model="demo", messages=CHAT, max_tokens=24, temperature=1.0,
                                              top_p=0.95, seed=seed).choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert len({sample(s) for s in (1, 2, 3, 4)} | {first}) > 1  # the seed, not a fixed path, picks tokens


def test_bad_requests_get_openai_errors(client, server):
    url = server.url + "/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, json=["a", "list"])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=CHAT, temperature="hot")
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=CHAT, max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=CHAT, n=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt=["two", "prompts"])
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert err.value.body["code"] == "model_not_found"
    r = httpx.get(server.url + "/nowhere")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_prompt_beyond_context_is_400(client, engine):
    long = [{"role": "user", "content": "cat " * (engine.ctx * 2)}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=long, max_tokens=4)
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):  # streamed too: the error comes before the stream
        client.chat.completions.create(model="demo", messages=long, max_tokens=4, stream=True)
    # And the server is fine afterwards.
    assert client.chat.completions.create(model="demo", messages=CHAT, max_tokens=2).choices


def _stream_text(client, prompt, out, key):
    try:
        stream = client.completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0, stream=True)
        out[key] = "".join(c.choices[0].text for c in stream if c.choices)
    except openai.RateLimitError as exc:
        out[key] = exc


def _concurrent(server, client, engine, prompts):
    """Fire one streamed request per prompt while the engine is held, so they all overlap."""
    out: dict = {}
    threads = [threading.Thread(target=_stream_text, args=(client, p, out, i)) for i, p in enumerate(prompts)]
    with engine._lock:  # the first request waits for the engine; the others queue behind it or are refused
        for t in threads:
            t.start()
        # Nothing can finish while the engine is held: every request is either queued or refused.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            refused = sum(isinstance(v, Exception) for v in out.values())
            if server.state.gate.outstanding + refused >= len(prompts):
                break
            time.sleep(0.01)
    for t in threads:
        t.join(120)
    return out


PROMPTS = [f"Story {i}: the {w} went" for i, w in enumerate(
    "cat dog bird fish fox owl bee ant cow pig hen elk yak emu bat rat".split())]


def test_16_concurrent_streams_all_complete_unmixed(server, client, engine):
    expected = [direct(engine, p, max_new_tokens=10, temperature=0).text for p in PROMPTS]
    out = _concurrent(server, client, engine, PROMPTS)
    assert [out[i] for i in range(16)] == expected
    wait_idle(server)


def test_over_the_queue_bound_is_429_and_the_rest_complete(engine):
    # one generation at a time: 1 runs, 3 wait, 12 are refused
    srv = ServerThread(lambda: engine, lambda: "demo", port=0, max_waiting=3, max_batch=1).start()
    try:
        client = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, timeout=60)
        expected = [direct(engine, p, max_new_tokens=10, temperature=0).text for p in PROMPTS]
        out = _concurrent(srv, client, engine, PROMPTS)
        refused = [i for i, v in out.items() if isinstance(v, openai.RateLimitError)]
        done = [i for i, v in out.items() if isinstance(v, str)]
        assert len(refused) == 12 and len(done) == 4 and len(out) == 16
        assert all(out[i] == expected[i] for i in done)
        assert out[refused[0]].body["code"] == "rate_limit_exceeded"
    finally:
        srv.stop()


def test_disconnect_cancels_the_generation(server, engine, monkeypatch):
    monkeypatch.setattr(engine, "eos_ids", set())  # no early end: only the disconnect can stop it
    body = {"model": "demo", "messages": CHAT, "max_tokens": engine.ctx, "stream": True}
    got = 0
    with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 3:
                break  # hang up after three chunks
    wait_idle(server)
    stats = engine.last_stats
    assert stats.finish_reason == "cancelled", stats
    assert stats.new_tokens < engine.ctx - stats.prompt_tokens - 1


def test_disconnect_cancels_a_whole_answer_too(server, engine, monkeypatch):
    monkeypatch.setattr(engine, "eos_ids", set())
    body = {"model": "demo", "messages": CHAT, "max_tokens": engine.ctx}
    with engine._lock:  # the request waits for the engine; its client gives up meanwhile
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
        time.sleep(1.0)  # the server hears the hang-up
    wait_idle(server)
    assert engine.last_stats.finish_reason == "cancelled" and engine.last_stats.new_tokens <= 1


def test_a_request_dropped_while_queued_never_runs(server, engine, monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(server.state, "on_request", lines.append)
    first: dict = {}
    with engine._lock:  # A waits for the engine, B queues behind A
        a = threading.Thread(target=_stream_text, args=(openai.OpenAI(base_url=server.url, api_key="x",
                                                                      max_retries=0), "first", first, 0))
        a.start()
        while server.state.gate.outstanding < 1:
            time.sleep(0.01)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/completions", json={"model": "demo", "prompt": "second", "max_tokens": 50},
                       timeout=httpx.Timeout(60, read=0.5))
        time.sleep(1.0)
    a.join(60)
    wait_idle(server)
    assert isinstance(first[0], str)
    deadline = time.monotonic() + 30  # a log line is written when its ASGI call returns, after the body
    while not any(" 499 " in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(" 499 " in line for line in lines), lines  # B was dropped, A answered
    assert engine.last_stats.prompt_tokens == len(engine.encode_prompt("first"))


def test_the_serve_command_serves_until_interrupted(tmp_path):
    import os
    import signal

    # As from a terminal: a suite started as a background job inherits SIGINT ignored, and
    # uvicorn re-raises the Ctrl-C it caught under the disposition it found (exit 0, not 130).
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--model", "demo", "--port", "0"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "THERMOCLINE_API_KEY": ""},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stderr.readline()
        assert line.startswith("serving demo (dense mode, context 256) at http://127.0.0.1:"), line
        url = line.split(" at ")[1].split()[0]
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        resp = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=3)
        assert resp.usage.completion_tokens <= 3
        log = proc.stderr.readline()  # one line per request, with its status and tokens
        assert "POST /v1/chat/completions 200" in log and "tokens" in log
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130  # Ctrl-C: a clean shutdown, the shell's code for an interrupt
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_socket_takes_connections_before_the_server_runs():
    """`serve` prints its address once the socket is bound, before uvicorn runs: a client
    that connects at once waits in the backlog instead of being refused."""
    import socket

    from app.server.runner import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    try:
        socket.create_connection(sock.getsockname(), timeout=5).close()
    finally:
        sock.close()


def test_api_key_required_when_set(engine):
    srv = ServerThread(lambda: engine, lambda: "demo", port=0, api_key="s3cret").start()
    lines: list[str] = []
    srv.app.state.on_request = lines.append
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url, api_key="wrong", max_retries=0).models.list()
        assert httpx.get(srv.url.removesuffix("/v1") + "/health").status_code == 401
        ok = openai.OpenAI(base_url=srv.url, api_key="s3cret", max_retries=0)
        assert ok.chat.completions.create(model="demo", messages=CHAT, max_tokens=2).choices
    finally:
        srv.stop()
    assert len(lines) == 3 and all("s3cret" not in line for line in lines)
    assert " 401 " in lines[0] and " 200 " in lines[2] and "tokens" in lines[2]


def test_non_loopback_needs_a_key():
    from engine.errors import UserError

    from app.server.runner import check_bind

    with pytest.raises(UserError):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "key")
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    r = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--model", "demo", "--host", "0.0.0.0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and "--api-key" in r.stderr and "Traceback" not in r.stderr
