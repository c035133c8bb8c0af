#!/usr/bin/env bash
# End-to-end test of the Linux installer (not part of the fast suite; root, a few minutes):
# build the .deb, install it with apt, check the menu entry and icons, launch the installed
# app from its menu entry under Xvfb as an ordinary user, check its window appears and a
# chat answer streams from the demo model (screenshots saved), start it a second time (warm
# kernel cache), then purge the package and check nothing is left but the user's data.
#
#   packaging/test_linux.sh [--deb FILE] [--model FOLDER] [--keep-user]
#
# --deb FILE     test this .deb instead of building one (packaging/build_linux.sh)
# --model FOLDER chat with this model instead of the embedded demo (copied to the test
#                user's home and set as the active model; for use before the demo exists)
# Needs (apt): xvfb xdotool imagemagick (and desktop-file-utils for the entry check).
# Results: build/test-linux/ (result.json, screenshots, app logs).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
DEB=""
MODEL=""
KEEP_USER=0
while [ $# -gt 0 ]; do
    case "$1" in
        --deb) DEB="$(readlink -f "$2")"; shift 2 ;;
        --model) MODEL="$(readlink -f "$2")"; shift 2 ;;
        --keep-user) KEEP_USER=1; shift ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "error: unknown option $1" >&2; exit 2 ;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "error: run as root (installs a package)" >&2; exit 2; }
for tool in Xvfb xdotool import; do
    command -v "$tool" >/dev/null || { echo "error: $tool missing: apt-get install xvfb xdotool imagemagick" >&2; exit 2; }
done

OUT="$ROOT/build/test-linux"
rm -rf "$OUT"
mkdir -p "$OUT"
PKG=thermocline
TUSER="thermocline-e2e"
THOME="/tmp/thermocline-e2e-home"
DISPLAY_NUM="${DISPLAY_NUM:-93}"
FAILS=()
fail() { echo "FAIL: $*" >&2; FAILS+=("$*"); }
ok() { echo "ok: $*"; }

# -- build -------------------------------------------------------------------------------
if [ -z "$DEB" ]; then
    nice -n 10 packaging/build_linux.sh --no-appimage
    VERSION="$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -1)"
    DEB="$ROOT/dist/${PKG}_${VERSION}_amd64.deb"
fi
[ -f "$DEB" ] || { echo "error: no .deb at $DEB" >&2; exit 1; }
PKG="$(dpkg-deb -f "$DEB" Package)"
DEB_BYTES=$(stat -c %s "$DEB")

# -- an ordinary user to run the app as (made before the snapshot: useradd touches /etc) ----
cleanup() {
    [ -n "${XVFB_PID:-}" ] && kill "$XVFB_PID" 2>/dev/null || true
    if [ "$KEEP_USER" = 0 ] && id "$TUSER" >/dev/null 2>&1; then
        userdel "$TUSER" 2>/dev/null || true
        rm -rf "$THOME"
    fi
}
trap cleanup EXIT
id "$TUSER" >/dev/null 2>&1 && userdel "$TUSER" 2>/dev/null || true
rm -rf "$THOME"
useradd --home-dir "$THOME" --create-home --shell /bin/sh "$TUSER"
if [ -n "$MODEL" ]; then
    cp -r "$MODEL" "$THOME/model"
    mkdir -p "$THOME/.config/Thermocline"
    printf '{"model.active": "%s", "chat.max_new_tokens": 64}\n' "$THOME/model" > "$THOME/.config/Thermocline/settings.json"
    MODEL_USED="$MODEL (copied)"
else
    mkdir -p "$THOME/.config/Thermocline"
    printf '{"chat.max_new_tokens": 64}\n' > "$THOME/.config/Thermocline/settings.json"
    MODEL_USED="demo"
fi
chown -R "$TUSER:$TUSER" "$THOME"

# -- snapshot, install --------------------------------------------------------------------
snapshot() { find /opt /usr /etc /var/lib/dpkg/info -xdev \( -path /usr/lib/python3/dist-packages -prune \) -o -print 2>/dev/null \
    | grep -v -e '/__pycache__' -e '^/etc/ld.so.cache$' | sort; }
if dpkg -s thermocline >/dev/null 2>&1 || dpkg -s thermocline-cuda >/dev/null 2>&1; then
    echo "removing a Thermocline package installed before the test"
    apt-get purge -y -q thermocline thermocline-cuda >/dev/null 2>&1 || true
fi
snapshot > "$OUT/fs-before.txt"
t0=$(date +%s)
DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$DEB" > "$OUT/apt-install.log" 2>&1 \
    || { cat "$OUT/apt-install.log" >&2; echo "error: installing failed" >&2; exit 1; }
ok "installed $PKG in $(( $(date +%s) - t0 )) s"
INSTALLED_KIB=$(dpkg-query -W -f='${Installed-Size}' "$PKG")

[ -x /opt/thermocline/thermocline ] && ok "/opt/thermocline/thermocline" || fail "no /opt/thermocline/thermocline"
[ "$(readlink -f /usr/bin/thermocline)" = /opt/thermocline/thermocline ] && ok "/usr/bin/thermocline" || fail "no /usr/bin/thermocline link"
[ -f /usr/share/applications/thermocline.desktop ] && ok "menu entry" || fail "no menu entry"
if command -v desktop-file-validate >/dev/null; then
    desktop-file-validate /usr/share/applications/thermocline.desktop && ok "menu entry valid" || fail "menu entry invalid"
fi
[ -f /usr/share/icons/hicolor/scalable/apps/thermocline.svg ] && [ -f /usr/share/icons/hicolor/48x48/apps/thermocline.png ] \
    && ok "icons" || fail "icons missing"
[ -e /opt/thermocline/_internal/triton ] && [ "$PKG" = thermocline ] && fail "CPU package contains triton"
thermocline --help >/dev/null && ok "thermocline --help" || fail "thermocline --help"

# -- a display, the app (as the test user) ----------------------------------------------
Xvfb ":$DISPLAY_NUM" -screen 0 1280x800x24 -nolisten tcp -ac >"$OUT/xvfb.log" 2>&1 &
XVFB_PID=$!
for _ in $(seq 100); do [ -e "/tmp/.X11-unix/X$DISPLAY_NUM" ] && break; sleep 0.1; done

set +e
python3 packaging/linux/drive_installed.py --user "$TUSER" --home "$THOME" --display ":$DISPLAY_NUM" \
    --out "$OUT" > "$OUT/drive.json" 2> "$OUT/drive.log"
DRIVE_RC=$?
set -e
cat "$OUT/drive.log"
[ "$DRIVE_RC" = 0 ] && ok "window appeared and the model answered, twice (streaming seen)" || fail "GUI run: see $OUT/drive.log"
kill "$XVFB_PID" 2>/dev/null || true
XVFB_PID=""

# -- uninstall ----------------------------------------------------------------------------
DEBIAN_FRONTEND=noninteractive apt-get purge -y -q "$PKG" > "$OUT/apt-purge.log" 2>&1 || fail "purge failed"
dpkg -s "$PKG" >/dev/null 2>&1 && fail "package still installed"
snapshot > "$OUT/fs-after.txt"
# New paths since before the install that no installed package owns are what the package
# left behind (paths another package brought meanwhile belong to that package).
comm -13 "$OUT/fs-before.txt" "$OUT/fs-after.txt" > "$OUT/fs-added.txt"
: > "$OUT/fs-left.txt"
while IFS= read -r path; do
    dpkg -S "$path" >/dev/null 2>&1 || echo "$path" >> "$OUT/fs-left.txt"
done < "$OUT/fs-added.txt"
if [ -s "$OUT/fs-left.txt" ]; then
    fail "left behind after purge: $(head -c 600 "$OUT/fs-left.txt")"
else
    ok "nothing left in /opt /usr /etc /var/lib/dpkg/info ($(wc -l < "$OUT/fs-added.txt") new paths, all owned by other packages)"
fi
[ -e /opt/thermocline ] && fail "/opt/thermocline still exists"
USER_DATA="$(cd "$THOME" && find . -type f ! -path './.runtime/*' ! -name '.bash*' ! -name '.profile' | sort)"
echo "the user's data, kept (as it should be):"; echo "$USER_DATA" | sed 's/^/    /'

python3 - "$OUT" "$DEB" "$DEB_BYTES" "$INSTALLED_KIB" "$MODEL_USED" "${#FAILS[@]}" <<'EOF'
import json, sys
out, deb, deb_bytes, kib, model, fails = sys.argv[1:]
drive = {}
try:
    drive = json.loads(open(f"{out}/drive.json").read() or "{}")
except ValueError:
    pass
res = {"deb": deb, "deb_bytes": int(deb_bytes), "installed_bytes": int(kib) * 1024, "model": model,
       "gui": drive, "failures": int(fails), "ok": int(fails) == 0}
open(f"{out}/result.json", "w").write(json.dumps(res, indent=1))
print(json.dumps(res, indent=1))
EOF
if [ "${#FAILS[@]}" -gt 0 ]; then
    printf 'FAILED: %s\n' "${FAILS[@]}" >&2
    exit 1
fi
echo "PASS (screenshots and logs in $OUT)"
