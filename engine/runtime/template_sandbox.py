"""A jinja2 sandbox with a deadline and an output cap, for chat templates from the internet.

jinja2's ImmutableSandboxedEnvironment stops a template from touching Python's internals,
but not from running for ever (`{% for i in range(10**5) %}{% for j in range(10**5) %}`) or
from filling memory (`{{ 'A' * 10**9 }}`). Here every hook the sandbox offers is bounded:

- `call` (functions, methods, macros), `getattr`/`getitem`, the intercepted operators, every
  filter and test, and `range` check the render's deadline;
- an operator or call that would build a string or list longer than the cap is refused
  before it runs (`'A' * 10**9`, `'x'.ljust(10**9)`, `2 ** 10**9`, a huge format width);
- `namespace()` attributes, a common way to grow a string in a loop, are capped too;
- the output is pulled chunk by chunk from `Template.generate` and counted.

Breaking a bound raises `TemplateLimitError`; the tokenizer turns it into one error naming
the template. Bounds apply per render, on the thread that renders.
"""

from __future__ import annotations

import functools
import math
import re
import threading
import time

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

DEADLINE_S = 0.5
OUTPUT_CAP = 256 * 1024  # characters, on top of the conversation's own text (see render)
_BIG_WIDTH = re.compile(r"\d{7,}")  # a format width or precision of a million or more


class TemplateLimitError(TemplateError):
    """A render ran past its deadline or built more text than allowed."""


class _Budget(threading.local):
    deadline: float = math.inf
    cap: int = OUTPUT_CAP


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "+", "%", "//", "/", "-"])

    def __init__(self, **options):
        super().__init__(**options)
        self._budget = _Budget()
        self.globals["range"] = self._range
        self.globals["namespace"] = self._namespace
        self.filters = {name: self._bounded(f) for name, f in self.filters.items()}
        self.tests = {name: self._bounded(f) for name, f in self.tests.items()}

    # -- the render ---------------------------------------------------------------------
    def render(self, template, cap: int = OUTPUT_CAP, deadline_s: float = DEADLINE_S, **context) -> str:
        """Render `template` (from `from_string`) under a deadline and an output cap."""
        budget = self._budget
        budget.deadline, budget.cap = time.monotonic() + deadline_s, cap
        out, size = [], 0
        try:
            for chunk in template.generate(**context):
                size += len(chunk)
                if size > cap:
                    raise TemplateLimitError(f"it wrote more than {cap // 1024} KiB of text")
                self.tick()
                out.append(chunk)
        except RecursionError:
            raise TemplateLimitError("it recursed without end") from None
        except MemoryError:
            raise TemplateLimitError("it ran out of memory") from None
        except OverflowError as exc:
            raise TemplateLimitError(f"a number overflowed ({exc})") from None
        finally:
            budget.deadline = math.inf
        return "".join(out)

    def tick(self) -> None:
        if time.monotonic() > self._budget.deadline:
            raise TemplateLimitError(f"it ran longer than {DEADLINE_S * 1000:.0f} ms")

    def _too_big(self, n: int, what: str) -> None:
        if n > self._budget.cap:
            raise TemplateLimitError(f"it asked for {what} of {n:,} items (at most {self._budget.cap:,})")

    # -- sandbox hooks ------------------------------------------------------------------
    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
        __self.tick()
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool):
                __self._too_big(abs(value), "a call with a number")
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        self.tick()
        if attribute in ("format", "format_map") and isinstance(obj, str) and _BIG_WIDTH.search(obj):
            raise TemplateLimitError("it asked for a format width of a million or more")
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self.tick()
        if argument in ("format", "format_map") and isinstance(obj, str) and _BIG_WIDTH.search(obj):
            raise TemplateLimitError("it asked for a format width of a million or more")
        return super().getitem(obj, argument)

    def call_binop(self, context, operator, left, right):
        self.tick()
        seq = (str, list, tuple, bytes)
        if operator == "*":
            for a, b in ((left, right), (right, left)):
                if isinstance(a, seq) and isinstance(b, int):
                    self._too_big(len(a) * max(b, 0), "a repeated sequence")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
                and abs(left) > 1 and right * math.log2(abs(left)) > 4096:
            raise TemplateLimitError("it asked for a power with more than 4096 bits")
        elif operator == "+" and isinstance(left, seq) and isinstance(right, seq):
            self._too_big(len(left) + len(right), "a joined sequence")
        elif operator == "%" and isinstance(left, str):
            if _BIG_WIDTH.search(left):
                raise TemplateLimitError("it asked for a format width of a million or more")
            for value in right if isinstance(right, tuple) else (right,):  # '%*d' takes the width here
                if isinstance(value, int) and not isinstance(value, bool):
                    self._too_big(abs(value), "a format with a number")
        return super().call_binop(context, operator, left, right)

    def _range(self, *args):
        rng = range(*args)
        self._too_big(len(rng), "a range")
        return _BoundedRange(self, rng)

    def _namespace(self, *args, **kwargs):
        return _BoundedNamespace(self, *args, **kwargs)

    def _bounded(self, func):
        """A filter or test that checks the deadline and refuses huge numeric arguments."""
        @functools.wraps(func)  # keeps jinja_pass_arg, so context-taking filters still get it
        def wrapper(*args, **kwargs):
            self.tick()
            for value in (*args[1:], *kwargs.values()):
                if isinstance(value, int) and not isinstance(value, bool):
                    self._too_big(abs(value), "a filter with a number")
            return func(*args, **kwargs)

        return wrapper


class _BoundedNamespace(Namespace):
    """jinja2's namespace() whose string and list attributes stay under the output cap."""

    def __init__(*args, **kwargs):
        self, env, *rest = args
        object.__setattr__(self, "_env", env)
        Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name, value):
        env = object.__getattribute__(self, "_env")
        if isinstance(value, (str, list, tuple, bytes)):
            env._too_big(len(value), "a namespace value")
        env.tick()
        super().__setitem__(name, value)


class _BoundedRange:
    """range() whose iteration checks the deadline (loops with empty bodies call nothing else)."""

    def __init__(self, env: BoundedSandbox, rng: range):
        self._env, self._range = env, rng

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index):
        return self._range[index]

    def __iter__(self):
        for i, value in enumerate(self._range):
            if not i & 255:
                self._env.tick()
            yield value
