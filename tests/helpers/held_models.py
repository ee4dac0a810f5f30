"""A models module (``--models-module``) for tests that need something to happen mid-task: the
held models are built-in ones (``held-mlp`` is ``mlp``: the same layers, the same weights from
the same seed) whose training stops at named steps while a hold file exists.

Loaded only into the processes a test starts (providers, a requester, ``meshlearn simulate`` and
its nodes), never into the test's own process: ``helpers.hold`` is the test's side. A process
whose environment names ``HOLD_FILE`` (a path P) and ``HOLD_AT_STEP`` (steps, ``7`` or ``7,40``)
holds each held model it builds before its training step S of those (a forward pass in training
mode with gradients, counted per model; evaluation does not count) while ``P-S`` exists: it says
"held at training step S" on stderr, leaves a marker beside the hold file (``P-S.held-PID``) and
waits until ``P-S`` is gone. Without that file (removed, or never made) it trains straight on, as
the built-in model does.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from meshlearn.models import build_model, register_model

HELD = ("mlp", "lenet", "simplecnn")
POLL = 0.05  # seconds between looks at a hold file
MOST = 600.0  # seconds a step is held at most (a test that never releases it is killed long before)


def _holding(name: str):
    def factory(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
        model = build_model(name, input_shape, num_classes)
        hold, steps = os.environ.get("HOLD_FILE"), os.environ.get("HOLD_AT_STEP")
        if hold and steps:
            model.register_forward_pre_hook(_hold_at(hold, {int(step) for step in steps.split(",")}))
        return model

    return factory


def _hold_at(hold: str, steps: set[int]):
    done = 0

    def before_forward(module: torch.nn.Module, _inputs) -> None:
        nonlocal done
        if not (module.training and torch.is_grad_enabled()):
            return
        done += 1
        barrier = Path(f"{hold}-{done}")
        if done not in steps or not barrier.exists():
            return
        print(f"held at training step {done} (while {barrier} exists)", file=sys.stderr, flush=True)
        Path(f"{barrier}.held-{os.getpid()}").touch()
        deadline = time.monotonic() + MOST
        while barrier.exists() and time.monotonic() < deadline:
            time.sleep(POLL)

    return before_forward


for _name in HELD:
    register_model(f"held-{_name}")(_holding(_name))
