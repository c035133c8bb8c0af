#!/usr/bin/env bash
# The scripted first use of issue 27, on the real program under Xvfb at 800x600 with real X11
# keys (xdotool), on a fresh data folder: the welcome is on screen; Ctrl+N, type, Enter, Esc,
# Ctrl+Q must send a message, stop its answer, and quit within 10 s. Checks the saved
# conversation afterwards; leaves screenshots in $SCRATCH/shots.
# Needs: Xvfb, xdotool (apt-get install xvfb xdotool).
# Usage: tools/first_use.sh            (MODEL=demo, PYTHON=.venv/bin/python, SIZE=800x600)
#        xvfb-run -s '-screen 0 800x600x24' env XDISPLAY=yes tools/first_use.sh
#        (XDISPLAY=yes: drive the X server in $DISPLAY, one xvfb-run started, not its own)
# Prints the seconds each step took ("timings:").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
MODEL=${MODEL:-demo}
SIZE=${SIZE:-800x600}
SCRATCH=${SCRATCH:-$(mktemp -d -t thermocline-first-use-XXXX)}
LOAD_WAIT=${LOAD_WAIT:-240}  # seconds for the model to load and the answer to begin
mkdir -p "$SCRATCH/config" "$SCRATCH/data" "$SCRATCH/models" "$SCRATCH/shots"
export THERMOCLINE_CONFIG_DIR="$SCRATCH/config" THERMOCLINE_DATA_DIR="$SCRATCH/data"
export THERMOCLINE_MODELS_DIR="$SCRATCH/models" HF_ENDPOINT=http://no-such-host.invalid
# A fresh start, except: the model, and answers long enough that Esc lands inside one.
printf '{"model.active": "%s", "chat.max_new_tokens": 4000, "chat.temperature": 1.0}\n' "$MODEL" \
    > "$SCRATCH/config/settings.json"

XVFB_PID=
APP_PID=
cleanup() {
    [ -n "$APP_PID" ] && kill "$APP_PID" 2>/dev/null || true
    [ -n "$XVFB_PID" ] && kill "$XVFB_PID" 2>/dev/null || true
}
trap cleanup EXIT
if [ "${XDISPLAY:-}" = yes ]; then  # an X server someone else started (xvfb-run): its screen is the size
    [ -n "${DISPLAY:-}" ] || { echo "first use FAILED: XDISPLAY=yes but no DISPLAY"; exit 1; }
    read -r SW SH < <(xdpyinfo 2>/dev/null | awk '/dimensions:/ {split($2, s, "x"); print s[1], s[2]}') || true
    [ -n "${SW:-}" ] && SIZE="${SW}x${SH}"
else
    # -displayfd: Xvfb takes a free display itself and writes its number once it accepts clients
    # (a guessed number met stale locks, and a socket file appears before the server is ready)
    Xvfb -displayfd 3 -screen 0 "${SIZE}x24" -nolisten tcp 3>"$SCRATCH/display" >"$SCRATCH/xvfb.log" 2>&1 &
    XVFB_PID=$!
    for _ in $(seq 300); do [ -s "$SCRATCH/display" ] && break; sleep 0.1; done
    DISPLAY_NUM=$(head -n1 "$SCRATCH/display" 2>/dev/null || true)
    if [ -z "$DISPLAY_NUM" ]; then echo "first use FAILED: Xvfb did not start"; cat "$SCRATCH/xvfb.log"; exit 1; fi
    export DISPLAY=":$DISPLAY_NUM"
fi
export QT_QPA_PLATFORM=xcb
echo "first use: display $DISPLAY, screen $SIZE, model $MODEL, scratch $SCRATCH"
mark() {  # seconds since the program started, for the timings line
    TIMES="${TIMES:-}$1 $(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}') s; "
}

fail() { echo "first use FAILED: $*"; shot failed; tail -20 "$SCRATCH/app.log" || true; exit 1; }
shot() { "$PY" tools/grab_screen.py "$SCRATCH/shots/$1.png" 2>/dev/null || true; }
db() {  # one value from the saved conversations
    "$PY" -c "import sqlite3, sys; c = sqlite3.connect('file:$SCRATCH/data/conversations.db?mode=ro', uri=True)
r = c.execute(sys.argv[1]).fetchone(); print('' if r is None else r[0])" "$1" 2>/dev/null || true
}
wait_for() {  # seconds, then a shell condition
    local end=$(( $(date +%s) + $1 )); shift
    until eval "$@"; do [ "$(date +%s)" -ge "$end" ] && return 1; sleep 0.2; done
}

PYTHONFAULTHANDLER=1 "$PY" -m app.cli > "$SCRATCH/app.log" 2>&1 &
APP_PID=$!
T0=$(date +%s.%N)
wait_for "$LOAD_WAIT" 'xdotool search --onlyvisible --name "^Welcome" >/dev/null 2>&1' \
    || fail "no welcome window"
mark welcome
shot welcome
MAIN=$(xdotool search --onlyvisible --name "Thermocline$" | head -1)
read -r W H < <(xdotool getwindowgeometry "$MAIN" | awk '/Geometry/ {split($2, s, "x"); print s[1], s[2]}')
[ "$W" -le "${SIZE%x*}" ] && [ "$H" -le "${SIZE#*x}" ] || fail "the window is ${W}x${H}, larger than $SIZE"

wait_for "$LOAD_WAIT" 'grep -q "model ready" "$SCRATCH/app.log"' || fail "the model did not load"
mark "model ready"
xdotool key ctrl+n
sleep 0.3
xdotool type --delay 30 "Hello there"
assistant() { db "select $1 from messages where role = 'assistant' order by id desc limit 1"; }
users() { db "select count(*) from messages where role = 'user'"; }
last_user() { db "select max(id) from messages where role = 'user'"; }
# Esc at once first (it may land while the prompt is read); then, once one stop is in, tries
# that wait a little before Esc so that it lands inside the answer (kept and marked stopped).
delays=(0 0.6 0.3 0.15)
stopped=
for attempt in 1 2 3 4; do  # a small model may finish its answer before Esc lands: ask again
    [ "$attempt" = 1 ] || xdotool type --delay 30 "Go on"
    sent=$(users)
    xdotool key Return
    wait_for 10 '[ "$(users)" -gt "$sent" ]' || fail "Enter did not send the message"
    mark "sent ($attempt)"
    sleep "${delays[$((attempt - 1))]}"
    xdotool key Escape
    wait_for 30 '[ "$(db "select count(*) from messages where status = '"'streaming'"'")" = 0 ]' \
        || fail "the answer never ended"
    mark "answer ended ($attempt)"
    answer=$(db "select status from messages where role = 'assistant' and id > $(last_user)")
    shot "answer-$attempt"
    # Stopped mid-answer (kept, marked stopped), or while the prompt was read (no answer kept).
    if [ "$answer" = stopped ]; then stopped="${stopped}mid-answer (try $attempt)"; break; fi
    [ -z "$answer" ] && stopped="${stopped}before the answer began (try $attempt); "
done
[ -n "$stopped" ] || fail "Esc did not stop an answer in 4 tries"
echo "stopped: $stopped"
[ "$(db "select content from messages where role = 'user' order by id limit 1")" = "Hello there" ] \
    || fail "the message was not the one typed"
xdotool key ctrl+q
Q0=$(date +%s.%N)
if ! wait_for 10 '! kill -0 "$APP_PID" 2>/dev/null'; then
    kill -ABRT "$APP_PID"; sleep 1  # faulthandler writes every thread's stack to the log
    grep -A12 "most recent call first" "$SCRATCH/app.log" | head -80 || true
    fail "Ctrl+Q did not quit within 10 s"
fi
APP_PID=
mark exited
echo "timings: ${TIMES}Ctrl+Q to exit $(awk -v a="$Q0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}') s"
echo "first use: sent, stopped and quit (screenshots in $SCRATCH/shots)"
