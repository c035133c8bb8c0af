"""The chat's answer state machine without widgets: a real EngineClient (worker thread, tiny
real model), real SQLite, and ChatSession between them; no window is built."""

import pytest

from app.gui.chat_session import AnswerStats, ChatSession
from app.storage import COMPLETE, FAILED, STREAMING, Storage
from engine.runtime.chat_request import ChatRequest

PARAMS = {"sampling": {"temperature": 0.0, "max_new_tokens": 12}, "context_policy": "truncate"}


@pytest.fixture
def client(qtbot):
    from app.gui.worker import EngineClient

    c = EngineClient()
    yield c
    c.shutdown(30_000)


@pytest.fixture
def storage(tmp_path):
    s = Storage(tmp_path / "chat.db")
    yield s
    s.close()


def loaded(qtbot, client, model_dir):
    client.load(str(model_dir), mode="dense", ctx=256, vram_budget=None, ram_budget=None, cpu_weights="fp32")
    qtbot.waitUntil(lambda: client.model_info is not None, timeout=120_000)
    return client


def record(session):
    seen = {"text": [], "ended": [], "dropped": [], "failed": [], "busy": []}
    session.text_changed.connect(lambda _id, text: seen["text"].append(text))
    session.ended.connect(lambda *args: seen["ended"].append(args))
    session.dropped.connect(lambda *args: seen["dropped"].append(args))
    session.failed.connect(lambda *args: seen["failed"].append(args))
    session.busy_changed.connect(seen["busy"].append)
    return seen


def ask(session, storage, text="the fox"):
    conv = storage.create_conversation("t")
    storage.add_message(conv.id, "user", text)
    return conv


def test_an_answer_streams_to_disk_and_ends_complete_with_typed_stats(qtbot, client, storage, llama_dir):
    loaded(qtbot, client, llama_dir)
    session = ChatSession(storage, client)
    seen = record(session)
    conv = ask(session, storage)
    session.start(conv.id, ChatRequest([{"role": "user", "content": "the fox"}], **PARAMS))
    answer_id = session.answer_id
    assert session.busy and storage.message(answer_id).status == STREAMING
    qtbot.waitUntil(lambda: not session.busy, timeout=60_000)
    (ended_id, status, stats), = seen["ended"]
    saved = storage.message(ended_id)
    assert ended_id == answer_id and status == COMPLETE and saved.status == COMPLETE
    assert saved.content and seen["text"][-1] == saved.content  # what was shown is what is on disk
    assert isinstance(stats, AnswerStats) and stats.new_tokens == saved.stats["new_tokens"] > 0
    assert stats.finish_reason in ("stop", "length") and stats.device == "cpu"
    assert seen["busy"] == [True, False] and not seen["dropped"] and not seen["failed"]


def test_stopped_before_any_text_leaves_no_empty_answer_and_restores_the_replaced_version(
        qtbot, client, storage, llama_dir):
    loaded(qtbot, client, llama_dir)
    session = ChatSession(storage, client)
    seen = record(session)
    conv = ask(session, storage)
    earlier = [{"content": "the first answer", "status": COMPLETE, "stats": {"new_tokens": 3}}]
    session.start(conv.id, ChatRequest([{"role": "user", "content": "the fox"}], **PARAMS), earlier)
    assert session.stop() and not session.stop()  # the second press only repeats the request
    qtbot.waitUntil(lambda: not session.busy, timeout=60_000)
    (conv_id, stats), = seen["dropped"]
    assert conv_id == conv.id and stats.finish_reason == "cancelled" and not seen["ended"]
    answers = [m for m in storage.messages(conv.id) if m.role == "assistant"]
    assert [(m.content, m.status, m.stats) for m in answers] == [("the first answer", COMPLETE, {"new_tokens": 3})]


def test_no_model_fails_without_keeping_an_empty_answer(qtbot, client, storage):
    session = ChatSession(storage, client)
    seen = record(session)
    conv = ask(session, storage)
    session.start(conv.id, ChatRequest([{"role": "user", "content": "hi"}], **PARAMS))
    qtbot.waitUntil(lambda: not session.busy, timeout=30_000)
    assert seen["dropped"] == [(conv.id, None)] and seen["failed"][0][0] == "No model is loaded."
    assert [m.role for m in storage.messages(conv.id)] == ["user"]


def test_a_failure_after_text_keeps_the_text_marked_failed(qtbot, client, storage):
    session = ChatSession(storage, client)
    seen = record(session)
    conv = ask(session, storage)
    session.start(conv.id, ChatRequest([{"role": "user", "content": "hi"}], **PARAMS))
    client.token.emit(session.request, "partial")  # a token relayed before the failure arrives
    qtbot.waitUntil(lambda: not session.busy, timeout=30_000)
    (answer_id, status, _stats), = seen["ended"]
    assert status == FAILED and storage.message(answer_id).content == "partial"
    assert storage.message(answer_id).status == FAILED and seen["failed"]


def test_answer_stats_read_live_and_final_names_once():
    live = AnswerStats.from_dict({"new_tokens": 3, "mem_device": "cuda:0", "mem_vram_bytes": 0, "vram_bytes": 9,
                                  "hot_hit_fraction": 0.0, "ttft_s": None})
    assert (live.device, live.vram_bytes, live.hot_hit_fraction, live.ttft_s, live.on_gpu) == ("cuda:0", 0, 0.0,
                                                                                            None, True)
    final = AnswerStats.from_dict({"device": "cpu", "ram_bytes": 5, "finish_reason": "length"})
    assert (final.device, final.ram_bytes, final.vram_bytes, final.finish_reason) == ("cpu", 5, None, "length")
    assert AnswerStats.from_dict(None).finish_reason == "stop" and AnswerStats.from_dict(None).raw == {}


PARKED_CHILD = r"""
import gc, os, threading, time
os.environ["QT_QPA_PLATFORM"] = "offscreen"
from PySide6.QtCore import QCoreApplication
from app import open_model
from app.gui import worker

entered, release = threading.Event(), threading.Event()

def slow_open(spec, **options):  # a model load, which cannot be cut short
    entered.set()
    release.wait(60)
    raise OSError("no model here")

open_model.open_engine = slow_open
app = QCoreApplication([])
client = worker.EngineClient()
client.load("a model", mode="dense", ctx=64, vram_budget=None, ram_budget=None)
assert entered.wait(30)
assert client.shutdown(timeout_ms=100) is False
del client
gc.collect()  # the client is gone while its thread still loads
release.set()
for _ in range(300):  # the thread ends once the load does; then the next sweep lets it go
    worker._sweep_parked()
    if not worker._PARKED:
        break
    time.sleep(0.1)
print("parked", len(worker._PARKED))
"""


def test_a_client_shut_down_mid_load_keeps_its_thread_until_it_ends():
    """A window closed while its model loads: the client goes, its engine thread runs on. Qt
    aborts the process where a running QThread is destroyed (a later test's window crashed
    that way when the collector freed such a client), so the thread is kept until it ends."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", PARKED_CHILD], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["parked", "0"]
