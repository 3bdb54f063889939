"""Step timing, memory, progress lines and the end-of-run summary printed by ``recipes.run``.

NOTE [ What the summary's memory lines mean ]
    ``peak memory (step N)`` is measured on every device with ``remat.track_memory`` around the
    last training step (forward, backward, optimizer step): the peak of tensor storage allocated
    inside the step above what was live when it began (weights, optimizer state, the previous
    step's gradients are not counted; the new gradients and every activation are). On CPU it
    replays the allocator's profiler events, so that one step runs slower and is left out of the
    mean step time. The last step is chosen because the optimizer state already exists then (Adam
    allocates it on its first step). On CUDA the summary adds ``peak memory (fit)``:
    ``torch.cuda.max_memory_allocated`` over the whole fit, weights and optimizer state included.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import lightning as L
import torch

__all__ = ["RunStats", "Summary", "format_summary"]

# Steps averaged for the "final" training loss (the per-step loss is noisy).
FINAL_LOSS_WINDOW = 10


@dataclass
class Summary:
    """What a recipe run measured.

    Attributes:
        steps: Optimizer steps taken (``trainer.global_step``).
        step_times_s: Wall time of every training step (forward, backward, optimizer step; data
            loading excluded), in seconds.
        timed_steps: 0-based indices of the steps averaged by :attr:`mean_step_time_s` (not the
            first, warm-up step, nor the memory-measured step, when others remain).
        train_losses: Training loss of every step.
        val_metrics: Metrics of the final validation pass (``val_loss``, ``val_acc``, ...).
        step_peak_bytes: Peak bytes allocated inside the measured step, see
            NOTE [ What the summary's memory lines mean ]; ``None`` if no step ran.
        step_peak_step: 1-based number of the measured step.
        step_peak_error: Why the step's memory could not be measured (e.g. another profiler was
            running), else ``""``.
        fit_peak_bytes: ``torch.cuda.max_memory_allocated`` over ``fit`` (CUDA only), else ``None``.
        device: The root device of the run (``"cpu"``, ``"cuda:0"``).
        fit_time_s: Wall time of ``trainer.fit`` (includes callback setup such as solving).
        num_params: Trainable parameters of the LightningModule.
        extra: Task-specific facts to print (e.g. which data).
    """

    steps: int
    step_times_s: list[float]
    timed_steps: list[int]
    train_losses: list[float]
    val_metrics: dict[str, float]
    step_peak_bytes: int | None
    step_peak_step: int | None
    step_peak_error: str
    fit_peak_bytes: int | None
    device: str
    fit_time_s: float
    num_params: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_step_time_s(self) -> float:
        """Mean time of the :attr:`timed_steps`."""
        times = [self.step_times_s[i] for i in self.timed_steps]
        return sum(times) / len(times) if times else math.nan

    @property
    def first_train_loss(self) -> float:
        return self.train_losses[0] if self.train_losses else math.nan

    @property
    def final_train_loss(self) -> float:
        """Mean training loss of the last ``FINAL_LOSS_WINDOW`` steps."""
        tail = self.train_losses[-FINAL_LOSS_WINDOW:]
        return sum(tail) / len(tail) if tail else math.nan


def _loss_of(outputs: Any) -> float | None:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else None


class RunStats(L.Callback):
    """Times each training step, records its loss, measures the memory of the last step and prints
    a progress line every N steps; see NOTE [ What the summary's memory lines mean ].

    Args:
        print_every_n_steps: Print a progress line every N steps (0: never).
        printer: Where lines go (``print`` by default); only rank 0 prints.
    """

    def __init__(
        self, *, print_every_n_steps: int = 20, printer: Callable[[str], None] = print
    ) -> None:
        self.print_every_n_steps = print_every_n_steps
        self.printer = printer
        self.step_times_s: list[float] = []
        self.train_losses: list[float] = []
        self.fit_time_s = 0.0
        self.fit_peak_bytes: int | None = None
        self.step_peak_bytes: int | None = None
        self.step_peak_index: int | None = None  # 0-based
        self.step_peak_error = ""
        self._t0 = 0.0
        self._fit_t0 = 0.0
        self._memory_cm = None
        self._memory = None

    @staticmethod
    def _sync(trainer: L.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self._fit_t0 = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._sync(trainer)
        if trainer.global_step == trainer.max_steps - 1:  # the last step: measure its memory
            from remat import track_memory

            device = trainer.strategy.root_device
            if device.type == "cpu" and torch.autograd.profiler._is_profiler_enabled:
                # A second profiler session sees no events (the step would read as 0 bytes).
                self.step_peak_error = "another torch.profiler session was active in this step"
                self.step_peak_index = trainer.global_step
            else:
                self._memory_cm = track_memory(device)
                self._memory = self._memory_cm.__enter__()
        self._t0 = time.perf_counter()

    def _stop_memory(self) -> None:
        if self._memory_cm is not None:
            cm, self._memory_cm = self._memory_cm, None
            cm.__exit__(None, None, None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._sync(trainer)
        self.step_times_s.append(time.perf_counter() - self._t0)
        if self._memory_cm is not None:
            self._stop_memory()
            self.step_peak_index = len(self.step_times_s) - 1
            if self._memory.device == "cpu" and self._memory.num_events == 0:
                self.step_peak_error = "the profiler recorded no allocator events in this step"
            else:
                self.step_peak_bytes = self._memory.peak_bytes
        loss = _loss_of(outputs)
        if loss is not None:
            self.train_losses.append(loss)
        step = trainer.global_step
        every = self.print_every_n_steps
        if every and trainer.is_global_zero and (step % every == 0 or step == trainer.max_steps):
            shown = "n/a" if loss is None else f"{loss:.4f}"
            self.printer(
                f"step {step}/{trainer.max_steps}  train_loss {shown}  "
                f"step_time {1e3 * self.step_times_s[-1]:.1f} ms"
            )

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._stop_memory()  # never leave the profiler running

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.fit_time_s = time.perf_counter() - self._fit_t0
        device = trainer.strategy.root_device
        if device.type == "cuda":
            self.fit_peak_bytes = int(torch.cuda.max_memory_allocated(device))

    def timed_steps(self) -> list[int]:
        """Indices of the steps to average: not the first, not the memory-measured one."""
        steps = [
            i for i in range(len(self.step_times_s)) if i > 0 and i != self.step_peak_index
        ]
        return steps or list(range(len(self.step_times_s)))


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def format_summary(s: Summary) -> str:
    """The summary block, one ``key: value`` per line (stable for scripts and tests)."""
    excluded = len(s.step_times_s) - len(s.timed_steps)
    lines = [
        "== summary ==",
        f"steps: {s.steps}",
        f"mean step time: {1e3 * s.mean_step_time_s:.2f} ms (over {len(s.timed_steps)} steps"
        + (f"; first and memory-measured steps excluded)" if excluded else ")"),
        f"fit time: {s.fit_time_s:.2f} s",
        f"parameters: {s.num_params}",
        f"train_loss first: {s.first_train_loss:.4f}",
        f"train_loss final: {s.final_train_loss:.4f} "
        f"(mean of last {min(FINAL_LOSS_WINDOW, len(s.train_losses))} steps)",
    ]
    lines += [f"{k}: {v:.4f}" for k, v in sorted(s.val_metrics.items())]
    if s.step_peak_error:
        lines.append(f"peak memory (step {s.step_peak_step}): n/a ({s.step_peak_error})")
    elif s.step_peak_bytes is not None:
        lines.append(
            f"peak memory (step {s.step_peak_step}): {_mib(s.step_peak_bytes)} allocated inside "
            f"the step on {s.device} (remat.track_memory)"
        )
    if s.fit_peak_bytes is not None:
        lines.append(
            f"peak memory (fit): {_mib(s.fit_peak_bytes)} on {s.device} "
            "(torch.cuda.max_memory_allocated, weights and optimizer state included)"
        )
    lines += [f"{k}: {v}" for k, v in s.extra.items()]
    return "\n".join(lines)
