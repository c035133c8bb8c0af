"""The Models page's Hub search: a box over Hugging Face (`models_registry.hub_search`), the
models Thermocline runs among the matches, each with its size, fit verdict, speed here and
how it will run, and a button that downloads it the way a catalogue entry is downloaded
(its size asked of the Hub first, on its own card)."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QFrame, QGridLayout, QHBoxLayout, QLabel, QLineEdit, QPushButton, QVBoxLayout,
                               QWidget)

from . import formatting as fmt
from .tasks import run_in_background

PLACEHOLDER = "Search Hugging Face for a model (for example: relu, prosparse, bamboo)"


class HubResult(QFrame):
    """One match: repo id, facts, verdict, how it runs, Download."""

    def __init__(self, row: dict, parent: QWidget):
        super().__init__(parent)
        self.setObjectName("hubResult")
        self.row = row
        grid = QGridLayout(self)
        grid.setContentsMargins(10, 8, 10, 8)
        grid.setHorizontalSpacing(8)
        grid.setVerticalSpacing(2)
        self.title = QLabel(f"<b>{row['repo']}</b>", self)
        self.title.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.title.setWordWrap(True)
        grid.addWidget(self.title, 0, 0)
        self.verdict = QLabel(row["verdict"], self)
        self.verdict.setObjectName("verdictChip")
        self.verdict.setProperty("kind", fmt.verdict_kind(row["verdict"]))  # the cards' colours
        self.verdict.setToolTip(row.get("reason", ""))
        grid.addWidget(self.verdict, 0, 1, Qt.AlignmentFlag.AlignTop)
        self.button = QPushButton("In the catalogue" if row.get("catalogue_id") else "Download…", self)
        self.button.setObjectName("hubDownload")
        self.button.setToolTip("Add it to the list and ask the Hub how much it downloads")
        grid.addWidget(self.button, 0, 2, Qt.AlignmentFlag.AlignTop)
        facts = [f"size {fmt.size(row['size'])}" if row.get("size") else "size unknown"]
        for key in ("reason", "speed", "runs"):
            if row.get(key):
                facts.append(row[key])
        self.facts = QLabel(" · ".join(facts), self)
        self.facts.setObjectName("facts")
        self.facts.setWordWrap(True)
        grid.addWidget(self.facts, 1, 0, 1, 3)
        grid.setColumnStretch(0, 1)


class HubSearch(QFrame):
    """The search row and its results; `download_requested(repo)` when one is picked."""

    download_requested = Signal(str)
    catalogue_requested = Signal(str)  # the catalogue id of a match the catalogue lists

    def __init__(self, page: QWidget, query_hub=None):
        super().__init__(page)
        self.setObjectName("hubSearch")
        self.page = page
        from models_registry.hub_search import search_hub

        self._query_hub = query_hub or search_hub
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 4, 0, 0)
        layout.setSpacing(6)
        row = QHBoxLayout()
        self.box = QLineEdit(self)
        self.box.setObjectName("hubSearchBox")
        self.box.setPlaceholderText(PLACEHOLDER)
        self.box.setClearButtonEnabled(True)
        self.box.setAccessibleName("Search Hugging Face")
        self.box.returnPressed.connect(self.search)
        self.button = QPushButton("Search the Hub", self)
        self.button.clicked.connect(self.search)
        row.addWidget(self.box, 1)
        row.addWidget(self.button)
        layout.addLayout(row)
        self.status = QLabel(self)
        self.status.setObjectName("hint")
        self.status.setWordWrap(True)
        self.status.hide()
        layout.addWidget(self.status)
        self.results_box = QWidget(self)
        self.results_layout = QVBoxLayout(self.results_box)
        self.results_layout.setContentsMargins(0, 0, 0, 0)
        self.results_layout.setSpacing(6)
        layout.addWidget(self.results_box)
        self.results: list[HubResult] = []
        self._generation = 0  # a newer search makes an older one's answer stale

    def search(self) -> None:
        query = self.box.text().strip()
        if not query:
            self.box.setFocus()
            return
        self._generation += 1
        generation = self._generation
        self.button.setEnabled(False)
        self._say(f"Searching Hugging Face for “{query}”…")
        settings = self.page.settings
        ctx, weights = settings["engine.ctx"], settings["engine.cpu_weights"]
        repos = self._catalogue_repos()

        def work():
            return self._query_hub(query, ctx=ctx, cpu_weights=weights, catalogue_repos=repos)

        def done(rows: list[dict]) -> None:
            if generation != self._generation:
                return
            self.button.setEnabled(True)
            self.show_results(query, rows)

        def failed(exc: BaseException) -> None:
            if generation != self._generation:
                return
            self.button.setEnabled(True)
            from .downloads import download_error_words

            what, todo = download_error_words(f"the search “{query}”", exc)
            self.clear_results()
            self._say(f"{what} {todo}".strip())

        run_in_background(work, done, failed, self)

    def _catalogue_repos(self) -> dict[str, str]:
        return {r["repo"]: spec for spec, r in getattr(self.page, "rows", {}).items()
                if r.get("repo") and not r.get("custom")}

    def _say(self, text: str) -> None:
        self.status.setText(text)
        self.status.setVisible(bool(text))

    def clear_results(self) -> None:
        for w in self.results:
            w.setParent(None)
            w.deleteLater()
        self.results = []

    def show_results(self, query: str, rows: list[dict]) -> None:
        self.clear_results()
        if not rows:
            from models_registry.arch import SUPPORTED_TEXT

            self._say(f"No model Thermocline runs matches “{query}” on the Hub. It runs: {SUPPORTED_TEXT}.")
            return
        self._say(f"{fmt.count(len(rows), 'model')} on the Hub that Thermocline runs, for “{query}”:")
        for row in rows:
            w = HubResult(row, self.results_box)
            spec = row.get("catalogue_id")
            if spec:
                w.button.clicked.connect(lambda _=False, s=spec: self.catalogue_requested.emit(s))
            else:
                w.button.clicked.connect(lambda _=False, r=row["repo"]: self.download_requested.emit(r))
            self.results_layout.addWidget(w)
            self.results.append(w)
