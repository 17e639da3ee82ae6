"""Stopping on a scheduler's signal: SIGTERM (how SLURM, Kubernetes and most schedulers stop or
preempt a job), SIGUSR1 (what `sbatch --signal=USR1@<s>` sends ahead of the time limit) and SIGUSR2
(submitit's preemption signal, `hydra/launcher=slurm`).

The handler only records the signal; the training loop acts on it between steps: it finishes the
step in flight, saves a checkpoint of the last completed step, lets that save complete, prints one
line, and the process exits with `EXIT_REQUEUE`. Then a handler that was installed before ours
(submitit's, which requeues the job) runs too.

With several processes the signal may reach them at different steps, yet they must stop after the
same one (saving is collective). So each step also dispatches a max over every process's flag,
read together with that step's metrics: all processes see the same vote at the same step.
"""

import _thread
import contextlib
import signal
import sys
import threading
from typing import Any, Optional

import numpy as np

# sysexits.h EX_TEMPFAIL, "a temporary failure: try again later": the run saved a checkpoint of its last
# completed step and resumes from it when started again. 0: trained to the end; 1: failed; 2: bad input.
EXIT_REQUEUE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

# What the run is doing and what a Ctrl-C there leaves: the one line a KeyboardInterrupt that reaches
# zoo.tools.cli ends the process with (exit code 130). Set by zoo.train.run as the run goes on.
PHASE = "starting"
PHASE_AFTER_START = "no step ran; run the command again"
PHASE_AFTER = PHASE_AFTER_START


def set_phase(doing: str, after: str = PHASE_AFTER_START) -> None:
    """Enter the next phase; a Ctrl-C Python swallowed during the last one (`ctrl_c_noted`) is raised here."""
    global PHASE, PHASE_AFTER
    raise_if_interrupted()
    PHASE, PHASE_AFTER = doing, after


# Python drops a KeyboardInterrupt raised inside a garbage-collector callback (JAX registers one) with an
# "Exception ignored" report, and the command goes on as if no Ctrl-C came. Under `ctrl_c_noted` a Ctrl-C
# is also noted here, so the next `set_phase` / `raise_if_interrupted` raises it again.
_PRESSED = False


def raise_if_interrupted() -> None:
    """KeyboardInterrupt when a Ctrl-C came under `ctrl_c_noted` (one Python swallowed, if it got here)."""
    if _PRESSED:
        raise KeyboardInterrupt


def ctrl_c_served() -> None:
    """The command is acting on the Ctrl-C noted so far (train.py finishing the save in flight before it
    stops): the next `set_phase` starts a phase that only another Ctrl-C interrupts."""
    global _PRESSED
    _PRESSED = False


@contextlib.contextmanager
def ctrl_c_noted(again_at_once: bool = False):
    """For the commands (zoo.tools.cli: `run_tool`, and `main` for train.py): Ctrl-C raises
    KeyboardInterrupt as Python's own handler does, and is noted, and the "Exception ignored" report of
    one Python swallowed is left out (the note raises it again at the next `set_phase`; with `again_at_once`,
    a tool's, as soon as the code that swallowed it has returned). Left as it is where SIGINT is ignored
    (a shell's background job) or handled by someone else, and outside the main thread."""
    global _PRESSED
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return

    def note(signum, frame):
        global _PRESSED
        _PRESSED = True
        raise KeyboardInterrupt

    unraisable = sys.unraisablehook
    again = _InterruptAgain() if again_at_once else None

    def hook(u):
        if not (_PRESSED and isinstance(u.exc_value, KeyboardInterrupt)):
            unraisable(u)
        elif again is not None:
            again.ask()

    signal.signal(signal.SIGINT, note)
    sys.unraisablehook = hook
    try:
        yield
    finally:
        if again is not None:
            again.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # A hook installed on top of this one (zoo.train.checkpoint_errors', quieting what a failed restore
        # leaves behind until the interpreter exits) stays: this one, under it, passes all through now.
        if sys.unraisablehook is hook:
            sys.unraisablehook = unraisable
        _PRESSED = False


@contextlib.contextmanager
def ctrl_c_deferred():
    """Hold a Ctrl-C (SIGINT) back until the block is done, then deliver it again to the handler that
    was there before (Python's own raises KeyboardInterrupt; a process that ignores SIGINT, e.g. one
    started in the background by a shell, goes on): the block always completes. Only the main thread
    receives signals; elsewhere the block runs as it is, and so it does where SIGINT's handler was not
    installed from Python (an embedding program's): Python could not put that one back."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    pressed = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
    if pressed:  # now, as it would have been handled without the block
        signal.raise_signal(signal.SIGINT)


class _InterruptAgain:
    """A thread that delivers Ctrl-C to the main thread again (`_thread.interrupt_main`) each time `ask` is
    called: from the main thread itself (the unraisable hook, right after Python swallowed one), interrupt_main
    would run the handler at once, inside the hook, which would swallow it too. Delivered from here, it lands once
    the main thread is back in Python: in the code that was running, or in the next callback that swallows it, which
    asks again."""

    def __init__(self):
        self.wanted = threading.Event()
        self.done = False
        threading.Thread(target=self._deliver, daemon=True, name="zoo-ctrl-c-again").start()

    def _deliver(self) -> None:
        while True:
            self.wanted.wait()
            self.wanted.clear()
            if self.done:
                return
            _thread.interrupt_main()

    def ask(self) -> None:
        while True:
            try:
                self.wanted.set()
                return
            except KeyboardInterrupt:
                continue  # the one asked for before landed here, in the hook: ask again

    def stop(self) -> None:
        self.done = True
        self.wanted.set()


class StopSignals:
    """Installed for the length of a run (`with StopSignals() as stop:`); `received` names the first
    signal caught. Outside the main thread (where Python cannot take signals) it does nothing."""

    def __init__(self, process_count: int = 1):
        self.received: Optional[str] = None
        self.signum: Optional[int] = None
        self.previous: dict[int, Any] = {}
        self.several = process_count > 1
        self._vote_fn = None

    def __enter__(self) -> "StopSignals":
        for s in STOP_SIGNALS:
            try:
                self.previous[s] = signal.signal(s, self._handler)
            except ValueError:  # not the main thread
                break
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)
        self.previous = {}

    def _handler(self, signum: int, frame) -> None:
        if self.received is None:
            self.signum, self.received = signum, signal.Signals(signum).name

    def requested_here(self) -> bool:
        """One process: a signal arrived, stop before the next step. (Several: only a vote counts.)"""
        return not self.several and self.received is not None

    def vote(self):
        """Dispatch this step's vote (several processes: the max of every process's flag, on the
        devices, not waited for); None for one process."""
        if not self.several:
            return None
        import jax

        if self._vote_fn is None:
            import jax.numpy as jnp
            from jax.sharding import Mesh, NamedSharding, PartitionSpec

            mesh = Mesh(np.array(jax.devices()), ("processes",))
            self._vote_sharding = NamedSharding(mesh, PartitionSpec("processes"))
            self._vote_fn = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, PartitionSpec()))
        local = np.full((jax.local_device_count(),), int(self.received is not None), np.int32)
        return self._vote_fn(jax.make_array_from_process_local_data(self._vote_sharding, local, (jax.device_count(),)))

    def agreed(self, vote) -> bool:
        """Whether to stop after the step `vote` came with: every process reads the same answer."""
        if not self.several:
            return self.received is not None
        return bool(np.asarray(vote))

    def chain(self) -> None:
        """Run the handler that was there before ours for the signal received (submitit's requeues
        the job and exits); default and ignore handlers are left alone."""
        prev = self.previous.get(self.signum) if self.signum is not None else None
        if callable(prev) and prev not in (signal.SIG_DFL, signal.SIG_IGN):
            prev(self.signum, None)
