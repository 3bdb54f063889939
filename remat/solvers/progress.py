"""The progress bar of a solve."""
from __future__ import annotations

__all__ = ["SolveProgress"]


class SolveProgress:
    """One progress bar per solve (tqdm, if installed; it appears after 3 s): its steps are the
    solve's phases, each labelled, with the blocks solved so far; the description gives the time
    limit that caps the whole solve, whatever tqdm's estimate from the phases done says."""

    def __init__(self, enabled: bool, phases: int, time_limit: float) -> None:
        self._bar = None
        self._done = -1
        self._blocks = 0
        self._label = ""
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=phases, desc=f"remat: solving (at most {time_limit:g} s)",
                         unit="phase", leave=False, delay=3.0)

    def phase(self, label: str) -> None:
        """Start the next phase (the previous one is done)."""
        self._done += 1
        self._label = label
        if self._bar is not None:
            if self._done:
                self._bar.update(1)
            self._show()

    def add_phase(self) -> None:
        """One more phase than the bar was started with."""
        if self._bar is not None:
            self._bar.total += 1

    def block(self) -> None:
        """One more distinct block solved in this solve."""
        self._blocks += 1
        if self._bar is not None:
            self._show()

    def _show(self) -> None:
        self._bar.set_postfix_str(f"{self._label}; {self._blocks} blocks solved", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
