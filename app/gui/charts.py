"""Two small painted charts for the placement: hot share per layer, and bytes per tier.

Warm colours are the GPU (hot neurons), cool ones the CPU (cold neurons), like the layers
of water the app is named after.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from . import formatting as fmt

HOT = QColor("#e8743b")
COLD = QColor("#3b7dd8")
GRID = QColor(0, 0, 0, 28)


def grid_colour(widget) -> QColor:
    """Faint lines in the text colour: visible on light and dark themes alike."""
    c = QColor(widget.palette().color(widget.foregroundRole()))
    c.setAlpha(40)
    return c

# Tier name -> (label, colour); fast-device (GPU) tiers warm, CPU tiers cool. The engine names
# the GPU side "fast_*" (it is the CPU itself on a machine with no GPU); older names kept too.
TIERS = {
    "fast_ffn": ("Hot neurons", QColor("#e8743b")),
    "gpu_ffn": ("Hot neurons", QColor("#e8743b")),
    "fast_dense": ("Fast: attention & dense", QColor("#f2a65a")),
    "gpu_dense": ("Fast: attention & dense", QColor("#f2a65a")),
    "fast_kv": ("Fast: KV cache", QColor("#c9a227")),
    "kv_cache": ("KV cache", QColor("#c9a227")),
    "predictors": ("Predictors", QColor("#8e6bbf")),
    "cpu_kv": ("CPU: KV cache", QColor("#a9c7ea")),
    "cpu_dense": ("CPU: attention & dense", QColor("#7fb3e6")),
    "cpu_ffn": ("Cold neurons (CPU)", QColor("#3b7dd8")),
}


def tier_style(name: str) -> tuple[str, QColor]:
    if name in TIERS:
        return TIERS[name]
    warm = name.startswith("gpu")
    return name.replace("_", " "), QColor("#f0b27a" if warm else "#9bbbe0")


class LayerChart(QWidget):
    """One bar per layer: the share of its FFN neurons that are hot (on the GPU)."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("layerChart")
        self.fractions: list[float] = []
        self.setMinimumHeight(90)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMouseTracking(True)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt API
        return QSize(260, 96)

    def set_fractions(self, fractions: list[float]) -> None:
        self.fractions = [max(0.0, min(1.0, float(f))) for f in fractions]
        self.update()

    def _plot_rect(self) -> QRectF:
        return QRectF(36, 6, max(1, self.width() - 42), max(1, self.height() - 22))

    def paintEvent(self, _event) -> None:  # noqa: N802 - Qt API
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        r = self._plot_rect()
        small = QFont(self.font())
        small.setPointSizeF(max(6.5, small.pointSizeF() * 0.8))
        p.setFont(small)
        text = self.palette().color(self.foregroundRole())
        text.setAlpha(150)
        for frac in (0.0, 0.5, 1.0):
            y = r.bottom() - frac * r.height()
            p.setPen(QPen(grid_colour(self), 1))
            p.drawLine(int(r.left()), int(y), int(r.right()), int(y))
            p.setPen(text)
            p.drawText(QRectF(0, y - 7, 32, 14), Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
                       f"{frac:.0%}")
        n = len(self.fractions)
        if n == 0:
            p.setPen(text)
            p.drawText(r, Qt.AlignmentFlag.AlignCenter, "no placement yet")
            p.end()
            return
        step = r.width() / n
        gap = min(3.0, step * 0.25)
        for i, frac in enumerate(self.fractions):
            x = r.left() + i * step + gap / 2
            w = max(1.0, step - gap)
            p.fillRect(QRectF(x, r.top(), w, r.height()), QColor(COLD.red(), COLD.green(), COLD.blue(), 55))
            h = frac * r.height()
            p.fillRect(QRectF(x, r.bottom() - h, w, h), HOT)
        p.setPen(text)
        labels = {0, n - 1} | ({n // 2} if n > 4 else set(range(n)))
        for i in sorted(labels):
            x = r.left() + (i + 0.5) * step
            p.drawText(QRectF(x - 20, r.bottom() + 2, 40, 14), Qt.AlignmentFlag.AlignCenter, str(i))
        p.end()

    def mouseMoveEvent(self, event) -> None:  # noqa: N802 - Qt API
        r = self._plot_rect()
        n = len(self.fractions)
        if n and r.left() <= event.position().x() <= r.right():
            i = min(n - 1, int((event.position().x() - r.left()) / (r.width() / n)))
            QToolTip.showText(event.globalPosition().toPoint(),
                              f"layer {i}: {self.fractions[i]:.0%} of neurons hot (GPU)", self)


class TierBar(QWidget):
    """A stacked bar of bytes per tier, with a legend underneath."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("tierBar")
        self.tiers: dict[str, int] = {}
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def set_tiers(self, tiers: dict[str, int]) -> None:
        order = list(TIERS) + sorted(k for k in tiers if k not in TIERS)
        self.tiers = {k: int(tiers[k]) for k in order if k in tiers and tiers[k]}
        self.updateGeometry()
        self.update()

    def _legend_rows(self) -> int:
        return len(self.tiers)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt API
        return QSize(260, 22 + 18 * max(1, self._legend_rows()))

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt API
        return QSize(120, self.sizeHint().height())  # the bar stretches; a narrow panel elides the legend

    def paintEvent(self, _event) -> None:  # noqa: N802 - Qt API
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        text = self.palette().color(self.foregroundRole())
        total = sum(self.tiers.values())
        bar = QRectF(0, 2, self.width() - 1, 14)
        if total <= 0:
            p.fillRect(bar, grid_colour(self))
            p.end()
            return
        x = bar.left()
        for name, n in self.tiers.items():
            w = bar.width() * n / total
            p.fillRect(QRectF(x, bar.top(), w, bar.height()), tier_style(name)[1])
            x += w
        small = QFont(self.font())
        small.setPointSizeF(max(6.5, small.pointSizeF() * 0.85))
        p.setFont(small)
        col_w = self.width()
        for i, (name, n) in enumerate(self.tiers.items()):
            label, colour = tier_style(name)
            cx = 0
            cy = 22 + i * 18
            p.fillRect(QRectF(cx, cy + 3, 9, 9), colour)
            p.setPen(text)
            p.drawText(QRectF(cx + 13, cy, col_w - 15, 16), Qt.AlignmentFlag.AlignVCenter,
                       f"{label}  {fmt.size(n)}")
        p.end()
