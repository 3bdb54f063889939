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

NOTE [ Setup and training time ]
    ``trainer.fit`` first sets up (Lightning's and the DataModule's setup, then every callback's
    ``setup`` and ``on_fit_start``: remat's warmup step, capture, profiling and solve, few-bit's
    replacement of the activations, CP's compression at ``fit_start``), then trains. A plain
    "fit time" hides a minute of solving behind a few seconds of training, so :class:`FitPhases`
    splits it: setup runs from the first callback hook of ``fit`` to the first training step,
    training from there to the end of the training loop (data loading and validation inside
    ``fit`` included), and the wrap-up after it (``on_fit_end``/``teardown``: CP's compression at
    ``fit_end``, remat putting the original modules back). It also times each plugin's own hooks
    in each phase (in training: CP compressing at step ``cp.when``, remat solving for a new batch
    size): Lightning calls a hook on the callbacks in list order, so a marker placed right after
    a plugin's callback (:meth:`FitPhases.after`) sees the time that callback took.

NOTE [ A progress bar on a terminal, lines in a log ]
    Lightning's own bar (``trainer.enable_progress_bar``) is off in the recipes: it draws on
    stdout, among the progress lines and the summary that scripts read, with no check for a
    terminal (in a pipe or a CI log each refresh is one more ``\r`` update), and with
    ``max_epochs=-1`` its total is each epoch's batches, not the run's ``max_steps``. When stderr
    is a terminal the runner draws its own bar there instead (:class:`ProgressBar`): the run's
    steps out of ``trainer.max_steps``, with the latest ``train_loss``; the progress lines every
    ``trainer.print_every_n_steps`` steps are printed above it, and so are Lightning's log lines
    during training (``HiRemateCallback``'s first-step line). In a pipe, a file or a test nothing
    is drawn: the progress lines are the whole report, as before.
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import lightning as L
import torch
from typing_extensions import override

__all__ = ["FitPhases", "ProgressBar", "RunStats", "Summary", "format_summary"]

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
        fit_time_s: Wall time of ``trainer.fit`` (the training loop), setup included.
        num_params: Trainable parameters of the LightningModule.
        extra: Task-specific facts to print (e.g. which data).
        setup_time_s: Part of ``fit_time_s`` before the first training step (plugin setup such as
            remat's capture and solve; see NOTE [ Setup and training time ]), or ``None`` when
            not measured.
        training_time_s: Part of ``fit_time_s`` from the first training step to the end of the
            training loop, or ``None``.
        plugin_setup_s: Plugin section -> seconds its callback spent in ``setup`` and
            ``on_fit_start`` (inside :attr:`setup_time_s`).
        plugin_training_s: Plugin section -> seconds its callback spent in the training-step
            hooks (inside :attr:`training_time_s`), e.g. CP compressing at a given step.
        plugin_wrapup_s: Plugin section -> seconds its callback spent in ``on_fit_end`` and
            ``teardown`` (after training).
        legend: Metric -> what it means (the task's ``metrics``); the summary's ``legend:`` line
            defines those it printed.
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
    setup_time_s: float | None = None
    training_time_s: float | None = None
    plugin_setup_s: dict[str, float] = field(default_factory=dict)
    plugin_training_s: dict[str, float] = field(default_factory=dict)
    plugin_wrapup_s: dict[str, float] = field(default_factory=dict)
    legend: dict[str, str] = field(default_factory=dict)

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


class FitPhases(L.Callback):
    """Times the setup and training phases of ``trainer.fit`` and each plugin callback's share of
    them; see NOTE [ Setup and training time ].

    Put it first in the Trainer's callbacks and :meth:`after` right behind each plugin's callback::

        phases = FitPhases()
        callbacks = [phases, remat_cb, phases.after("remat"), fewbit_cb, phases.after("fewbit")]

    Attributes:
        setup_time_s: From :meth:`fit_called` (else the first hook of ``fit``) to the first
            training step (``None`` until a step starts).
        training_time_s: From the first training step to the end of the training loop.
        plugin_setup_s: Name -> seconds in that callback's ``setup`` and ``on_fit_start``.
        plugin_training_s: Name -> seconds in its training-step hooks (``on_train_batch_start``,
            ``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``,
            ``on_before_zero_grad``, ``on_train_batch_end``), e.g. CP compressing at a step.
        plugin_wrapup_s: Name -> seconds in its ``on_fit_end`` and ``teardown``.
    """

    def __init__(self) -> None:
        self.setup_time_s: float | None = None
        self.training_time_s: float | None = None
        self.plugin_setup_s: dict[str, float] = {}
        self.plugin_training_s: dict[str, float] = {}
        self.plugin_wrapup_s: dict[str, float] = {}
        self._fit_t0: float | None = None
        self._train_t0: float | None = None
        self._last = 0.0  # when the hook now running on the callbacks passed the latest marker

    def fit_called(self) -> None:
        """Mark the call of ``trainer.fit`` (optional): setup then starts here rather than at the
        first callback hook, and includes Lightning's own preparation before it."""
        self._fit_t0 = time.perf_counter()

    def after(self, name: str) -> L.Callback:
        """A marker to place right after the callback of plugin ``name``."""
        return _AfterPlugin(self, name)

    def _add(self, name: str, bucket: dict[str, float]) -> None:
        now = time.perf_counter()
        bucket[name] = bucket.get(name, 0.0) + now - self._last
        self._last = now

    def _restart(self, *args: Any, **kwargs: Any) -> None:
        # FitPhases is the first callback: a hook is starting on the callbacks
        self._last = time.perf_counter()

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and self._fit_t0 is None:
            self._fit_t0 = time.perf_counter()
        self._restart()

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._restart()
        if self._train_t0 is None and self._fit_t0 is not None:
            self._train_t0 = self._last
            self.setup_time_s = self._train_t0 - self._fit_t0

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._train_t0 is not None:
            self.training_time_s = time.perf_counter() - self._train_t0

    on_fit_start = on_before_backward = on_after_backward = _restart
    on_before_optimizer_step = on_before_zero_grad = on_train_batch_end = _restart
    on_fit_end = teardown = _restart


class _AfterPlugin(L.Callback):
    """Adds the time since the previous marker to plugin ``name``'s share; see :class:`FitPhases`."""

    def __init__(self, phases: FitPhases, name: str) -> None:
        self.phases = phases
        self.name = name

    @property
    def state_key(self) -> str:  # one per plugin; Lightning keys callbacks by this
        return f"{type(self).__qualname__}[{self.name}]"

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.phases._add(self.name, self.phases.plugin_setup_s)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.phases._add(self.name, self.phases.plugin_wrapup_s)

    def _setup(self, *args: Any, **kwargs: Any) -> None:
        self.phases._add(self.name, self.phases.plugin_setup_s)

    def _training(self, *args: Any, **kwargs: Any) -> None:
        self.phases._add(self.name, self.phases.plugin_training_s)

    def _wrapup(self, *args: Any, **kwargs: Any) -> None:
        self.phases._add(self.name, self.phases.plugin_wrapup_s)

    on_fit_start = _setup
    on_train_batch_start = on_before_backward = on_after_backward = _training
    on_before_optimizer_step = on_before_zero_grad = on_train_batch_end = _training
    on_fit_end = _wrapup


class ProgressBar:
    """The run's steps out of ``total`` as a tqdm bar on stderr, only where stderr is a terminal;
    see NOTE [ A progress bar on a terminal, lines in a log ].

    Args:
        total: The run's optimizer steps (``trainer.max_steps``).
        enabled: Draw it (the caller checks for a terminal: :func:`terminal`); when ``False``
            every method but :meth:`write`, which prints, does nothing.
    """

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self._bar = None
        self._logs: contextlib.ExitStack | None = None

    @staticmethod
    def terminal() -> bool:
        """Whether stderr, where the bar is drawn, is a terminal."""
        return sys.stderr.isatty()

    def start(self, done: int = 0) -> None:
        """Draw the bar, ``done`` steps already taken."""
        if not self.enabled or self._bar is not None:
            return
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._bar = tqdm(total=self.total, initial=done, desc="training", unit="step",
                         dynamic_ncols=True, file=sys.stderr)
        self._logs = contextlib.ExitStack()  # log lines above the bar, not through it
        self._logs.enter_context(logging_redirect_tqdm(
            loggers=[logging.root, logging.getLogger("lightning.pytorch")]))

    def update(self, loss: float | None) -> None:
        if self._bar is not None:
            if loss is not None:
                self._bar.set_postfix(train_loss=f"{loss:.4f}", refresh=False)
            self._bar.update(1)

    def write(self, line: str, printer: Callable[[str], None]) -> None:
        """``printer(line)``, above the bar when one is drawn."""
        if self._bar is None:
            printer(line)
            return
        with self._bar.external_write_mode():
            printer(line)

    def close(self) -> None:
        if self._logs is not None:
            self._logs.close()
            self._logs = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _loss_of(outputs: Any) -> float | None:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else None


class RunStats(L.Callback):
    """Times each training step, records its loss, measures the memory of the last step and prints
    a progress line every N steps; see NOTE [ What the summary's memory lines mean ].

    Args:
        print_every_n_steps: Print a progress line every N steps (0: never).
        printer: Where lines go (``print`` by default); only rank 0 prints.
        progress_bar: Draw a :class:`ProgressBar` over the run's steps on stderr during training
            (rank 0; the caller checks that stderr is a terminal).
    """

    def __init__(
        self, *, print_every_n_steps: int = 20, printer: Callable[[str], None] = print,
        progress_bar: bool = False,
    ) -> None:
        self.print_every_n_steps = print_every_n_steps
        self.printer = printer
        self.progress_bar = progress_bar
        self._bar: ProgressBar | None = None
        self.step_times_s: list[float] = []
        self.train_losses: list[float] = []
        self.fit_peak_bytes: int | None = None
        self.step_peak_bytes: int | None = None
        self.step_peak_index: int | None = None  # 0-based
        self.step_peak_error = ""
        self._t0 = 0.0
        self._memory_cm = None
        self._memory = None

    @staticmethod
    def _sync(trainer: L.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # NOTE [ A progress bar on a terminal, lines in a log ]
        self._bar = ProgressBar(trainer.max_steps,
                                enabled=self.progress_bar and trainer.is_global_zero)
        self._bar.start(done=trainer.global_step)  # a resumed run starts where it was

    @override
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

    @override
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
        bar = self._bar or ProgressBar(trainer.max_steps, enabled=False)
        bar.update(loss)
        every = self.print_every_n_steps
        if every and trainer.is_global_zero and (step % every == 0 or step == trainer.max_steps):
            shown = "n/a" if loss is None else f"{loss:.4f}"
            bar.write(
                f"step {step}/{trainer.max_steps}  train_loss {shown}  "
                f"step_time {1e3 * self.step_times_s[-1]:.1f} ms", self.printer
            )

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close_bar()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    @override
    def on_exception(self, trainer, pl_module, exception) -> None:
        self._stop_memory()  # never leave the profiler running
        self._close_bar()

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
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


def _hooks(times: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in times.items())


def _time_lines(s: Summary) -> list[str]:
    """``fit time`` split into setup, training and wrap-up; NOTE [ Setup and training time ]."""
    if s.setup_time_s is None or s.training_time_s is None:
        return [f"fit time: {s.fit_time_s:.2f} s"]
    wrapup = max(0.0, s.fit_time_s - s.setup_time_s - s.training_time_s)
    per_step = 1e3 * s.training_time_s / max(1, s.steps)
    lines = [
        f"fit time: {s.fit_time_s:.2f} s = setup {s.setup_time_s:.2f} s + training "
        f"{s.training_time_s:.2f} s + wrap-up {wrapup:.2f} s",
        f"setup: {s.setup_time_s:.2f} s before the first step; "
        + (f"plugin hooks: {_hooks(s.plugin_setup_s)}" if s.plugin_setup_s else "no plugin"),
        f"training: {s.training_time_s:.2f} s for {s.steps} steps, {per_step:.2f} ms/step "
        "(data loading and validation during fit included)"
        + (f"; plugin hooks: {_hooks(s.plugin_training_s)}" if s.plugin_training_s else ""),
    ]
    if s.plugin_wrapup_s:
        lines.append(f"wrap-up: {wrapup:.2f} s after training; plugin hooks: "
                     f"{_hooks(s.plugin_wrapup_s)}")
    return lines


def format_summary(s: Summary) -> str:
    """The summary block, one ``key: value`` per line (stable for scripts and tests)."""
    excluded = len(s.step_times_s) - len(s.timed_steps)
    lines = [
        "== summary ==",
        f"steps: {s.steps}",
        f"mean step time: {1e3 * s.mean_step_time_s:.2f} ms (over {len(s.timed_steps)} steps"
        + ("; first and memory-measured steps excluded)" if excluded else ")"),
        *_time_lines(s),
        f"parameters: {s.num_params}",
        f"train_loss first: {s.first_train_loss:.4f}",
        f"train_loss final: {s.final_train_loss:.4f} "
        f"(mean of last {min(FINAL_LOSS_WINDOW, len(s.train_losses))} steps)",
    ]
    lines += [f"{k}: {v:.4f}" for k, v in sorted(s.val_metrics.items())]
    shown = [k for k in ("train_loss", *sorted(s.val_metrics)) if k in s.legend]
    if shown:  # every metric name printed above, defined
        lines.append("legend: " + "; ".join(f"{k} = {s.legend[k]}" for k in shown))
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
