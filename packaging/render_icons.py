"""Render resources/icons/thermocline.svg to the PNG sizes of the Linux icon theme and to a
multi-size Windows .ico (PNG-compressed entries, Vista+), with Qt's own SVG renderer.

    python packaging/render_icons.py OUT_DIR
writes OUT_DIR/hicolor/<n>x<n>/apps/thermocline.png, OUT_DIR/thermocline.png (256 px) and
OUT_DIR/thermocline.ico.
"""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SVG = ROOT / "resources" / "icons" / "thermocline.svg"
THEME_SIZES = (16, 22, 24, 32, 48, 64, 128, 256, 512)
ICO_SIZES = (16, 24, 32, 48, 64, 128, 256)


def render_png(size: int) -> bytes:
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    renderer = QSvgRenderer(str(SVG))
    if not renderer.isValid():
        raise SystemExit(f"error: cannot render {SVG}")
    img = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    img.fill(Qt.GlobalColor.transparent)
    p = QPainter(img)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(p)
    p.end()
    data = QByteArray()
    buf = QBuffer(data)
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    img.save(buf, "PNG")
    buf.close()
    return bytes(data)


def ico(images: dict[int, bytes]) -> bytes:
    """ICONDIR + ICONDIRENTRY per size, each image stored as PNG."""
    head = struct.pack("<HHH", 0, 1, len(images))
    offset = 6 + 16 * len(images)
    entries, blobs = b"", b""
    for size, png in sorted(images.items()):
        dim = 0 if size >= 256 else size  # 0 means 256
        entries += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(png), offset)
        blobs += png
        offset += len(png)
    return head + entries + blobs


def main(out: Path) -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtGui import QGuiApplication

    app = QGuiApplication.instance() or QGuiApplication(["render_icons"])  # noqa: F841 - keeps Qt alive
    pngs = {size: render_png(size) for size in sorted(set(THEME_SIZES) | set(ICO_SIZES))}
    for size in THEME_SIZES:
        d = out / "hicolor" / f"{size}x{size}" / "apps"
        d.mkdir(parents=True, exist_ok=True)
        (d / "thermocline.png").write_bytes(pngs[size])
    (out / "thermocline.png").write_bytes(pngs[256])
    (out / "thermocline.ico").write_bytes(ico({s: pngs[s] for s in ICO_SIZES}))
    print(f"icons written to {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: render_icons.py OUT_DIR")
    raise SystemExit(main(Path(sys.argv[1])))
