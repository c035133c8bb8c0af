"""Declarative settings: one schema, typed options, change listeners, a JSON file.

Every option the app remembers is declared once in `SCHEMA` with its type, default,
bounds and a line of help (the qutebrowser way): code reads `settings["chat.temperature"]`
and never invents keys. Values are validated on the way in, so a hand-edited or damaged
file can never put the app into a state it cannot show; bad entries fall back to their
defaults. The file lives in the platform's user config dir (`THERMOCLINE_CONFIG_DIR`
overrides it, for tests) and is written atomically on every change.

An option with a `section` appears on the Preferences page (app/gui/preferences.py) under
that heading, with a widget chosen from its type: adding a preference is one `Option` here.

This module does not import Qt: the window wraps the listeners in a Qt signal.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import platformdirs

log = logging.getLogger(__name__)

APP_NAME = "Thermocline"
CONFIG_DIR_ENV = "THERMOCLINE_CONFIG_DIR"
SETTINGS_FILE = "settings.json"

_MISSING = object()


@dataclass(frozen=True)
class Option:
    """One setting: its name, type, default and what values are allowed."""

    name: str
    type: type
    default: Any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple | None = None
    nullable: bool = False
    # Shown on the Preferences page when `section` is set: under that heading, as `label`,
    # with `choice_labels` (same order as `choices`) as the words for each choice.
    section: str = ""
    label: str = ""
    choice_labels: tuple | None = None
    # A value outside [minimum, maximum] that means "not set" (the text size's 0: the system's).
    unset: Any = None

    def validate(self, value: Any) -> Any:
        """The value converted to this option's type; ValueError says why not."""
        if isinstance(value, float) and not math.isfinite(value):  # 1e400 reads as inf; NaN passes every bound
            raise ValueError(f"{self.name} must be a finite number, not {value}")
        if value is None:
            if self.nullable:
                return None
            raise ValueError(f"{self.name} cannot be empty")
        if self.type is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{self.name} must be true or false, not {_shown(value)}")
        elif self.type is int:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
                raise ValueError(f"{self.name} must be a whole number, not {_shown(value)}")
            value = int(value)
        elif self.type is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{self.name} must be a number, not {_shown(value)}")
            value = float(value)
        elif self.type is str:
            if not isinstance(value, str):
                raise ValueError(f"{self.name} must be text, not {_shown(value)}")
        elif self.type is dict:
            if not isinstance(value, dict):
                raise ValueError(f"{self.name} must be a mapping, not {_shown(value)}")
        elif self.type is list:
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{self.name} must be a list of text, not {_shown(value)}")
            value = list(value)
        if self.unset is not None and value == self.unset:
            return value
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{self.name} must be at least {self.minimum}, not {value}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"{self.name} must be at most {self.maximum}, not {value}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.name} must be one of {', '.join(map(str, self.choices))}")
        return value


def _shown(value: Any) -> str:
    """A value from the file quoted in a warning, never echoed at length."""
    text = repr(value)
    return text if len(text) <= 80 else text[:70] + "..."


DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer clearly and concisely."

SCHEMA: tuple[Option, ...] = (
    # The model and how the engine runs it.
    Option("model.active", str, "demo", "The model loaded at start: demo, a catalogue id, a Hugging Face repo id or a folder.",
           section="Model", label="Model"),
    Option("engine.mode", str, "hybrid", "How the model's neurons are computed.",
           choices=("dense", "sparse", "hybrid", "oracle"), section="Model", label="Mode",
           choice_labels=("Dense: every neuron (slowest, needs nothing extra)",
                          "Sparse: predicted neurons, all on the CPU",
                          "Hybrid: predicted neurons, busy ones on the GPU",
                          "Oracle: exact neurons (for checking; slow)")),
    Option("engine.ctx", int, 2048, "Context length in tokens (prompt plus answer).", minimum=128, maximum=131072),
    Option("engine.cpu_weights", str, "int8", "Format of the weights kept on the CPU, in every mode "
           "(int4: llama.cpp's Q4_0 blocks; int8; fp32: exact).", choices=("int4", "int8", "fp32")),
    # Budgets: None means "use the hardware probe's suggestion".
    Option("budget.vram_bytes", int, None, "VRAM budget in bytes; empty for the suggested one.",
           minimum=0, nullable=True),
    Option("budget.ram_bytes", int, None, "RAM budget in bytes; empty for the suggested one.",
           minimum=0, nullable=True),
    # Defaults for new conversations (each conversation keeps its own copy).
    Option("chat.system_prompt", str, DEFAULT_SYSTEM_PROMPT, "System prompt of new conversations."),
    Option("chat.temperature", float, 0.7, "Sampling temperature; 0 is greedy.", minimum=0.0, maximum=5.0),
    Option("chat.top_p", float, 0.95, "Nucleus sampling: keep the smallest set of tokens with this mass.",
           minimum=0.0, maximum=1.0),
    Option("chat.top_k", int, 40, "Keep only the k most likely tokens; 0 keeps all.", minimum=0, maximum=100000),
    Option("chat.repetition_penalty", float, 1.0, "Penalty for repeating tokens; 1 is none.",
           minimum=0.5, maximum=3.0),
    Option("chat.min_p", float, 0.0, "Drop tokens less likely than this share of the likeliest one; 0 keeps all.",
           minimum=0.0, maximum=0.99),
    Option("chat.presence_penalty", float, 0.0, "Lowers every token already in the answer by this much "
           "(OpenAI's presence penalty, -2 to 2); 0 is none.", minimum=-2.0, maximum=2.0),
    Option("chat.frequency_penalty", float, 0.0, "Lowers a token by this much for each time it is already in the "
           "answer (OpenAI's frequency penalty, -2 to 2); 0 is none.", minimum=-2.0, maximum=2.0),
    Option("chat.seed", int, None, "Seed of the random choices: the same seed and settings give the same "
           "answer; empty picks a new one each time.", minimum=0, maximum=2**63 - 1, nullable=True),
    Option("chat.stop", list, [], "Strings that end the answer where they appear (at most 4; not shown)."),
    Option("chat.max_new_tokens", int, 512, "Longest answer in tokens.", minimum=1, maximum=32768),
    Option("chat.context_policy", str, "truncate",
           "What happens when a conversation no longer fits the model's context window.",
           choices=("truncate", "stop"), section="Chat", label="When a chat is too long",
           choice_labels=("Keep chatting: the model forgets the oldest messages",
                          "Stop and say so: start a new chat to go on")),
    Option("models.custom", list, [], "Models added by hand: Hugging Face repo ids and local folders."),
    Option("models.cpu_weights", dict, {}, "The CPU weight format chosen for a model (its spec: int4, int8 or "
           "fp32); the others use engine.cpu_weights."),
    # The window's local OpenAI-compatible server (its key is never saved).
    Option("server.host", str, "127.0.0.1", "Address the local server listens on; not loopback needs a key."),
    Option("server.port", int, 8080, "Port of the local server.", minimum=1, maximum=65535),
    Option("server.allowed_origins", list, [], "Web page origins (scheme://host[:port], or *) whose scripts "
           "may call the local server; none by default (see app/server/guard.py)."),
    # Window state.
    Option("ui.geometry", str, "", "Saved window geometry (base64)."),
    Option("ui.splitter", str, "", "Saved splitter sizes (base64)."),
    Option("ui.show_panel", bool, True, "Show the budgets and performance panel."),
    Option("ui.show_sidebar", bool, True, "Show the conversation list."),
    Option("ui.theme", str, "system", "Light or dark colours; System follows the desktop.",
           choices=("system", "light", "dark"), section="Appearance", label="Theme",
           choice_labels=("Same as the system", "Light", "Dark")),
    Option("ui.font_size", int, 0, "Text size in points (7 to 24); 0 keeps the system's size.", minimum=7,
           maximum=24, unset=0, section="Appearance", label="Text size"),
    Option("ui.welcome_shown", bool, False, "The first-start welcome has been shown."),
    Option("ui.last_conversation", int, None, "Conversation open when the app was closed.", nullable=True),
)

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "max_new_tokens", "seed", "stop")


def config_dir() -> Path:
    override = os.environ.get(CONFIG_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))


Listener = Callable[[str, Any], None]


class Settings:
    """The app's settings: `settings[name]`, `settings[name] = value`, `on_change(fn)`."""

    def __init__(self, path: str | os.PathLike | None = None, schema: tuple[Option, ...] = SCHEMA):
        self.path = Path(path) if path else config_dir() / SETTINGS_FILE
        self._options = {opt.name: opt for opt in schema}
        self._values: dict[str, Any] = {}
        self._listeners: list[Listener] = []
        self._load()

    # -- reading -------------------------------------------------------------------------
    def option(self, name: str) -> Option:
        try:
            return self._options[name]
        except KeyError:
            raise KeyError(f"unknown setting {name!r}") from None

    def options(self) -> list[Option]:
        return list(self._options.values())

    def __getitem__(self, name: str) -> Any:
        opt = self.option(name)
        value = self._values.get(name, opt.default)
        return list(value) if isinstance(value, list) else value  # callers cannot mutate the store

    def get(self, name: str, default: Any = _MISSING) -> Any:
        if default is not _MISSING and name not in self._options:
            return default
        return self[name]

    def is_default(self, name: str) -> bool:
        return name not in self._values

    def cpu_weights_for(self, spec: str) -> str:
        """The CPU weight format of one model: its own choice (the Models page), else the default."""
        chosen = (self["models.cpu_weights"] or {}).get(str(spec))
        choices = self.option("engine.cpu_weights").choices
        return chosen if chosen in choices else self["engine.cpu_weights"]

    def set_cpu_weights(self, spec: str, fmt: str) -> None:
        if fmt not in self.option("engine.cpu_weights").choices:
            raise ValueError(f"CPU weights must be one of {', '.join(self.option('engine.cpu_weights').choices)}")
        chosen = dict(self["models.cpu_weights"] or {})
        chosen[str(spec)] = fmt
        self["models.cpu_weights"] = chosen

    def sampling_defaults(self) -> dict:
        """The sampling settings new conversations start with."""
        return {key: self[f"chat.{key}"] for key in SAMPLING_KEYS}

    # -- writing -------------------------------------------------------------------------
    def __setitem__(self, name: str, value: Any) -> None:
        self.set(name, value)

    def set(self, name: str, value: Any) -> bool:
        """Validate, store, save and notify; returns False when nothing changed."""
        opt = self.option(name)
        value = opt.validate(value)
        if self[name] == value:
            return False
        if value == opt.default:
            self._values.pop(name, None)
        else:
            self._values[name] = value
        self._save()
        self._notify(name, value)
        return True

    def reset(self, name: str) -> None:
        opt = self.option(name)
        if name in self._values:
            del self._values[name]
            self._save()
            self._notify(name, opt.default)

    def on_change(self, listener: Listener) -> Callable[[], None]:
        """Call `listener(name, value)` after each change; returns an unsubscribe function."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    # -- persistence ---------------------------------------------------------------------
    def _notify(self, name: str, value: Any) -> None:
        for listener in list(self._listeners):
            try:
                listener(name, value)
            except Exception:  # one broken listener must not stop the others
                log.exception("settings listener failed for %s", name)

    def _load(self) -> None:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable settings file %s: %s", self.path, exc)
            return
        if not isinstance(raw, dict):
            log.warning("ignoring settings file %s: not a JSON object", self.path)
            return
        for name, value in raw.items():
            opt = self._options.get(name)
            if opt is None:
                continue  # a setting from another version: keep going
            try:
                self._values[name] = opt.validate(value)
            except ValueError as exc:
                log.warning("%s: ignoring %s (the default applies): %s", self.path, _shown(name), exc)

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(self._values, indent=2, sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:  # a read-only config dir must not break the running app
            log.warning("could not save settings to %s: %s", self.path, exc)
