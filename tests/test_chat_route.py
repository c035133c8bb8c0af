"""One route for a chat: the window (its worker thread), the CLI and the server count a
conversation with the same function (`Engine.fit` / `Engine.count_chat`, over `Engine.chat_ids`,
which `stream` feeds), so they agree to the token. The tiny Llama's tokenizer adds BOS as a
special token and its chat template writes BOS too: a count that encoded the rendered chat with
special tokens (the window's count before) reads one BOS more than the model is fed."""

from __future__ import annotations

import json

import openai
import pytest

from app.cli import main as cli_main
from app.server.runner import ServerThread

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is a thermocline?"},
    {"role": "assistant", "content": "A layer of water whose temperature changes fast with depth."},
    {"role": "user", "content": "And in the air?"},
]
ONE_TURN = [{"role": "user", "content": "What is a thermocline?"}]


@pytest.fixture
def client(qtbot, llama_dir):
    from app.gui.worker import EngineClient

    c = EngineClient()
    c.load(str(llama_dir), mode="dense", ctx=256, vram_budget=None, ram_budget=None, cpu_weights="fp32")
    qtbot.waitUntil(lambda: c.model_info is not None, timeout=120_000)
    yield c
    c.shutdown(30_000)


@pytest.fixture
def server(client):
    srv = ServerThread(lambda: client.engine, lambda: "tiny", port=0, max_waiting=4).start()
    yield openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    srv.stop()


def _window_count(qtbot, client, messages) -> int:
    with qtbot.waitSignal(client.context_report, timeout=60_000) as got:
        client.count_tokens(-1, messages, {"context_policy": "truncate", "max_new_tokens": 1})
    tag, report = got.args
    assert tag == -1 and report["dropped"] == 0 and report["fits"]
    return report["tokens"]


def _server_count(server, messages) -> int:
    reply = server.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0)
    return reply.usage.prompt_tokens


def _cli_count(capsys, llama_dir, text: str) -> int:
    capsys.readouterr()
    code = cli_main(["generate", "--model", str(llama_dir), "--prompt", text, "--chat", "--json", "--mode", "dense",
                     "--max-new-tokens", "1", "--temperature", "0"])
    assert code == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["prompt_tokens"]


def test_window_cli_and_server_count_a_conversation_alike(qtbot, client, server, capsys, llama_dir):
    engine = client.engine
    tok = engine.tokenizer
    for messages in (CONVERSATION, ONE_TURN):
        fed = len(engine.encode_prompt(messages))  # what stream() feeds the model
        with_specials = len(tok.encode(tok.render_chat(messages)))
        assert with_specials == fed + 1  # the extra BOS a count with special tokens reads
        window = _window_count(qtbot, client, messages)
        terminal = engine.fit(messages, "truncate", 1).tokens  # the terminal chat's count, per turn
        assert window == terminal == engine.count_chat(messages) == _server_count(server, messages) == fed
    assert _cli_count(capsys, llama_dir, ONE_TURN[0]["content"]) == len(engine.encode_prompt(ONE_TURN))


def test_the_same_policy_trims_the_window_and_the_terminal_chat_alike(qtbot, client):
    """A conversation longer than the window: the worker's report and Engine.fit drop the same
    oldest messages and count the same tokens (one function, one policy)."""
    engine = client.engine
    long = [CONVERSATION[0]] + [{"role": r, "content": "word " * 25} for r in ("user", "assistant") * 6]
    long.append({"role": "user", "content": "And now?"})
    want = engine.fit(long, "truncate", 32)
    assert want.dropped > 0 and want.fits
    with qtbot.waitSignal(client.context_report, timeout=60_000) as got:
        client.count_tokens(-1, long, {"context_policy": "truncate", "max_new_tokens": 32})
    report = got.args[1]
    assert (report["tokens"], report["dropped"], report["fits"]) == (want.tokens, want.dropped, want.fits)
