#!/usr/bin/env bash
# Build Thermocline for Linux: the application bundle (PyInstaller), the .deb and, when
# `appimagetool` is on PATH, the AppImage. One command, from a clean checkout:
#
#   packaging/build_linux.sh                  # CPU flavour  -> dist/thermocline_<v>_amd64.deb
#   packaging/build_linux.sh --flavour cuda   # GPU flavour  -> dist/thermocline-cuda_<v>_amd64.deb
#
# Options: --skip-bundle (reuse build/dist-<flavour>/thermocline), --no-appimage, --no-deb.
# Environment: THERMOCLINE_BUILD_VENV (build virtualenv, created if missing; default
# build/pkg-venv for cpu, build/pkg-venv-cuda for cuda), TORCH_SPEC (default torch==2.13.0),
# TORCH_INDEX_URL (optional pip index for torch), PYTHON (interpreter for the new venv),
# DEB_COMPRESSION (xz, the default, read by every dpkg; gzip or zstd build faster) and
# DEB_LEVEL (default 6; xz -6 of the 1 GB bundle takes ~15 min on a busy 2-core machine).
# Needs: python3 (3.10+), dpkg-deb, objdump (binutils); not dpkg-dev or fakeroot.
# Heavy (torch + Qt): run it niced on a shared machine.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

FLAVOUR=cpu
BUNDLE_STEP=1
DEB_STEP=1
APPIMAGE_STEP=1
while [ $# -gt 0 ]; do
    case "$1" in
        --flavour) FLAVOUR="$2"; shift 2 ;;
        --flavour=*) FLAVOUR="${1#*=}"; shift ;;
        --skip-bundle) BUNDLE_STEP=0; shift ;;
        --no-deb) DEB_STEP=0; shift ;;
        --no-appimage) APPIMAGE_STEP=0; shift ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$FLAVOUR" in cpu|cuda) ;; *) echo "error: --flavour must be cpu or cuda" >&2; exit 2 ;; esac

VERSION="$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -1)"
PKG=thermocline
[ "$FLAVOUR" = cuda ] && PKG=thermocline-cuda
OTHER=thermocline-cuda
[ "$FLAVOUR" = cuda ] && OTHER=thermocline
DEFAULT_VENV="$ROOT/build/pkg-venv"
[ "$FLAVOUR" = cuda ] && DEFAULT_VENV="$ROOT/build/pkg-venv-cuda"
VENV="${THERMOCLINE_BUILD_VENV:-$DEFAULT_VENV}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
BUNDLE="$ROOT/build/dist-$FLAVOUR/thermocline"
mkdir -p "$ROOT/build" "$ROOT/dist"
log() { printf '\n== %s\n' "$*"; }
t_start=$(date +%s)

# -- 1. build environment ----------------------------------------------------------------
if [ "$BUNDLE_STEP" = 1 ]; then
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating the build environment $VENV"
        "${PYTHON:-python3}" -m venv "$VENV"
    fi
    log "installing Thermocline, $TORCH_SPEC and the packaging tools into $VENV"
    torch_args=("$TORCH_SPEC")
    [ -n "${TORCH_INDEX_URL:-}" ] && torch_args+=(--index-url "$TORCH_INDEX_URL")
    "$VENV/bin/pip" install -q "${torch_args[@]}"
    "$VENV/bin/pip" install -q -e . -r packaging/requirements.txt
    "$VENV/bin/python" - "$FLAVOUR" <<'EOF'
import sys, torch
flavour = sys.argv[1]
if (flavour == "cuda") != bool(torch.version.cuda):
    sys.exit(f"error: --flavour {flavour} needs a {'CUDA' if flavour == 'cuda' else 'CPU'} build of torch; "
             f"the build environment has torch {torch.__version__} (set TORCH_SPEC / TORCH_INDEX_URL)")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
EOF

    # -- 2. icons and bundle ---------------------------------------------------------------
    log "rendering icons"
    "$VENV/bin/python" packaging/render_icons.py build/icons
    log "freezing the application (PyInstaller, several minutes)"
    THERMOCLINE_FLAVOUR="$FLAVOUR" "$VENV/bin/pyinstaller" --noconfirm --clean --log-level WARN \
        --distpath "build/dist-$FLAVOUR" --workpath "build/pyi-$FLAVOUR" packaging/thermocline.spec
fi
[ -x "$BUNDLE/thermocline" ] || { echo "error: no bundle at $BUNDLE (run without --skip-bundle)" >&2; exit 1; }

# -- 3. smoke test of the bundle ------------------------------------------------------------
log "smoke test of the bundle"
if [ "$FLAVOUR" = cpu ] && [ -e "$BUNDLE/_internal/triton" ]; then
    echo "error: the CPU bundle contains triton" >&2; exit 1
fi
[ -f "$BUNDLE/_internal/resources/icons/thermocline.svg" ] || { echo "error: resources/ missing from the bundle" >&2; exit 1; }
ls -d "$BUNDLE"/_internal/numba "$BUNDLE"/_internal/llvmlite >/dev/null
"$BUNDLE/thermocline" --help >/dev/null
smoke_home="$(mktemp -d)"
if [ -f "$BUNDLE/_internal/resources/demo/config.json" ]; then
    # From another folder than the checkout, as users start it.
    (cd "$smoke_home" && HOME="$smoke_home" XDG_CACHE_HOME="$smoke_home/cache" "$BUNDLE/thermocline" generate \
        --model demo --prompt "Hello" --max-new-tokens 8 --temperature 0 --json) > build/smoke-$FLAVOUR.json
    echo "demo model answers: $(head -c 300 build/smoke-$FLAVOUR.json)"
else
    echo "WARNING: the bundle has no demo model (resources/demo/ is empty): the app will start with none" >&2
fi
rm -rf "$smoke_home"
log "kernel caches for the CPU tiers (AVX-512, AVX2: packaging/kernel_tiers.py; minutes each)"
"$VENV/bin/python" packaging/kernel_caches.py "$BUNDLE"
bundle_kib=$(du -sk "$BUNDLE" | cut -f1)
echo "bundle: $BUNDLE ($((bundle_kib / 1024)) MiB)"

# -- 4. .deb ------------------------------------------------------------------------------
stage_icons() {  # $1 = destination share/icons/hicolor
    mkdir -p "$1/scalable/apps"
    cp resources/icons/thermocline.svg "$1/scalable/apps/thermocline.svg"
    for d in build/icons/hicolor/*/; do
        size="$(basename "$d")"
        mkdir -p "$1/$size/apps"
        cp "$d/apps/thermocline.png" "$1/$size/apps/thermocline.png"
    done
}

if [ "$DEB_STEP" = 1 ]; then
    log "building the .deb"
    [ -f build/icons/thermocline.png ] || "$VENV/bin/python" packaging/render_icons.py build/icons
    DEB_ROOT="$ROOT/build/deb-$FLAVOUR/root"
    rm -rf "$ROOT/build/deb-$FLAVOUR"
    mkdir -p "$DEB_ROOT/opt" "$DEB_ROOT/usr/bin" "$DEB_ROOT/usr/share/applications" \
        "$DEB_ROOT/usr/share/doc/$PKG" "$DEB_ROOT/DEBIAN"
    cp -a "$BUNDLE" "$DEB_ROOT/opt/thermocline"
    find "$DEB_ROOT/opt/thermocline" -type d -name __pycache__ -prune -exec rm -rf {} +
    ln -s /opt/thermocline/thermocline "$DEB_ROOT/usr/bin/thermocline"
    install -m 644 packaging/linux/thermocline.desktop "$DEB_ROOT/usr/share/applications/thermocline.desktop"
    stage_icons "$DEB_ROOT/usr/share/icons/hicolor"
    cat > "$DEB_ROOT/usr/share/doc/$PKG/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: Thermocline
License: Apache-2.0
Comment: Bundles CPython, PyTorch, PySide6 (Qt, LGPL-3.0), numba and llvmlite, NumPy and
 their dependencies under their own licenses, in /opt/thermocline/_internal.
EOF
    install -m 755 packaging/linux/postinst packaging/linux/prerm packaging/linux/postrm "$DEB_ROOT/DEBIAN/"
    chmod -R u+rwX,go+rX,go-w "$DEB_ROOT"
    installed_kib=$(du -sk --exclude=DEBIAN "$DEB_ROOT" | cut -f1)
    if [ "$FLAVOUR" = cuda ]; then
        desc_line="Local chat with sparse language models (NVIDIA GPU build)"
        desc_more=" This is the GPU build: PyTorch with CUDA, for NVIDIA GPUs (driver 525 or newer).
 Without a usable GPU it runs on the CPU. The thermocline package is the smaller CPU build."
    else
        desc_line="Local chat with sparse language models (CPU build)"
        desc_more=" This is the CPU build. For an NVIDIA GPU install thermocline-cuda instead
 (it replaces this package)."
    fi
    # libc6: the newest glibc symbol any bundled binary needs (those copied from the build
    # machine set it): the package installs on systems at least as new as the build machine.
    glibc_min="$(find "$DEB_ROOT/opt/thermocline" -type f \( -name '*.so*' -o -name thermocline \) -print0 \
        | xargs -0 objdump -T 2>/dev/null | grep -o 'GLIBC_2\.[0-9]*' | sort -t. -k2 -n -u | tail -1 | sed 's/GLIBC_//' || true)"
    cat > "$DEB_ROOT/DEBIAN/control" <<EOF
Package: $PKG
Version: $VERSION
Architecture: amd64
Maintainer: Thermocline developers <thermocline@users.noreply.invalid>
Section: utils
Priority: optional
Installed-Size: $installed_kib
Depends: libc6 (>= ${glibc_min:-2.28}), libgl1, libegl1, libfontconfig1, libfreetype6, libdbus-1-3, libxkbcommon0, libxkbcommon-x11-0, libx11-xcb1, libxcb1, libxcb-cursor0, libxcb-icccm4, libxcb-image0, libxcb-keysyms1, libxcb-randr0, libxcb-render-util0, libxcb-shape0, libxcb-xfixes0, libxcb-xinerama0, libxcb-xkb1
Conflicts: $OTHER
Replaces: $OTHER
Description: $desc_line
 Thermocline chats with large language models on your own computer, faster than their
 size allows, by computing only the feed-forward neurons that fire. A small demo model
 is included; bigger models download from the app's Models page.
 .
$desc_more
EOF
    DEB="$ROOT/dist/${PKG}_${VERSION}_amd64.deb"
    rm -f "$DEB"
    # xz: every dpkg reads it. --root-owner-group: files owned by root without fakeroot.
    t_deb=$(date +%s)
    dpkg-deb --root-owner-group "-Z${DEB_COMPRESSION:-xz}" "-z${DEB_LEVEL:-6}" --build "$DEB_ROOT" "$DEB" >/dev/null
    echo "compressed (${DEB_COMPRESSION:-xz} -${DEB_LEVEL:-6}) in $(( $(date +%s) - t_deb )) s"
    rm -rf "$ROOT/build/deb-$FLAVOUR"  # a second full copy of the bundle
    echo "deb: $DEB ($(( $(stat -c %s "$DEB") / 1048576 )) MiB, installs $((installed_kib / 1024)) MiB)"
fi

# -- 5. AppImage ---------------------------------------------------------------------------
if [ "$APPIMAGE_STEP" = 1 ]; then
    if command -v appimagetool >/dev/null 2>&1; then
        log "building the AppImage"
        APPDIR="$ROOT/build/appimage-$FLAVOUR/Thermocline.AppDir"
        rm -rf "$ROOT/build/appimage-$FLAVOUR"
        mkdir -p "$APPDIR/usr/lib"
        cp -a "$BUNDLE" "$APPDIR/usr/lib/thermocline"
        find "$APPDIR" -type d -name __pycache__ -prune -exec rm -rf {} +
        cat > "$APPDIR/AppRun" <<'EOF'
#!/bin/sh
HERE="$(dirname "$(readlink -f "$0")")"
exec "$HERE/usr/lib/thermocline/thermocline" "$@"
EOF
        chmod 755 "$APPDIR/AppRun"
        sed 's|^Exec=.*|Exec=thermocline|' packaging/linux/thermocline.desktop > "$APPDIR/thermocline.desktop"
        cp build/icons/thermocline.png "$APPDIR/thermocline.png"
        ln -s thermocline.png "$APPDIR/.DirIcon"
        stage_icons "$APPDIR/usr/share/icons/hicolor"
        suffix=""
        [ "$FLAVOUR" = cuda ] && suffix="-cuda"
        IMG="$ROOT/dist/Thermocline${suffix}-${VERSION}-x86_64.AppImage"
        ARCH=x86_64 appimagetool --no-appstream "$APPDIR" "$IMG"
        rm -rf "$ROOT/build/appimage-$FLAVOUR"
        echo "AppImage: $IMG ($(( $(stat -c %s "$IMG") / 1048576 )) MiB)"
    else
        echo "AppImage skipped: appimagetool is not on PATH (it is neither a PyPI nor a Debian package;" \
             "put it on PATH to build one)"
    fi
fi
log "done in $(( $(date +%s) - t_start )) s"
