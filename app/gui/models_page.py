"""The model manager: the catalogue with sizes, licences and fit verdicts for this machine;
downloads with progress (per file and total, speed, ETA), pause, resume, cancel; delete, open
folder, add a Hugging Face repo or a local folder; and "Use" to make a model the active one.

The page never blocks: the catalogue scan (hardware probe, folder states, fit estimates)
runs in the thread pool, downloads on their own threads.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, QUrl, Signal, Slot
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QBoxLayout, QComboBox, QFileDialog, QFrame, QGridLayout, QHBoxLayout, QInputDialog, QLabel,
                               QMessageBox, QProgressBar, QPushButton, QScrollArea, QSizePolicy, QVBoxLayout,
                               QWidget)

from app.settings import Settings
from models_registry.listing import scan_models

from . import formatting as fmt
from .dialogs import show_error
from .downloads import DownloadJob
from .tasks import run_in_background
from .worker import EngineClient

log = logging.getLogger(__name__)


# -- widgets ------------------------------------------------------------------------------
FORMAT_WORDS = {"int4": "4-bit", "int8": "8-bit", "fp32": "exact (32-bit)"}


def format_choice_words(fmt_name: str, facts: dict) -> str:
    """`4-bit · 3.1 GiB · about 9 words a second`: what one CPU weight format costs and gives."""
    from models_registry.speed import speed_words

    parts = [FORMAT_WORDS.get(fmt_name, fmt_name)]
    if facts.get("memory"):
        parts.append(f"{fmt.size(facts['memory'])} in memory")
    if facts.get("words_s") is not None:
        parts.append(speed_words(facts["words_s"]).replace(" on this machine", ""))
    if facts.get("verdict", "").startswith("does not"):
        parts.append("does not fit")
    return " · ".join(parts)


class ModelCard(QFrame):
    """One model: facts, state, progress, and the buttons that apply to that state."""

    def __init__(self, page: "ModelsPage", info: dict):
        super().__init__(page.list_widget)
        self.page = page
        self.setObjectName("modelCard")
        self.info = info
        grid = QGridLayout(self)
        grid.setContentsMargins(14, 12, 14, 12)
        grid.setHorizontalSpacing(10)
        grid.setVerticalSpacing(4)
        self.title = QLabel(self)
        self.title.setObjectName("modelTitle")
        self.title.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        # A long title ("… · recommended first download · 1.2B") wraps rather than widening the
        # card past the pane, which would hide the state and buttons behind a sideways scroll.
        self.title.setWordWrap(True)
        self.verdict = QLabel(self)
        self.verdict.setObjectName("verdictChip")
        self.state = QLabel(self)
        self.state.setObjectName("modelState")
        self.chips = QHBoxLayout()
        self.chips.setContentsMargins(0, 0, 0, 0)
        self.chips.addWidget(self.verdict, 0, Qt.AlignmentFlag.AlignTop)  # a chip keeps its height by a wrapped title
        self.chips.addWidget(self.state, 0, Qt.AlignmentFlag.AlignTop)
        # Wide: title | chips on one row. Narrow (800x600 with the budgets panel open): the chips
        # go under the title, which then keeps the card's width instead of breaking a model's id.
        self.head = QBoxLayout(QBoxLayout.Direction.LeftToRight)
        self.head.addWidget(self.title, 1)
        self.head.addLayout(self.chips)
        grid.addLayout(self.head, 0, 0, 1, 2)
        self.facts = QLabel(self)
        self.facts.setObjectName("facts")
        self.facts.setWordWrap(True)
        grid.addWidget(self.facts, 1, 0, 1, 2)
        self.description = QLabel(self)
        self.description.setObjectName("hint")
        self.description.setWordWrap(True)
        grid.addWidget(self.description, 2, 0, 1, 2)
        # The CPU weight format of this model: the memory and speed of each, chosen per model.
        weights_row = QHBoxLayout()
        self.weights_label = QLabel("CPU weights", self)
        self.weights_label.setObjectName("facts")
        self.weights = QComboBox(self)
        self.weights.setObjectName("cpuWeights")
        self.weights.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.weights.setMinimumContentsLength(12)
        self.weights.setToolTip("How this model's weights are kept on the CPU: 4-bit is smallest and "
                                "fastest, exact is the reference. Changing it reloads the model if it is in use.")
        self.weights.activated.connect(self._weights_chosen)
        weights_row.addWidget(self.weights_label)
        weights_row.addWidget(self.weights, 1)
        grid.addLayout(weights_row, 6, 0, 1, 2)  # above the buttons
        # Progress: total and current file.
        self.total_bar = QProgressBar(self)
        self.total_bar.setObjectName("downloadTotal")
        self.total_bar.setRange(0, 1000)
        self.file_bar = QProgressBar(self)
        self.file_bar.setObjectName("downloadFile")
        self.file_bar.setRange(0, 1000)
        self.file_bar.setFixedHeight(6)
        self.file_bar.setTextVisible(False)
        self.progress_label = QLabel(self)
        self.progress_label.setObjectName("facts")
        grid.addWidget(self.total_bar, 3, 0, 1, 2)
        grid.addWidget(self.file_bar, 4, 0, 1, 2)
        grid.addWidget(self.progress_label, 5, 0, 1, 2)
        buttons = QHBoxLayout()
        buttons.setSpacing(6)
        self.use_button = self._button("Use", "Load this model (the conversation stays open)", self._use, "primary")
        self.download_button = self._button("Download", "Ask the Hub how much this model downloads, then download it",
                                            self._download)
        # Before a first download: the bytes the Hub lists for it (planned_disk), then a choice.
        self.confirm_button = self._button("Download", "Start the download", self._confirm, "primary")
        self.not_now_button = self._button("Not now", "Do not download it now", self._not_now)
        self.pause_button = self._button("Pause", "Pause the download", self._pause)
        self.cancel_button = self._button("Cancel", "Stop the download (finished files are kept)", self._cancel)
        self.folder_button = self._button("Open folder", "Show the model's files", self._open_folder)
        self.delete_button = self._button("Delete…", "Delete the downloaded files", self._delete)
        self.remove_button = self._button("Remove from list", "Forget this added model", self._remove)
        for b in (self.use_button, self.download_button, self.confirm_button, self.not_now_button,
                  self.pause_button, self.cancel_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        for b in (self.folder_button, self.delete_button, self.remove_button):
            buttons.addWidget(b)
        grid.addLayout(buttons, 7, 0, 1, 2)
        self.update_info(info)

    NARROW = 560  # px: below it the verdict and state chips take their own row

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        narrow = event.size().width() < self.NARROW
        direction = QBoxLayout.Direction.TopToBottom if narrow else QBoxLayout.Direction.LeftToRight
        if self.head.direction() != direction:
            self.head.setDirection(direction)
            self.head.setAlignment(self.chips, Qt.AlignmentFlag.AlignLeft if narrow else Qt.AlignmentFlag(0))
        super().resizeEvent(event)

    def _button(self, text: str, tip: str, slot, kind: str = "") -> QPushButton:
        b = QPushButton(text, self)
        b.setToolTip(tip)
        if kind:
            b.setProperty("kind", kind)
        b.clicked.connect(slot)
        return b

    @property
    def spec(self) -> str:
        return self.info["spec"]

    def update_info(self, info: dict) -> None:
        self.info = info
        params = f" · {info['params']}" if info.get("params") else ""
        self.title.setText(f"<b>{info['title']}</b>{params}")
        self.verdict.setText(info["verdict"])
        self.verdict.setToolTip(" · ".join(t for t in (info.get("reason", ""), info.get("speed", "")) if t))
        self.verdict.setProperty("kind", fmt.verdict_kind(info["verdict"]))
        self.verdict.style().unpolish(self.verdict)
        self.verdict.style().polish(self.verdict)
        facts = []
        if info.get("repo"):
            facts.append(f"<a href='https://huggingface.co/{info['repo']}'>{info['repo']}</a>")
        elif info.get("local"):
            facts.append(info["folder"])
        facts.append(f"size {fmt.size(info['size'])}" if info.get("size") else "size unknown")
        facts.append(f"licence: {info['license']}")
        if info.get("sparsity"):
            facts.append(f"{info['sparsity']:.0%} of neurons idle")
            self.facts.setToolTip("Neurons idle: the share of the model's feed-forward neurons that stay "
                                  "silent for a typical word, which is the work Thermocline skips.")
        if info.get("reason"):
            facts.append(info["reason"])
        if info.get("speed"):
            facts.append(info["speed"])
        self.facts.setText(" · ".join(facts))
        self.facts.setOpenExternalLinks(True)
        self.description.setText(info.get("description", ""))
        formats = info.get("formats") or {}
        self.weights.blockSignals(True)
        self.weights.clear()
        for name in ("int4", "int8", "fp32"):
            if name in formats:
                self.weights.addItem(format_choice_words(name, formats[name]), name)
        self.weights.setCurrentIndex(max(0, self.weights.findData(info.get("cpu_weights"))))
        self.weights.blockSignals(False)
        for w in (self.weights, self.weights_label):
            w.setVisible(bool(formats))
        self.sync()

    def sync(self) -> None:
        """Show the state and the buttons that make sense in it."""
        info = self.info
        job = self.page.jobs.get(self.spec)
        active = self.page.active_spec() == self.spec
        loading = self.page.client.loading_model == self.spec
        ready = info["status"] == "ready"
        downloading = job is not None
        plan = None if downloading else self.page.plans.get(self.spec)  # a planned first download
        if downloading:
            state = "Paused" if job.paused else "Downloading…"
        elif loading:
            state = "Loading…"
        elif active and self.page.client.model_info:
            state = "● In use"
        elif ready:
            state = "Ready"
        elif not info["downloadable"] and not info.get("local"):
            state = "Not built in this install"
        elif info["status"] == "partial":
            state = "Partly downloaded"
        else:
            state = "Not downloaded"
        self.state.setText(state)
        self.use_button.setVisible(ready and not active and not downloading)
        self.use_button.setEnabled(not loading)
        self.download_button.setVisible(info["downloadable"] and not ready and not downloading and plan is None)
        self.confirm_button.setVisible(plan is not None and plan.get("asking") is False)
        self.not_now_button.setVisible(plan is not None)
        if plan is not None:
            self.progress_label.setText(plan["text"])
            self.confirm_button.setText(f"Download {fmt.size(plan['bytes'])}" if plan.get("bytes")
                                        else "Download anyway")
        self.download_button.setText("Resume download" if info["status"] == "partial" else "Download")
        self.pause_button.setVisible(downloading)
        self.pause_button.setText("Resume" if downloading and job.paused else "Pause")
        self.cancel_button.setVisible(downloading)
        self.folder_button.setVisible(Path(info["folder"]).exists())
        self.delete_button.setVisible(info["downloadable"] and Path(info["folder"]).exists() and not downloading)
        self.remove_button.setVisible(info["custom"] and not downloading and not active)
        show_progress = downloading
        for w in (self.total_bar, self.file_bar):
            w.setVisible(show_progress)
        self.progress_label.setVisible(show_progress or plan is not None)

    def show_event(self, ev: dict) -> None:
        total, done = ev.get("total") or 0, ev.get("done") or 0
        if total:
            self.total_bar.setValue(int(done / total * 1000))
            self.total_bar.setFormat(f"{fmt.size(done)} of {fmt.size(total)}  ({done / total:.0%})")
        if ev.get("file_total"):
            self.file_bar.setValue(int((ev.get("file_done") or 0) / ev["file_total"] * 1000))
        parts = []
        if ev.get("filename"):
            parts.append(f"{ev['filename']}: {fmt.size(ev.get('file_done'))} of {fmt.size(ev.get('file_total'))}")
        if ev.get("speed_bps"):
            parts.append(f"{fmt.size(ev['speed_bps'])}/s")
        if ev.get("eta_s") is not None:
            parts.append(f"about {fmt.seconds(ev['eta_s'])} left")
        if ev.get("kind") in ("retry", "corrupt", "paused", "plan") and ev.get("message"):
            parts.append(ev["message"])
        self.progress_label.setText(" · ".join(parts))

    # -- actions -------------------------------------------------------------------------
    def _weights_chosen(self, index: int) -> None:
        self.page.choose_weights(self.spec, self.weights.itemData(index))

    def _use(self) -> None:
        self.page.activate_requested.emit(self.spec)

    def _download(self) -> None:
        if self.info["status"] == "partial":  # planned when it started: go on where it stopped
            self.page.start_download(self.spec)
        else:
            self.page.plan_download(self.spec)

    def _confirm(self) -> None:
        self.page.plans.pop(self.spec, None)
        self.page.start_download(self.spec)

    def _not_now(self) -> None:
        self.page.plans.pop(self.spec, None)
        self.sync()

    def _pause(self) -> None:
        job = self.page.jobs.get(self.spec)
        if job is not None:
            job.resume() if job.paused else job.pause()
            self.sync()

    def _cancel(self) -> None:
        job = self.page.jobs.get(self.spec)
        if job is not None:
            job.cancel()

    def _open_folder(self) -> None:
        QDesktopServices.openUrl(QUrl.fromLocalFile(self.info["folder"]))

    def _delete(self) -> None:
        self.page.delete_model(self.spec)

    def _remove(self) -> None:
        self.page.remove_custom(self.spec)


class ModelsPage(QWidget):
    activate_requested = Signal(str)
    reload_requested = Signal()  # the model in use changed its CPU weight format

    def __init__(self, settings: Settings, client: EngineClient, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("modelsPage")
        self.settings, self.client = settings, client
        self.jobs: dict[str, DownloadJob] = {}
        # spec -> {"asking": bool, "bytes": int | None, "text": str}: a first download being planned
        self.plans: dict[str, dict] = {}
        self.cards: dict[str, ModelCard] = {}
        self.recommended: str | None = None  # the chat model for this machine (listing.recommend)
        self.rows: dict[str, dict] = {}      # spec -> the last scan's row
        self._after_scan: list = []
        self._scanning = False
        self._rescan = False
        self._pending_rows: list = []
        # A child timer (not QTimer.singleShot) so a pending step dies with the page.
        self._build_timer = QTimer(self, singleShot=True, interval=0)
        self._build_timer.timeout.connect(self._build_next)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.setSpacing(0)
        header = QFrame(self)
        header.setObjectName("chatHeader")
        hl = QVBoxLayout(header)
        hl.setContentsMargins(16, 10, 16, 10)
        top = QHBoxLayout()
        title = QLabel("Models", header)
        title.setObjectName("chatTitle")
        top.addWidget(title)
        top.addStretch(1)
        # Two rows: the title with the folder button, then the ways to add a model; in one row
        # the page no longer fitted an 800 px window beside the conversation list.
        self.add_repo_button = QPushButton("Hub repo…", header)
        self.add_repo_button.setToolTip("Download a model from Hugging Face by its org/name id")
        self.add_repo_button.clicked.connect(self.add_repo)
        self.add_folder_button = QPushButton("Folder…", header)
        self.add_folder_button.setToolTip("Use a model folder already on this computer")
        self.add_folder_button.clicked.connect(self.add_folder)
        self.add_file_button = QPushButton("GGUF file…", header)
        self.add_file_button.setToolTip("Import a GGUF file (llama.cpp's or PowerInfer's)")
        self.add_file_button.clicked.connect(self.add_file)
        self.open_dir_button = QPushButton("Models folder", header)
        self.open_dir_button.setToolTip("Open the folder where downloads are kept")
        self.open_dir_button.clicked.connect(self._open_models_dir)
        self.add_remote_button = QPushButton("Remote…", header)
        self.add_remote_button.setToolTip("Use a model served by another machine (vLLM, llama.cpp, Ollama, "
                                          "Thermocline) over the OpenAI API")
        self.add_remote_button.clicked.connect(self.add_remote)
        top.addWidget(self.open_dir_button)
        hl.addLayout(top)
        adds = QHBoxLayout()
        # Short: "Add a model from:" held the page at 517 px, which at 800x600 squeezed the budgets
        # panel beside it until its Mode read "Hybrid (CPU" (wrapped, it took three lines).
        add_label = QLabel("Add from:", header)
        add_label.setToolTip("Add a model from the Hugging Face Hub, a folder, a GGUF file or another machine")
        adds.addWidget(add_label)
        for b in (self.add_repo_button, self.add_folder_button, self.add_file_button, self.add_remote_button):
            adds.addWidget(b)
        adds.addStretch(1)
        hl.addLayout(adds)
        self.machine_label = QLabel("Looking at this machine…", header)
        self.machine_label.setObjectName("hint")
        self.machine_label.setWordWrap(True)
        hl.addWidget(self.machine_label)
        outer.addWidget(header)
        self.scroll = scroll = QScrollArea(self)
        scroll.setObjectName("modelsScroll")
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)  # cards wrap to the pane
        self.list_widget = QWidget(scroll)
        self.list_widget.setObjectName("chatCanvas")
        self.list_layout = QVBoxLayout(self.list_widget)
        self.list_layout.setContentsMargins(16, 12, 16, 16)
        self.list_layout.setSpacing(10)
        from .hub_search_panel import HubSearch

        # The search and its matches scroll with the cards: at 800x600 a header that grew
        # with the results would leave no room for the list.
        self.hub_search = HubSearch(self)
        self.hub_search.setParent(self.list_widget)
        self.hub_search.download_requested.connect(self.get_from_hub)
        self.hub_search.catalogue_requested.connect(self.get_from_hub)
        self.list_layout.addWidget(self.hub_search)
        self.list_layout.addStretch(1)
        scroll.setWidget(self.list_widget)
        outer.addWidget(scroll, 1)
        self.list_widget.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        client.loaded.connect(self._on_model_event)
        client.load_failed.connect(self._on_model_event)
        client.loading.connect(self._on_model_event)

    def active_spec(self) -> str:
        return self.settings["model.active"]

    # -- scanning ------------------------------------------------------------------------
    def refresh(self) -> None:
        if self._scanning or self._pending_rows:
            self._rescan = True
            return
        self._scanning = True
        custom, ctx, active = list(self.settings["models.custom"]), self.settings["engine.ctx"], self.active_spec()
        weights, chosen = self.settings["engine.cpu_weights"], dict(self.settings["models.cpu_weights"] or {})
        run_in_background(lambda: scan_models(custom, ctx, active, weights, chosen), self._on_scan,
                          self._on_scan_failed, self)

    def _on_scan_failed(self, exc: BaseException) -> None:
        self._scanning = False
        self.machine_label.setText(f"Could not read the model catalogue: {exc}")

    def when_scanned(self, fn) -> None:
        """Call `fn()` once the next scan has come in (now, when one has and none is under way)."""
        if self.rows and not self._scanning:
            fn()
            return
        self._after_scan.append(fn)
        self.refresh()

    def _on_scan(self, result: dict) -> None:
        self._scanning = False
        self.machine_label.setText(result["machine"])
        self.recommended = result.get("recommended")
        self.rows = {r["spec"]: r for r in result["rows"]}
        waiting, self._after_scan = self._after_scan, []
        for fn in waiting:
            fn()
        specs = [r["spec"] for r in result["rows"]]
        for spec in list(self.cards):
            if spec not in specs:
                self.cards.pop(spec).deleteLater()
        self._pending_rows = list(enumerate(result["rows"]))
        self._build_next()

    def _build_next(self) -> None:
        """Create or update one card per event-loop turn, so a long list never stalls the window."""
        if not self._pending_rows:
            if self._rescan:
                self._rescan = False
                self.refresh()
            return
        i, info = self._pending_rows.pop(0)
        card = self.cards.get(info["spec"])
        if card is None:
            card = ModelCard(self, info)
            self.cards[info["spec"]] = card
        else:
            card.update_info(info)
        self.list_layout.insertWidget(i + 1, card)  # below the Hub search
        self._build_timer.start()

    def _on_model_event(self, *_args) -> None:
        for card in self.cards.values():
            card.sync()

    # -- downloads -----------------------------------------------------------------------
    def plan_download(self, spec: str) -> None:
        """Ask the Hub (off the GUI thread) how many bytes `spec` downloads, and show them on
        its card with a button that starts the download: nothing moves before the user sees
        what it costs on disk."""
        if spec in self.jobs or self.plans.get(spec, {}).get("asking"):
            return
        self.plans[spec] = {"asking": True, "bytes": None, "text": "Asking the Hub how much it downloads…"}
        self._sync_card(spec)

        def work() -> dict:
            from models_registry.paths import models_dir
            from models_registry.download import planned_disk
            from models_registry.hardware import free_disk

            plan = planned_disk(spec)  # disk_need: the download's own disk check (imports included)
            where, free = free_disk(models_dir())
            return {"bytes": plan["bytes"], "disk_need": plan["disk_need"], "where": str(where), "free": free}

        def done(result: dict) -> None:
            if spec not in self.plans:  # "Not now" while asking
                return
            free = result["free"]
            text = f"Downloads {fmt.size(result['bytes'])} into the models folder ({result['where']}"
            text += f", {fmt.size(free)} free)" if free is not None else ")"
            text += f" · needs {fmt.size(result['disk_need'])} free"  # imports and margin included
            if free is not None and free < result["disk_need"]:
                text += " · not enough free disk: free some space first"
            text += (f" · CPU weights: {FORMAT_WORDS.get(self.settings.cpu_weights_for(spec), '8-bit')} "
                     "(chosen below)")
            self.plans[spec] = {"asking": False, "bytes": result["bytes"], "text": text}
            self._sync_card(spec)

        def failed(exc: BaseException) -> None:
            if spec not in self.plans:
                return
            from .downloads import download_error_words

            what, _todo = download_error_words(spec, exc)
            self.plans[spec] = {"asking": False, "bytes": None,
                                "text": f"The download size is not known: {what.rstrip('.')}. You can try anyway."}
            self._sync_card(spec)

        run_in_background(work, done, failed, self)

    def _sync_card(self, spec: str) -> None:
        card = self.cards.get(spec)
        if card is not None:
            card.sync()

    def start_download(self, spec: str) -> None:
        if spec in self.jobs:
            return
        job = DownloadJob(spec, self)
        job.event.connect(self._on_event)
        job.done.connect(self._job_done)
        job.cancelled.connect(self._job_ended)
        job.failed.connect(self._job_failed)
        self.jobs[spec] = job
        job.start()
        if spec in self.cards:
            self.cards[spec].sync()
            self.cards[spec].progress_label.setText("Asking the Hub for the file list…")

    @Slot(str, dict)
    def _on_event(self, spec: str, ev: dict) -> None:
        job = self.jobs.get(spec)
        if job is not None:
            job.last_event = ev
        card = self.cards.get(spec)
        if card is not None:
            card.show_event(ev)
            if ev.get("kind") in ("paused", "resumed"):
                card.sync()

    @Slot(str, dict)
    def _job_done(self, spec: str, _result: dict) -> None:
        self._job_ended(spec)

    @Slot(str)
    def _job_ended(self, spec: str) -> None:
        self.jobs.pop(spec, None)
        self.refresh()

    @Slot(str, str, str)
    def _job_failed(self, spec: str, what: str, todo: str) -> None:
        self.jobs.pop(spec, None)
        self.refresh()
        show_error(self.window(), "Download failed", what, todo)

    def shutdown(self) -> None:
        for job in self.jobs.values():
            job.cancel()
        for job in self.jobs.values():
            job.join(2.0)

    # -- adding and removing -------------------------------------------------------------
    def add_repo(self) -> None:
        dlg = QInputDialog(self)
        dlg.setWindowTitle("Add a Hugging Face model")
        dlg.setLabelText("Repository id (org/name) of a ReLU-family model in safetensors format:")
        dlg.setTextValue("")
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)
        dlg.textValueSelected.connect(self._add_repo_id)
        dlg.open()

    def choose_weights(self, spec: str, fmt_name: str) -> None:
        """A model's CPU weight format: kept for it, its card re-sized; the model in use reloads."""
        if not fmt_name or self.settings.cpu_weights_for(spec) == fmt_name:
            return
        self.settings.set_cpu_weights(spec, fmt_name)
        self.refresh()
        if spec == self.active_spec() and (self.client.model_info or self.client.loading_model):
            self.reload_requested.emit()

    def get_from_hub(self, spec: str) -> None:
        """A Hub search match (a repo id, or the catalogue id of one it lists): listed, its download
        size asked of the Hub on its card, as a catalogue entry's Download does."""
        if spec not in self.rows:
            self._add_custom(spec)
        self.plan_download(spec)
        self.when_scanned(lambda: self.reveal(spec))

    def reveal(self, spec: str) -> None:
        card = self.cards.get(spec)
        if card is None:  # built one per event-loop turn: look again once it is
            if spec in self.rows:
                QTimer.singleShot(50, self, lambda: self.reveal(spec))
            return
        self.scroll.ensureWidgetVisible(card)

    def _add_repo_id(self, text: str) -> None:
        from models_registry.resolve import is_repo_id

        repo = text.strip()
        if not is_repo_id(repo):
            show_error(self.window(), "Not a repository id", f"“{repo}” is not a Hugging Face repository id.",
                       "Type it as org/name, for example SparseLLM/ReluLLaMA-7B.")
            return
        self._add_custom(repo)
        self.start_download(repo)

    def add_folder(self) -> None:
        dlg = QFileDialog(self, "Choose a model folder (Hugging Face layout)")
        dlg.setFileMode(QFileDialog.FileMode.Directory)
        dlg.setOption(QFileDialog.Option.ShowDirsOnly, True)
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)
        dlg.fileSelected.connect(self.add_local_folder)
        dlg.open()

    def add_file(self) -> None:
        dlg = QFileDialog(self, "Choose a GGUF file", "", "GGUF models (*.gguf)")
        dlg.setFileMode(QFileDialog.FileMode.ExistingFile)
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)
        dlg.fileSelected.connect(self.import_gguf_file)
        dlg.open()

    def import_gguf_file(self, path: str) -> None:
        """Convert the file into the models folder off the GUI thread, then list it."""
        def work():
            from engine.loading.gguf_import import import_gguf
            from models_registry.manage import import_gguf_file

            return import_gguf_file(path, convert=import_gguf)

        def failed(exc: BaseException) -> None:
            show_error(self.window(), "Cannot import the file", str(exc),
                       "Thermocline imports GGUFs of llama and bamboo ReLU-family models in F16, BF16, Q8_0 or "
                       "Q4_0. A plain llama GGUF needs `thermocline models import FILE --activation relu`.")

        self.add_file_button.setEnabled(False)

        def done(result) -> None:
            self.add_file_button.setEnabled(True)
            target, _summary = result
            self._add_custom(f"local/{Path(target).name.split('--', 1)[1]}")

        def error(exc: BaseException) -> None:
            self.add_file_button.setEnabled(True)
            failed(exc)

        run_in_background(work, done, error, owner=self)

    def add_local_folder(self, path: str) -> None:
        folder = Path(path).expanduser().resolve()
        if not (folder / "config.json").is_file():
            show_error(self.window(), "Not a model folder", f"{folder} has no config.json.",
                       "Choose the folder that holds config.json, the .safetensors weights and tokenizer.json.")
            return
        self._add_custom(str(folder))

    def _add_custom(self, spec: str) -> None:
        custom = list(self.settings["models.custom"])
        if spec not in custom:
            custom.append(spec)
            self.settings["models.custom"] = custom
        self._provisional_card(spec)
        self.refresh()

    def _provisional_card(self, spec: str) -> None:
        """A card for a Hub repo just added, at once: its download shows there before the scan
        (seconds on a busy machine) has sized it; the scan's row replaces this one."""
        from models_registry.resolve import downloaded_model_dir, is_repo_id

        if spec in self.cards or not is_repo_id(spec):
            return
        row = {"spec": spec, "title": spec, "repo": spec, "folder": str(downloaded_model_dir(spec)),
               "status": "absent", "size": None, "license": "see the model card", "params": "", "sparsity": None,
               "description": "Added by hand", "verdict": "fit unknown", "reason": "", "custom": True,
               "local": False, "downloadable": True, "chat": False, "words_s": None, "speed": "", "capability": 0}
        self.rows.setdefault(spec, row)
        card = ModelCard(self, row)
        self.cards[spec] = card
        self.list_layout.insertWidget(1, card)  # first under the Hub search, where it is seen

    def add_remote(self) -> None:
        from .remote_dialog import AddRemoteDialog

        dlg = AddRemoteDialog(self)
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)
        dlg.added.connect(lambda _spec: self.refresh())
        dlg.open()
        self.remote_dialog = dlg

    def remove_custom(self, spec: str) -> None:
        if spec.startswith("remote/"):
            from models_registry.remotes import remove_remote

            remove_remote(spec)
        self.settings["models.custom"] = [s for s in self.settings["models.custom"] if s != spec]
        self.refresh()

    def delete_model(self, spec: str) -> None:
        card = self.cards.get(spec)
        if card is None:
            return
        if spec == self.active_spec() and self.client.model_info:
            show_error(self.window(), "Model in use", f"{spec} is the model in use.",
                       "Use another model first, then delete this one.")
            return
        folder = Path(card.info["folder"])
        box = QMessageBox(QMessageBox.Icon.Question, "Delete model",
                          f"Delete {spec} ({fmt.size(card.info.get('size'))}) from {folder}?",
                          QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel, self)
        box.setInformativeText("You can download it again later.")
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)

        def answered(button) -> None:
            if box.standardButton(button) == QMessageBox.StandardButton.Yes:
                run_in_background(lambda: shutil.rmtree(folder), lambda _r: self.refresh(),
                                  lambda exc: show_error(self.window(), "Could not delete",
                                                         f"Deleting {folder} failed: {exc}",
                                                         "Close programs that use these files and try again."),
                                  self)

        box.buttonClicked.connect(answered)
        box.open()

    def _open_models_dir(self) -> None:
        from models_registry.paths import models_dir

        folder = models_dir()
        folder.mkdir(parents=True, exist_ok=True)
        QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder)))
