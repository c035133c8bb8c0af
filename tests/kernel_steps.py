"""A first start's kernel preparation under the test's control: the compile thread's steps
wait for the test's go, so what runs before the kernels are compiled is certain."""

from __future__ import annotations

import threading

from engine.runtime import engine as engine_module
from engine.runtime import kernel_preparation as kp


def forget_preparation(kind: str) -> None:
    """As on a machine where no preparation of this kind completed."""
    stamp, _content = kp._stamp(kind)
    stamp.unlink(missing_ok=True)


class HeldSteps:
    """The compile thread's two warm-up steps, each waiting for the test's go, for the next
    background load; `unpatch()` once it started, so that other loads run theirs at once."""

    def __init__(self, monkeypatch):
        self.prompt_go, self.all_go = threading.Event(), threading.Event()
        self.all_entered = threading.Event()  # the prompt's kernels and the fused decode are compiled
        run_prompt, run_all = engine_module._KernelWarmup.run_prompt, engine_module._KernelWarmup.run_all

        def held_prompt(mode, cpu_weights):
            self.prompt_go.wait()
            run_prompt(mode, cpu_weights)

        def held_all(mode, cpu_weights):
            self.all_entered.set()
            self.all_go.wait()
            run_all(mode, cpu_weights)

        self._originals = (run_prompt, run_all)
        monkeypatch.setattr(engine_module._KernelWarmup, "run_prompt", staticmethod(held_prompt))
        monkeypatch.setattr(engine_module._KernelWarmup, "run_all", staticmethod(held_all))

    def unpatch(self) -> None:
        run_prompt, run_all = self._originals
        engine_module._KernelWarmup.run_prompt = staticmethod(run_prompt)
        engine_module._KernelWarmup.run_all = staticmethod(run_all)

    def release(self) -> None:
        self.prompt_go.set()
        self.all_go.set()
