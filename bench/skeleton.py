"""The skeleton bench/cpu.py, bench/gpu.py and bench/tpu.py share: their command line's common part,
one runner (a child process per XLA group, its spec and result as JSON files, stopped at the budget
with what it wrote kept), the alternated rounds, and one renderer (the record's tables printed, its
markdown and plot written). Each bench keeps its setups (data) and what is particular to its machine:
what a child measures, how its record derives and renders.

XLA reads its flags once per process, so each XLA group runs in a process of its own: the parent
writes `<name>_spec.json`, runs the same script with `--child KIND --spec .. --result ..`, and reads
`<name>_result.json`, which the child rewrites after every compile and step (`common.write_json`,
atomic), so a child stopped at the budget leaves what it had finished.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

from bench import common as C


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parser(doc: str, default_out: str) -> argparse.ArgumentParser:
    """The options every bench has: --out, --plot, --md, and the hidden ones of a child process (each
    bench adds its own --render: one record, a session's record of several, or records merged)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default=default_out, help=f"JSON results (default: {default_out})")
    ap.add_argument("--plot", default=None, help="PNG of the results (optional)")
    ap.add_argument("--md", default=None, help="write the markdown tables here too (optional)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return ap


def command_line(script: str, argv: Optional[Sequence[str]]) -> str:
    """How the record names the command that measured it."""
    return " ".join(["python", script, *(argv if argv is not None else sys.argv[1:])])


def child_main(
    args, children: dict[str, Callable[[dict, pathlib.Path], dict]], before: Optional[Callable] = None
) -> int:
    """A child process: its spec in, `children[args.child](spec, result path)`'s record out."""
    spec = json.loads(pathlib.Path(args.spec).read_text())
    result = pathlib.Path(args.result)
    if before is not None:
        before(spec)
    C.write_json(result, children[args.child](spec, result))
    return 0


@dataclasses.dataclass
class Runner:
    """Runs `script`'s children, one process each, in `workdir`; `res` is the record written to `out`
    (after `derive`) each time `save` is called."""

    script: pathlib.Path
    workdir: pathlib.Path
    out: pathlib.Path
    res: dict
    derive: Callable[[dict], None] = lambda res: None

    def child(
        self, kind: str, spec: dict, env: dict, timeout: float, name: str = "", process: Optional[dict] = None
    ) -> dict:
        """Run `--child kind` with `spec`; past `timeout` seconds (at least 30) it is stopped. Returns what it
        wrote (partial where it was stopped), with `process`: its return code ("timeout" where stopped),
        wall seconds and the items of `process`."""
        name = name or kind
        spec_path, result_path = self.workdir / f"{name}_spec.json", self.workdir / f"{name}_result.json"
        spec_path.write_text(json.dumps(spec))
        result_path.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            str(self.script),
            "--child",
            kind,
            "--spec",
            str(spec_path),
            "--result",
            str(result_path),
        ]
        t = time.perf_counter()
        try:
            rc = subprocess.run(cmd, env={**os.environ, **env}, timeout=max(30.0, timeout)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        out = json.loads(result_path.read_text()) if result_path.exists() else {}
        out["process"] = {"returncode": rc, "wall_s": time.perf_counter() - t, **(process or {})}
        if rc != 0:
            log(f"{name}: process ended with {rc}; keeping what it wrote")
        return out

    def save(self) -> None:
        self.derive(self.res)
        C.write_json(self.out, self.res)


def workdir_for(out: pathlib.Path, given: Optional[str] = None) -> pathlib.Path:
    """Where the children's specs and results go: `given`, else beside --out."""
    path = pathlib.Path(given) if given else out.parent / (out.stem + "_work")
    path.mkdir(parents=True, exist_ok=True)
    return path


def round_order(labels: Sequence[str], r: int, rotate: bool = True) -> list[str]:
    """The order of round `r` (from 0) of alternated rounds: every label once. Rotated by one per round
    and reversed every other round where `rotate` (so load from other processes, and a slow drift of the
    machine, falls on every label alike), else as given."""
    labels = list(labels)
    if not rotate or not labels:
        return labels
    k = r % len(labels)
    order = labels[k:] + labels[:k]
    return order[::-1] if r % 2 else order


def past(deadline: Optional[float], margin: float = 0.0) -> bool:
    """Whether the budget's deadline (a time.time()) is within `margin` seconds."""
    return deadline is not None and time.time() > deadline - margin


def mark_unfinished(setup: Optional[dict], budget_s: float) -> None:
    """A setup's runs that were traced and whose compile had not finished when the child process was
    stopped (each finished compile is recorded as it comes) become `timeout`, the others stay."""
    for run in ((setup or {}).get("runs") or {}).values():
        if "status" not in run:
            run.update(status="timeout", error=f"compile unfinished at --budget-s ({budget_s:.0f} s)")


def first_line(e: BaseException, limit: int = 400) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:limit]}" if str(e).strip() else type(e).__name__


def finish(res: dict, args, markdown: Callable[[dict], str], plot: Optional[Callable]) -> None:
    """The end of a run: the record's tables printed (and written to --md), its plot to --plot."""
    md = markdown(res)
    print(md)
    if args.md:
        pathlib.Path(args.md).write_text(md + "\n")
    if args.plot and plot is not None:
        plot(res, pathlib.Path(args.plot))
    log(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else "") + f"; {res['wall_s']:.0f}s in all")


def render(res: dict, args, markdown: Callable[[dict], str], plot: Optional[Callable] = None) -> int:
    """`--render`: the tables of a recorded run (nothing runs), and its plot where --plot is given and the
    bench draws one."""
    print(markdown(res))
    if getattr(args, "plot", None) and plot is not None:
        plot(res, pathlib.Path(args.plot))
    return 0


def save_figure(fig, path: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pyplot():
    """matplotlib's pyplot without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timed_steps(exe, state, tokens, warmup: int, steps: int, block_state: bool = True):
    """`warmup` untimed steps of the compiled step `exe`, then `steps` timed ones, each waited for (its
    new state and metrics, or the metrics alone where not `block_state`). Returns (state, the last
    step's metrics, seconds of each timed step)."""
    import jax

    m, times = None, []
    for i in range(warmup + steps):
        t = time.perf_counter()
        state, m = exe(state, tokens)
        jax.block_until_ready((state, m) if block_state else m)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return state, m, times


def is_oom(e: BaseException) -> bool:
    """Whether an error is the device running out of memory (XLA's compile or the runtime's)."""
    s = str(e)
    return "RESOURCE_EXHAUSTED" in s or "Ran out of memory" in s or "out of memory" in s.lower()


def state_ok(state) -> bool:
    """Whether a train state is there and none of its arrays was donated to a step that failed."""
    import jax

    return state is not None and not any(
        getattr(x, "is_deleted", lambda: False)() for x in jax.tree_util.tree_leaves(state)
    )
