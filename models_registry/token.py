"""The Hugging Face token for gated repos.

Looked up in this order: the `HF_TOKEN` environment variable, the token saved by
Thermocline (a file readable only by the user, in the platform's config folder:
~/.config/Thermocline on Linux, %APPDATA%\\Thermocline on Windows, ~/Library/Application
Support/Thermocline on macOS), then the token saved by `hf auth login` (huggingface_hub).
"""

from __future__ import annotations

import os
from pathlib import Path

from .paths import config_dir

TOKEN_FILE = "hf_token"


def token_path() -> Path:
    return config_dir() / TOKEN_FILE


def save_token(token: str) -> Path:
    """Store a token for later sessions, with owner-only permissions."""
    token = token.strip()
    if not token:
        raise ValueError("empty token")
    path = token_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token)
    os.replace(tmp, path)
    return path


def clear_token() -> None:
    try:
        token_path().unlink()
    except FileNotFoundError:
        pass


def get_token() -> str | None:
    env = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if env:
        return env.strip()
    try:
        saved = token_path().read_text(encoding="utf-8").strip()
    except OSError:
        saved = ""
    if saved:
        return saved
    try:
        from huggingface_hub import get_token as hf_get_token

        return hf_get_token()
    except Exception:  # noqa: BLE001 - an unreadable huggingface config is not our error to raise
        return None
