"""The budgets panel: VRAM and RAM sliders, context length, and the placement they produce.

Moving a slider sends the new budgets to the engine worker at once (it re-solves the
placement between tokens, so an answer in progress keeps streaming); they are saved only once
the engine has placed the model within them, so a budget that cannot work is never kept. The result comes back as a placement report: hot share per layer, bytes per tier,
expected hot hit fraction, a verdict. Budgets that cannot work are explained here in words,
never raised as a crash.
"""

from __future__ import annotations

import logging
import re

from PySide6.QtCore import QSize, Qt, QTimer, Signal, Slot
from PySide6.QtWidgets import (QComboBox, QFrame, QGridLayout, QLabel, QProgressBar, QPushButton,
                               QScrollArea, QSlider, QStyle, QStyleOptionComboBox, QVBoxLayout, QWidget)

from app.settings import Settings

from . import formatting as fmt
from .charts import LayerChart, TierBar
from .tasks import run_in_background
from .worker import EngineClient

log = logging.getLogger(__name__)

STEP = 1024**2  # slider resolution: 1 MiB (small models need it); arrow keys move 64 MiB
CONTEXT_CHOICES = (512, 1024, 2048, 4096, 8192, 16384, 32768)
MODE_CHOICES = (
    ("hybrid", "Hybrid (GPU + CPU)", "Predictors pick the neurons; hot ones on the GPU, cold on the CPU"),
    ("sparse", "Sparse (CPU)", "Predictors pick the neurons; everything on the CPU"),
    ("dense", "Dense (all neurons)", "Compute every neuron (no predictors needed; slowest)"),
)


def _probe(spec: str, ctx: int) -> dict:
    from models_registry.listing import probe_for_model  # numpy and the fit rules: off the start-up path

    return probe_for_model(spec, ctx)


class BudgetSlider(QWidget):
    """A labelled slider over bytes, in steps of 1 MiB, bounded by what the machine has."""

    moved = Signal(object)      # bytes, on every move (object: byte counts overflow a C int)
    settled = Signal(object)    # bytes, once the user lets go

    def __init__(self, title: str, tip: str, parent: QWidget | None = None):
        super().__init__(parent)
        grid = QGridLayout(self)
        grid.setContentsMargins(0, 0, 0, 0)
        grid.setHorizontalSpacing(6)
        grid.setVerticalSpacing(2)
        self.title = QLabel(title, self)
        self.title.setObjectName("sliderTitle")
        self.title.setWordWrap(True)  # a narrow panel or a large text size wraps it, never clips it
        self.value_label = QLabel(self)
        self.value_label.setObjectName("sliderValue")
        self.value_label.setWordWrap(True)
        self.value_label.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        self.slider = QSlider(Qt.Orientation.Horizontal, self)
        self.slider.setToolTip(tip)
        self.slider.setSingleStep(64 * 1024**2 // STEP)
        self.slider.setPageStep(1024**3 // STEP)
        self.note = QLabel(self)
        self.note.setObjectName("hint")
        self.note.setWordWrap(True)
        self.note.hide()
        grid.addWidget(self.title, 0, 0)
        grid.addWidget(self.value_label, 0, 1)
        grid.addWidget(self.slider, 1, 0, 1, 2)
        grid.addWidget(self.note, 2, 0, 1, 2)
        self.total = 0
        self.slider.valueChanged.connect(self._changed)
        self.slider.sliderReleased.connect(lambda: self.settled.emit(self.value()))
        self._quiet = False

    def set_total(self, total: int) -> None:
        self.total = max(0, int(total))
        self._quiet = True
        self.slider.setRange(0, max(1, self.total // STEP))
        self._quiet = False
        self._label()

    def set_value(self, n: int) -> None:
        """Set without emitting (restoring saved or suggested budgets). Rounds up to the
        slider's step: a budget rounded down may no longer hold what it was chosen for."""
        self._quiet = True
        self.slider.setValue(-(-int(n) // STEP))
        self._quiet = False
        self._label()

    def value(self) -> int:
        return self.slider.value() * STEP

    def _label(self) -> None:
        if self.total <= 0:
            self.value_label.setText("none")
        else:
            self.value_label.setText(f"<b>{fmt.gib(self.value())}</b> of {fmt.gib(self.total)}")

    def _changed(self, _v: int) -> None:
        self._label()
        if not self._quiet:
            self.moved.emit(self.value())
            if not self.slider.isSliderDown():
                self.settled.emit(self.value())  # keyboard and wheel moves settle at once


class Section(QFrame):
    def __init__(self, title: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("panelSection")
        self.body = QVBoxLayout(self)
        self.body.setContentsMargins(12, 10, 12, 12)
        self.body.setSpacing(8)
        head = QLabel(title, self)
        head.setObjectName("sectionTitle")
        self.body.addWidget(head)


def whole_choice_width(combo: QComboBox) -> int:
    """The width at which a combo box shows its longest choice whole."""
    opt = QStyleOptionComboBox()
    combo.initStyleOption(opt)
    metrics = combo.fontMetrics()
    text = max((metrics.horizontalAdvance(combo.itemText(i)) for i in range(combo.count())), default=0)
    return combo.style().sizeFromContents(QStyle.ContentsType.CT_ComboBox, opt, QSize(text, metrics.height()),
                                          combo).width()


class BudgetPanel(QScrollArea):
    """Right-hand panel: budgets in, placement and live memory out."""

    reload_requested = Signal()  # context length changed: the model must be reloaded

    def choices_extra_width(self) -> int:
        """Width the panel needs beyond its minimum so that Context length and Mode show their
        longest choices whole: they may shrink (a large text size in a narrow window) rather
        than hold the panel wide, but where there is room they are not cut ("Dense (all
        neuro…" lost 2 px at 800x600)."""
        return max(0, *(whole_choice_width(c) - c.minimumSizeHint().width() for c in (self.ctx, self.mode)))

    def __init__(self, settings: Settings, client: EngineClient, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("budgetPanel")
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        # As needed: the window gives the panel the width its contents need (panel_width_needed);
        # where even that is too narrow (a very large text size at 800 px) it scrolls, never clips.
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.settings, self.client = settings, client
        self.machine: dict | None = None
        self.placement: dict | None = None
        self._last_mem: dict = {}
        self._unsaved: tuple[int, int] | None = None  # moved budgets waiting for the engine's yes
        self._refused: tuple[int, int] | None = None  # moved budgets the engine said cannot work
        inner = QWidget(self)
        inner.setObjectName("panelInner")
        col = QVBoxLayout(inner)
        col.setContentsMargins(10, 10, 10, 10)
        col.setSpacing(10)

        # Budgets -----------------------------------------------------------------------
        budgets = Section("Memory budgets", inner)
        self.vram = BudgetSlider("VRAM (GPU memory)", "How much GPU memory Thermocline may use", budgets)
        self.ram = BudgetSlider("RAM", "How much system memory Thermocline may use", budgets)
        self.vram.slider.setAccessibleName("VRAM budget")
        self.ram.slider.setAccessibleName("RAM budget")
        budgets.body.addWidget(self.vram)
        budgets.body.addWidget(self.ram)
        load_grid = QGridLayout()
        load_grid.setHorizontalSpacing(6)
        ctx_label = QLabel("Context length", budgets)
        ctx_label.setObjectName("sliderTitle")
        mode_label = QLabel("Mode", budgets)
        mode_label.setObjectName("sliderTitle")
        self.mode = QComboBox(budgets)
        self.mode.setObjectName("modeCombo")
        for mode, text, tip in MODE_CHOICES:
            self.mode.addItem(text, mode)
            self.mode.setItemData(self.mode.count() - 1, tip, Qt.ItemDataRole.ToolTipRole)
        self.mode.setToolTip("How feed-forward neurons are computed. Changing it reloads the model; "
                             "conversations are kept.")
        self.ctx = QComboBox(budgets)
        self.ctx.setObjectName("ctxCombo")
        for combo in (self.ctx, self.mode):  # let a narrow panel shrink them rather than clip
            combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            combo.setMinimumContentsLength(6)
        self.ctx.setToolTip("Tokens the model can read at once (prompt plus answer). Changing it reloads "
                            "the model; conversations are kept.")
        for n in CONTEXT_CHOICES:
            self.ctx.addItem(f"{n:,} tokens", n)
        self.ctx_apply = QPushButton("Apply (reloads)", budgets)
        self.ctx_apply.setProperty("kind", "primary")
        self.ctx_apply.setToolTip("Reload the model with this context length and mode; the conversation stays")
        self.ctx_apply.hide()
        load_grid.addWidget(ctx_label, 0, 0)
        load_grid.addWidget(self.ctx, 0, 1)
        load_grid.addWidget(mode_label, 1, 0)
        load_grid.addWidget(self.mode, 1, 1)
        load_grid.setColumnStretch(1, 1)
        budgets.body.addLayout(load_grid)
        self.ctx_hint = QLabel(budgets)
        self.ctx_hint.setObjectName("hint")
        self.ctx_hint.setWordWrap(True)
        self.ctx_hint.hide()
        budgets.body.addWidget(self.ctx_hint)
        self._trained_ctx: int | None = None
        budgets.body.addWidget(self.ctx_apply, 0, Qt.AlignmentFlag.AlignRight)
        self.restore = QPushButton("Restore suggested", budgets)
        self.restore.setObjectName("restoreBudgets")
        self.restore.setToolTip("Go back to the budgets suggested for this machine and model")
        self.restore.clicked.connect(self.restore_suggested)
        self.suggest_label = QLabel(budgets)
        self.suggest_label.setObjectName("hint")
        self.suggest_label.setWordWrap(True)
        budgets.body.addWidget(self.suggest_label)
        budgets.body.addWidget(self.restore, 0, Qt.AlignmentFlag.AlignLeft)
        col.addWidget(budgets)

        # Placement ---------------------------------------------------------------------
        place = Section("Neuron placement", inner)
        self.verdict = QLabel("Waiting for the model…", place)
        self.verdict.setObjectName("verdict")
        self.verdict.setWordWrap(True)
        place.body.addWidget(self.verdict)
        self.chart_caption = cap = QLabel("Share of each layer's neurons kept on the GPU", place)
        cap.setObjectName("hint")
        cap.setWordWrap(True)
        place.body.addWidget(cap)
        self.chart = LayerChart(place)
        place.body.addWidget(self.chart)
        self.tiers = TierBar(place)
        place.body.addWidget(self.tiers)
        self.place_facts = QLabel(place)
        self.place_facts.setObjectName("facts")
        self.place_facts.setWordWrap(True)
        place.body.addWidget(self.place_facts)
        col.addWidget(place)

        # Live memory -------------------------------------------------------------------
        live = Section("In use now", inner)
        self.vram_use = self._usage_bar(live, "VRAM")
        self.ram_use = self._usage_bar(live, "RAM")
        self.device_label = QLabel(live)
        self.device_label.setObjectName("facts")
        self.device_label.setWordWrap(True)
        live.body.addWidget(self.device_label)
        col.addWidget(live)
        col.addStretch(1)
        self.setWidget(inner)
        # No minimum width: a narrow window folds the panel away instead of refusing to shrink.

        # Wiring ------------------------------------------------------------------------
        self._save_timer = QTimer(self, singleShot=True, interval=400)
        self._save_timer.timeout.connect(self._save_budgets)
        self.vram.moved.connect(self._budgets_moved)
        self.ram.moved.connect(self._budgets_moved)
        self.vram.settled.connect(lambda _n: self._save_timer.start())
        self.ram.settled.connect(lambda _n: self._save_timer.start())
        self.ctx.currentIndexChanged.connect(self._ctx_changed)
        self.mode.currentIndexChanged.connect(self._ctx_changed)
        self.ctx_apply.clicked.connect(self._apply_ctx)
        w = client
        w.placement.connect(self.show_placement)
        w.placement_failed.connect(self.show_placement_error)
        w.placement_unavailable.connect(self.show_unavailable)
        w.loaded.connect(self._on_loaded)
        w.load_failed.connect(self._on_load_failed)
        w.live_stats.connect(self._on_live)
        w.finished.connect(self._on_live)
        self._select_ctx(settings["engine.ctx"])
        self._select_mode(settings["engine.mode"])
        self.vram.set_total(0)
        self.ram.set_total(0)  # until the probe that precedes every model load reports

    def _usage_bar(self, section: Section, name: str) -> tuple[QLabel, QProgressBar]:
        label = QLabel(f"{name}: —", section)
        label.setObjectName("facts")
        bar = QProgressBar(section)
        bar.setObjectName("usageBar")
        bar.setTextVisible(False)
        bar.setRange(0, 1000)
        bar.setFixedHeight(8)
        section.body.addWidget(label)
        section.body.addWidget(bar)
        return label, bar

    # -- machine and suggestions ---------------------------------------------------------
    def refresh_machine(self) -> None:
        spec, ctx = self.settings["model.active"], self.settings["engine.ctx"]
        run_in_background(lambda: _probe(spec, ctx), self._on_machine,
                          lambda exc: self.suggest_label.setText(f"Could not probe this machine: {exc}"), self)

    def _on_machine(self, machine: dict) -> None:
        if self._save_timer.isActive():  # keep a move the user just made
            self._save_timer.stop()
            self._save_budgets()
        self.machine = machine
        self.vram.set_total(machine["vram_total"])
        self.ram.set_total(machine["ram_total"])
        hybrid = self.mode.findData("hybrid")
        if hybrid >= 0:  # without a GPU the fast tier is the CPU: say so in the mode's name
            self.mode.setItemText(hybrid, "Hybrid (GPU + CPU)" if machine["vram_total"] else "Hybrid (CPU only)")
        for w in self.vram_use:  # no GPU: no VRAM line under "In use now"
            w.setVisible(bool(machine["vram_total"]))
        if machine["vram_total"] == 0:
            self.vram.slider.setEnabled(False)
            why = fmt.gpu_note(machine.get("gpu_note"))
            self.vram.note.setText(f"No GPU found{' (' + why + ')' if why else ''}: everything runs on "
                                   "the CPU, so only the RAM budget matters.")
            self.vram.note.setToolTip(machine.get("gpu_note") or "")
            self.vram.note.show()
        else:
            self.vram.slider.setEnabled(True)
            self.vram.note.setText(machine.get("gpu_name", ""))
            self.vram.note.setVisible(bool(machine.get("gpu_name")))
        sv, sr = machine.get("suggested_vram"), machine.get("suggested_ram")
        if sv is not None and sr is not None:
            self.suggest_label.setText(f"Suggested for this machine: VRAM {fmt.gib(sv)}, RAM {fmt.gib(sr)}."
                                       if machine["vram_total"] else f"Suggested for this machine: RAM {fmt.gib(sr)}.")
        else:
            why = machine.get("suggest_error") or "unknown model size"
            self.suggest_label.setText("No suggested budgets: the model's size is not known yet.")
            self.suggest_label.setToolTip(why)
        self.restore.setEnabled(sv is not None and sr is not None)
        self.vram.set_value(self.current_vram())
        self.ram.set_value(self.current_ram())

    def current_vram(self) -> int:
        saved = self.settings["budget.vram_bytes"]
        if saved is not None:
            return saved
        return (self.machine or {}).get("suggested_vram") or 0

    def current_ram(self) -> int:
        saved = self.settings["budget.ram_bytes"]
        if saved is not None:
            return saved
        m = self.machine or {}
        return m.get("suggested_ram") or m.get("ram_available") or 0

    def ctx_for_load(self) -> int:
        """The chosen context length, capped at what the model was trained for."""
        ctx = self.settings["engine.ctx"]
        trained = (self.machine or {}).get("trained_ctx")
        return min(ctx, trained) if trained else ctx

    def budgets_for_load(self) -> tuple[int | None, int | None]:
        """What the next load should use: the saved budgets, else this machine's suggestion for
        the model (None where neither is known: the engine chooses)."""
        m = self.machine or {}
        vram = self.settings["budget.vram_bytes"]
        ram = self.settings["budget.ram_bytes"]
        return (vram if vram is not None else m.get("suggested_vram"),
                ram if ram is not None else m.get("suggested_ram"))

    def probe_then(self, spec: str, ctx: int, then) -> None:
        """Probe the machine and the suggestion for `spec`, then call `then()` (also on failure)."""
        def done(machine: dict) -> None:
            self._on_machine(machine)
            then()

        def failed(exc: BaseException) -> None:
            self.suggest_label.setText(f"Could not probe this machine: {exc}")
            then()

        run_in_background(lambda: _probe(spec, ctx), done, failed, self)

    def restore_suggested(self) -> None:
        self.settings.reset("budget.vram_bytes")
        self.settings.reset("budget.ram_bytes")
        self.vram.set_value(self.current_vram())
        self.ram.set_value(self.current_ram())
        self.client.set_budgets(self.current_vram(), self.current_ram())

    # -- slider moves --------------------------------------------------------------------
    _moved = False  # the sliders moved since the last placement the engine reported

    def _budgets_moved(self, _n: int) -> None:
        self._moved = True
        self.verdict.setText("Re-placing neurons…")
        self._show_memory(self._last_mem)
        self.client.set_budgets(self.vram.value(), self.ram.value())

    def _save_budgets(self) -> None:
        """Save the sliders' budgets once the engine has placed the model within them (or at
        once when nothing is placed: dense mode, no model)."""
        values = (self.vram.value(), self.ram.value())
        if values == self._refused:
            return  # already known not to work: never saved
        placed = (self.placement or {}).get("vram_budget"), (self.placement or {}).get("ram_budget")
        if self.placement is None or (placed == values and not self._moved):
            self._store(values)  # nothing to check, or the engine already placed the model within them
        else:
            self._unsaved = values  # show_placement saves them, show_placement_error does not

    def _store(self, values: tuple[int, int]) -> None:
        self._unsaved = None
        self.settings["budget.vram_bytes"] = values[0]
        self.settings["budget.ram_bytes"] = values[1]

    def _offer_ctx(self, trained: int | None) -> None:
        """Context lengths up to what the model was trained for (and that length itself)."""
        current = self.ctx.currentData()
        self.ctx.blockSignals(True)
        self.ctx.clear()
        for n in CONTEXT_CHOICES:
            if not trained or n <= trained:
                self.ctx.addItem(f"{n:,} tokens", n)
        if trained and self.ctx.findData(trained) < 0:
            self.ctx.addItem(f"{trained:,} tokens", trained)
        i = self.ctx.findData(current)
        self.ctx.setCurrentIndex(i if i >= 0 else self.ctx.count() - 1)
        self.ctx.blockSignals(False)

    def _select_ctx(self, ctx: int) -> None:
        i = self.ctx.findData(ctx)
        if i < 0:
            self.ctx.addItem(f"{ctx:,} tokens", ctx)
            i = self.ctx.count() - 1
        self.ctx.blockSignals(True)
        self.ctx.setCurrentIndex(i)
        self.ctx.blockSignals(False)
        self.ctx_apply.hide()

    def _select_mode(self, mode: str) -> None:
        i = max(0, self.mode.findData(mode))
        self.mode.blockSignals(True)
        self.mode.setCurrentIndex(i)
        self.mode.blockSignals(False)
        self.ctx_apply.hide()

    def _update_ctx_hint(self) -> None:
        trained = self._trained_ctx
        over = bool(trained) and self.settings["engine.ctx"] > trained
        self.ctx_hint.setText(f"This model was trained on {trained:,} tokens, so it reads at most that "
                              "many: longer lengths are not offered." if over else "")
        self.ctx_hint.setVisible(over)

    def _ctx_changed(self, _i: int) -> None:
        loaded = self.client.model_info or {}
        ctx_now = loaded.get("ctx") or self.settings["engine.ctx"]
        mode_now = loaded.get("mode") or self.settings["engine.mode"]
        self.ctx_apply.setVisible(self.ctx.currentData() != ctx_now or self.mode.currentData() != mode_now)

    def _apply_ctx(self) -> None:
        self.settings["engine.ctx"] = int(self.ctx.currentData())
        self.settings["engine.mode"] = str(self.mode.currentData())
        self.ctx_apply.hide()
        self.reload_requested.emit()

    # -- engine results ------------------------------------------------------------------
    @Slot(dict)
    def show_placement(self, report: dict) -> None:
        self.placement = report
        placed = (report.get("vram_budget"), report.get("ram_budget"))
        self._refused = None
        self._moved = False
        if self._unsaved is not None and placed == self._unsaved:
            self._store(self._unsaved)
        dev = str(report.get("device") or "")
        on_gpu = dev.startswith("cuda")
        self._show_charts(True, chart=on_gpu)  # a CPU-only chart would read 100% everywhere: it says nothing
        verdict = str(report.get("verdict") or "placed")
        kind = "bad" if "not" in verdict.lower() else ("good" if verdict.lower().startswith("fits") else "ok")
        self._set_verdict(verdict[:1].upper() + verdict[1:], kind)
        self.chart.set_fractions(report.get("hot_fraction_per_layer") or [])
        self.chart_caption.setText("Share of each layer's neurons kept on the GPU (the busiest ones)" if on_gpu
                                   else "No GPU: every neuron is on the CPU, so there is nothing to split.")
        self.chart.setToolTip("Each bar is one layer: the orange part is the share of its neurons in GPU "
                              "memory. Busy neurons go there first.")
        self.tiers.set_tiers(report.get("tier_bytes") or {})
        facts = []
        if report.get("hot_hit_fraction") is not None and dev.startswith("cuda"):
            facts.append(f"Expected share of firing neurons served by the GPU: "
                         f"<b>{fmt.percent(report['hot_hit_fraction'])}</b>")
        if report.get("vram_bytes") is not None:
            facts.append(f"Placed: VRAM {fmt.gib(report['vram_bytes'])}, RAM {fmt.gib(report.get('ram_bytes'))}"
                         if on_gpu else  # no GPU: the fast tier is RAM too
                         f"Placed: RAM {fmt.gib((report.get('ram_bytes') or 0) + (report['vram_bytes'] or 0))}")
        if report.get("verdict") == "runs from disk":  # the disk tier (issue #29)
            facts.append(f"Cold neurons on disk: reads about <b>{fmt.size(report.get('disk_read_per_token'))}</b> "
                         f"from disk per token, the RAM cache serving about "
                         f"{fmt.percent(report.get('expected_cache_hit'))} of them; runs from disk at about "
                         f"{fmt.words_rate(report.get('disk_words_per_second') or 0)} words a second")
        self._show_ram_floor(report)
        solve = report.get("solve_s")
        dev = report.get("device")
        if solve is not None or dev:
            facts.append(f"Solved in {fmt.seconds(solve)} for {fmt.device_name(dev)}")
        self.place_facts.setText("<br>".join(facts))

    def _show_ram_floor(self, report: dict) -> None:
        """Under the RAM slider: the least budget that runs (the resident parts and the disk
        tier's smallest cache), where the model can run from disk below its full size."""
        least = report.get("min_ram_bytes") or 0
        if not least:
            return
        if report.get("verdict") == "runs from disk" or least < (report.get("ram_bytes") or 0):
            self.ram.note.setText(f"Runs down to {fmt.gib(least)}: below what the model needs in RAM, its cold "
                                  "neurons are read from disk (slower).")
        else:
            self.ram.note.setText(f"Needs at least {fmt.gib(least)}.")
        self.ram.note.setToolTip(f"The least RAM budget that runs: {fmt.size(least)}")
        self.ram.note.show()

    @Slot(str)
    def show_placement_error(self, message: str) -> None:
        kept = ""
        if self._unsaved is not None or self._save_timer.isActive() or self._moved:
            # A slider move the engine refused: keep it off the disk.
            self._refused = (self.vram.value(), self.ram.value())
            self._unsaved = None
            self._save_timer.stop()
            kept = " They were not saved: the last budgets that worked are used at the next start."
        if self.machine is not None and not self.machine.get("vram_total"):
            # No GPU: the VRAM budget is always 0; naming it only confuses.
            message = re.sub(r"at a VRAM budget of \S+ \S+ the CPU side needs", "the model needs", message)
            message = re.sub(r"at a VRAM budget of \S+ \S+ ", "", message)  # the disk tier's wording
        self._set_verdict(f"These budgets cannot work: {message}.{kept}".replace("..", "."), "bad")

    @Slot(str)
    def show_unavailable(self, message: str) -> None:
        self.placement = None
        self._set_verdict(message, "muted")
        self.chart.set_fractions([])
        self.tiers.set_tiers({})
        self.place_facts.setText("")
        self._show_charts(False)

    def _show_charts(self, shown: bool, chart: bool = True) -> None:
        for w in (self.chart_caption, self.chart, self.tiers, self.place_facts):
            visible = shown and (chart or w is not self.chart)
            if w.isHidden() == visible:  # only real changes: each one lays the panel out again
                w.setVisible(visible)

    def _set_verdict(self, text: str, kind: str) -> None:
        self.verdict.setText(text)
        self.verdict.setProperty("kind", kind)
        self.verdict.style().unpolish(self.verdict)
        self.verdict.style().polish(self.verdict)

    def _on_load_failed(self, *_args) -> None:
        self.show_unavailable("No model loaded: choose one on the Models page.")
        self._show_memory({})

    @Slot(dict)
    def _on_loaded(self, info: dict) -> None:
        self._trained_ctx = info.get("max_positions")
        self._offer_ctx(self._trained_ctx)
        self._select_ctx(int(info.get("ctx") or self.settings["engine.ctx"]))
        # The mode it runs in, not the one asked for (a model without predictors runs dense).
        self._select_mode(str(info.get("mode") or self.settings["engine.mode"]))
        if info.get("fallback"):
            self.mode.setToolTip(str(info.get("note") or ""))
        if info.get("budgets_reset"):
            # The saved budgets could not work: forget them, show the ones in use.
            self.settings.reset("budget.vram_bytes")
            self.settings.reset("budget.ram_bytes")
            self.vram.set_value(self.current_vram())
            self.ram.set_value(self.current_ram())
        self._update_ctx_hint()
        self._show_memory(info.get("memory") or {})

    def _on_live(self, _request_id: int, stats: dict) -> None:
        mem = {k[4:]: v for k, v in stats.items() if k.startswith("mem_")}
        if mem:
            self._show_memory(mem)

    def _show_memory(self, mem: dict) -> None:
        self._last_mem = mem
        for (label, bar), name, budget in ((self.vram_use, "VRAM", self.vram.value()),
                                           (self.ram_use, "RAM", self.ram.value())):
            used = mem.get(f"{name.lower()}_bytes")
            if used is None:
                label.setText(f"{name}: —")
                bar.setValue(0)
                continue
            label.setText(f"{name}: {fmt.gib(used)} of {fmt.gib(budget)} budget" if budget
                          else f"{name}: {fmt.gib(used)}")
            bar.setValue(int(min(1.0, used / budget) * 1000) if budget else 0)
        if mem.get("device"):
            self.device_label.setText(f"Device: {fmt.device_name(mem['device'])}")
