#!/usr/bin/env bash
# Run the real Thermocline window under Xvfb, drive it, and save PNGs to docs/screenshots/.
# Needs: Xvfb (apt-get install xvfb). Usage: tools/screenshots.sh [--model demo|PATH] [--mode hybrid|dense]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-docs/screenshots}
DISPLAY_NUM=${DISPLAY_NUM:-97}
SIZE=${SIZE:-1280x800}

Xvfb ":$DISPLAY_NUM" -screen 0 "${SIZE}x24" -nolisten tcp >/dev/null 2>&1 &
XVFB_PID=$!
trap 'kill "$XVFB_PID" 2>/dev/null || true' EXIT
for _ in $(seq 50); do [ -e "/tmp/.X11-unix/X$DISPLAY_NUM" ] && break; sleep 0.1; done

# The load waits for the compiled CPU kernels (a first run compiles them): the shots show the
# speed a second start has, not the torch paths' while they compile
DISPLAY=":$DISPLAY_NUM" QT_QPA_PLATFORM=xcb THERMOCLINE_KERNELS=${THERMOCLINE_KERNELS:-wait} "$PY" tools/screenshot_driver.py "$OUT" --size "$SIZE" "$@"
