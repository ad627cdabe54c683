"""The step loop's torch threads while a grammar compiles on a CPU engine.

A CPU engine's forward runs on every CPU (one OpenMP thread each), and each of its
operators ends at a barrier that waits for all of them. A grammar compiling beside it
takes a CPU from one of those threads for a scheduler slice at a time, and every barrier
that thread reaches late waits for it: measured on 2 CPUs (torch's 2 threads, the
10,000-choice grammar of tests/server/test_grammar_compile.py), steps of 5 ms took up
to 190 ms, and the compile, starved in turn, took 8.4 s instead of 3.0 s. Lowering the
compile's priority does not help (nice 10 still gets its slices), and ``SCHED_IDLE``
starves it for minutes beside spinning OpenMP threads.

So while a compile is under way the step loop gives the compile its CPUs: torch runs on
``threads - compile_threads()`` threads (1 of 2 here), then returns to all of them. Each
step is slower for those seconds, evenly (median 12.2 ms, largest 22.7 ms in the same
measurement), and the grammar compiles at full speed. Only on the CPU: a GPU engine's
forward does not run on torch's CPU threads. Tensor-parallel ranks on the CPU keep
their threads (the compile runs in rank 0's process, beside rank 0's threads only).
"""

from __future__ import annotations

import torch

from kvpilot.engine.structured_output.backend import compile_threads


class StepThreadShare:
    """Sets torch's thread count of the calling (step) thread for each step.

    ``torch.set_num_threads`` acts on the thread that calls it (OpenMP's per-thread
    setting), so ``update`` is called by the step loop itself, before each step.

    Args:
        device: the engine's device; anything but the CPU makes ``update`` a no-op.
        threads: torch threads outside compiles (default: the step thread's setting at
            its first ``update``).
    """

    def __init__(self, device: torch.device, threads: int | None = None) -> None:
        self.active = device.type == "cpu"
        self._threads = threads
        self._current = threads

    @property
    def threads(self) -> int:
        """torch threads of a step with no compile under way."""
        if self._threads is None:
            self._threads = self._current = torch.get_num_threads()
        return self._threads

    @property
    def threads_while_compiling(self) -> int:
        return max(1, self.threads - compile_threads())

    @property
    def current(self) -> int:
        """Threads the last ``update`` left torch with."""
        return self._current if self._current is not None else self.threads

    def update(self, compiling: bool) -> None:
        """Give the compile its CPUs while ``compiling``, and take them back after."""
        if not self.active:
            return
        wanted = self.threads_while_compiling if compiling else self.threads
        if wanted != self._current:
            torch.set_num_threads(wanted)
            self._current = wanted
