"""Drive the real Thermocline window and save screenshots (run by tools/screenshots.sh).

Uses fresh data and config folders so the user's own conversations never appear, starts
the app the way `thermocline` does, then: welcome dialog, a prompt streaming, the finished
answer, the budgets panel after a slider move, the models page, the chat at 800x600 (with
the conversation list, then with the panel), the preferences, and the chat in the dark
theme. Each shot is the whole X screen (dialogs included).

    python tools/screenshot_driver.py OUT_DIR [--model demo|PATH] [--size 1280x800]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def pick_model(requested: str, scratch: Path) -> str:
    """`demo` when it is built, else a tiny random model made the way the tests make one."""
    if requested != "demo":
        return requested
    from models_registry.resolve import demo_model_dir

    if (demo_model_dir() / "config.json").is_file():
        return "demo"
    print("demo model not built yet: using a tiny random model (its text is gibberish)", file=sys.stderr)
    sys.path.insert(0, str(ROOT / "tests"))
    import model_factory

    import json

    import torch

    from engine.loading.predictors import PredictorSet

    folder = model_factory.llama_relu(scratch / "tiny-relu-llama", hidden=128, layers=8, ff=512)
    cfg = json.loads((folder / "config.json").read_text())
    g = torch.Generator().manual_seed(0)
    n, d, n_ff = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]
    # Random predictors, so hybrid mode (and the placement panel) works on this stand-in.
    PredictorSet([torch.randn(16, d, generator=g) for _ in range(n)],
                 [torch.randn(n_ff, 16, generator=g) for _ in range(n)], [0.0] * n).save(folder)
    return str(folder)


def download_shot(window, model: str, pump, shot) -> None:
    """A real download in progress, served over HTTP by the tests' local Hub stand-in (no
    network); the download is cancelled and its files deleted with the scratch folder."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from hub_server import HubRepo, HubServer
    except ImportError:
        print("tests/hub_server.py not found: no download screenshot", file=sys.stderr)
        return
    from models_registry.resolve import resolve_model

    folder = resolve_model(model)
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    repo = "local-hub/tiny-relu-llama"
    server = HubServer().start()
    try:
        os.environ["HF_ENDPOINT"] = server.url
        server.add_repo(HubRepo(repo, files))
        # A large second shard (zeros) keeps the transfer going long enough to be seen.
        files["model-extra.safetensors"] = bytes(400 * 1024**2)
        server.add_repo(HubRepo(repo, files))
        window.models._add_repo_id(repo)
        if not pump(180, lambda: repo in window.models.cards and window.models.cards[repo].total_bar.value() >= 150
                    and "model-extra" in window.models.cards[repo].progress_label.text()):
            # a busy machine: the other shots still come
            print("the download did not get under way in time: no download screenshot", file=sys.stderr)
            job = window.models.jobs.get(repo)
            if job is not None:
                job.cancel()
                pump(10, lambda: repo not in window.models.jobs)
            return
        card = window.models.cards[repo]
        window.models.list_widget.parentWidget().parentWidget().ensureWidgetVisible(card)
        shot("models-download")
        card.cancel_button.click()
        pump(10, lambda: repo not in window.models.jobs)
    finally:
        server.stop()


def hub_search_shot(window, pump, shot) -> None:
    """The Models page's Hub search over the tests' local Hub stand-in: a ReLU model with
    predictors, one without, a SwiGLU one (runs dense) and a BERT (left out)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from hub_server import HubRepo, HubServer, tiny_model_files
    except ImportError:
        print("tests/hub_server.py not found: no Hub search screenshot", file=sys.stderr)
        return
    import json

    server = HubServer().start()
    try:
        os.environ["HF_ENDPOINT"] = server.url
        with_predictors = tiny_model_files(seed=1)
        with_predictors["model_0.pt"] = b"predictor"
        server.add_repo(HubRepo("SparseLLM/ReluLLaMA-tiny", with_predictors, downloads=900))
        server.add_repo(HubRepo("someone/relu-llama-tiny-sft", tiny_model_files(seed=2), downloads=300))
        server.add_repo(HubRepo("someone/llama-tiny-swiglu", tiny_model_files(seed=3, hidden_act="silu"), downloads=120))
        server.add_repo(HubRepo("someone/bert-tiny", {"config.json": json.dumps(
            {"architectures": ["BertModel"], "model_type": "bert"}).encode()}, downloads=5000))
        search = window.models.hub_search
        search.box.setText("tiny")
        search.search()
        pump(60, lambda: bool(search.results) or "No model" in search.status.text())
        window.models.scroll.verticalScrollBar().setValue(0)
        shot("models-hub-search")
        search.clear_results()
        search.status.hide()
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--size", default="1280x800")
    ap.add_argument("--small", default="800x600")
    ap.add_argument("--mode", default="hybrid")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="thermocline-shots-"))
    os.environ["THERMOCLINE_DATA_DIR"] = str(scratch / "data")
    os.environ["THERMOCLINE_CONFIG_DIR"] = str(scratch / "config")
    os.environ["THERMOCLINE_MODELS_DIR"] = str(scratch / "models")  # the user's downloads stay out of it
    model = pick_model(args.model, scratch)

    from PySide6.QtCore import QCoreApplication, Qt
    from PySide6.QtGui import QGuiApplication
    from PySide6.QtTest import QTest

    from app.gui.main import build_window, make_application, preload_engine
    from app.settings import Settings

    app = make_application(["thermocline"])  # noqa: F841 - kept alive while the window runs
    preload_engine()
    settings = Settings()
    settings["model.active"] = model
    settings["engine.mode"] = args.mode
    settings["chat.max_new_tokens"] = 48
    settings["chat.temperature"] = 0.7
    settings["ui.theme"] = "light"
    window = build_window(settings=settings)
    w, h = map(int, args.size.split("x"))
    window.resize(w, h)
    window.move(0, 0)
    window.show()
    window.start()

    def pump(seconds: float, until=None) -> bool:
        end = time.time() + seconds
        while time.time() < end:
            QCoreApplication.processEvents()
            if until is not None and until():
                return True
            time.sleep(0.01)
        return until is None

    def shot(name: str) -> None:
        pump(0.4)
        path = args.out / f"{name}.png"
        screen = QGuiApplication.primaryScreen()
        screen.grabWindow(0).copy(0, 0, window.width(), window.height()).save(str(path))
        print(f"saved {path}")

    pump(60, lambda: window.client.model_info is not None or window.client.loading_model is None)
    pump(2, lambda: getattr(window, "welcome", None) is not None)
    if getattr(window, "welcome", None) is not None:  # its recommendation, once the Models page has looked
        pump(60, lambda: "For this machine" in window.welcome.recommendation.text())
    shot("welcome")
    if getattr(window, "welcome", None) is not None:
        window.welcome.accept()
    pump(60, lambda: window.client.model_info is not None)
    pump(20, lambda: window.panel.machine is not None)

    edit = window.chat.input.edit

    def ask(text: str) -> None:
        edit.setFocus()
        edit.setPlainText(text)
        QTest.keyClick(edit, Qt.Key.Key_Return)

    ask("Tell me about the ball at Netherfield, and who danced with whom.")
    pump(180, lambda: not window.chat.busy)
    ask("My notes so far:\n```python\nsuitors = {\"Darcy\": \"proud, or only shy?\",  # first ball\n"
        "           \"Bingley\": \"all ease\"}\n```\nWhat would Elizabeth say of them?")
    pump(60, lambda: len(window.chat.session.answer_text) > 60 or not window.chat.busy)
    shot("chat-streaming")
    pump(180, lambda: not window.chat.busy)
    shot("chat")

    panel = window.panel
    if panel.vram.slider.isEnabled():
        panel.vram.slider.setValue(panel.vram.slider.maximum() // 3)
    panel.ram.slider.setValue(max(1, panel.ram.slider.maximum() // 4))
    pump(3)
    shot("budgets")

    window.show_page("models")
    pump(30, lambda: len(window.models.cards) > 3 and not window.models._pending_rows)
    shot("models")
    hub_search_shot(window, pump, shot)
    download_shot(window, model, pump, shot)

    window.show_page("chat")
    window.resize(w, h)
    settings["ui.theme"] = "dark"
    pump(1)
    shot("chat-dark")
    settings["ui.theme"] = "light"
    sw, sh = map(int, args.small.split("x"))
    window.resize(sw, sh)
    pump(1)
    shot("chat-small")
    window.panel_button.click()  # at 800x600 the panel takes the sidebar's place
    pump(1)
    shot("chat-small-panel")
    settings["ui.theme"] = "dark"
    pump(1)
    shot("chat-small-dark")
    window.show_page("models")
    pump(1)
    shot("models-small-dark")
    window.show_page("chat")
    settings["ui.theme"] = "light"
    window.resize(w, h)
    prefs = window.show_preferences()
    prefs.move(window.x() + 200, window.y() + 80)
    pump(1)
    shot("preferences")
    prefs.reject()
    window.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
