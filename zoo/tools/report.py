"""Sweep results -> a markdown table and a PNG: step time against peak device memory, Pareto front marked.

    python -m zoo.tools.report multirun/2026-11-30/12-00-00   # writes report.md and report.png there
    python -m zoo.tools.report <dir> --out /tmp/report         # elsewhere
    python -m zoo.tools.report outputs/2026-11-30/12-00-00    # one run: its expert load over steps (expert_load.png)

Every `summary.json` under the directory is one job (train.py writes one per job, failed jobs too).
Step times on a shared machine are noisy, so each job's time is its interquartile range over the
timed steps (`step_time_quantiles_s`), shown with the median and the step count, and a time
difference counts only where the ranges do not overlap. A job is on the Pareto front when no other
successful job uses at most as much memory without being measurably slower, and is measurably faster
or uses strictly less memory. Jobs whose ranges overlap are ties, so noise draws no front.
"""

import json
import pathlib
import sys
import warnings
from typing import Optional

from zoo.tools.cli import ArgumentParser, ConfigError, run_tool


def load_summaries(root: pathlib.Path) -> list[dict]:
    jobs = []
    for path in sorted(root.rglob("summary.json"), key=lambda p: (len(p.parts), str(p))):
        try:
            s = json.loads(path.read_bytes().decode())
            if not isinstance(s, dict):
                raise ValueError(f"a JSON {type(s).__name__}, not an object")
            _check_types(s)
        except (OSError, ValueError) as e:  # not UTF-8 (UnicodeDecodeError), not JSON: damaged, or not train.py's
            why = _unreadable(e)
            s = {"status": "failed", "error": f"unreadable summary.json ({why})", "_unreadable": why}
        s["_dir"] = str(path.parent.relative_to(root)) or "."
        jobs.append(s)
    return jobs


_NUMBER = (int, float)
# What the report reads of a summary.json, and what train.py writes there (null where it has none).
SUMMARY_TYPES = {
    "status": str,
    "overrides": list,
    "steps": int,
    "start_step": int,
    "timed_steps": int,
    "step_time_s": _NUMBER,
    "step_time_quantiles_s": dict,
    "peak_memory_bytes": _NUMBER,
    "peak_memory_source": str,
    "tokens_per_s": _NUMBER,
    "tflops_per_device": _NUMBER,
    "mfu": _NUMBER,
    "first_loss": _NUMBER,
    "last_loss": _NUMBER,
    "eval": dict,
}
_TYPE_NAMES = {str: "text", list: "a list", int: "a whole number", dict: "an object"}
_EVAL_TYPES = {"eval_loss": _NUMBER, "eval_perplexity": _NUMBER}
_QUANTILES = ("min", "p25", "median", "p75", "max")


def _check_types(s: dict) -> None:
    """ValueError naming the first key of a summary whose value is not of the type train.py writes."""

    def bad(key, value, want) -> bool:
        return value is not None and (isinstance(value, bool) or not isinstance(value, want))

    for key, want in SUMMARY_TYPES.items():
        if bad(key, s.get(key), want):
            raise ValueError(f"its {key} is {json.dumps(s[key])[:40]}, not {_TYPE_NAMES.get(want, 'a number')}")
    if any(not isinstance(o, str) for o in s.get("overrides") or []):
        raise ValueError("its overrides are not all text")
    for key, value in (s.get("step_time_quantiles_s") or {}).items():
        if key in _QUANTILES and bad(key, value, _NUMBER):
            raise ValueError(f"its step_time_quantiles_s.{key} is {json.dumps(value)[:40]}, not a number")
    for key, want in _EVAL_TYPES.items():
        if s.get("eval") and bad(key, s["eval"].get(key), want):
            raise ValueError(f"its eval.{key} is {json.dumps(s['eval'][key])[:40]}, not a number")


def _unreadable(e: BaseException) -> str:
    """Why a file train.py writes as UTF-8 JSON did not read, in a short clause."""
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset {e.start}"
    if isinstance(e, json.JSONDecodeError):
        return f"not JSON: {e.msg} at line {e.lineno} column {e.colno}"
    return getattr(e, "strerror", None) or str(e)


def common_overrides(jobs: list[dict]) -> list[str]:
    """Overrides every job shares (shown once, left out of the per-job labels)."""
    sets = [set(j.get("overrides") or []) for j in jobs]
    shared = set.intersection(*sets) if sets else set()
    return [o for o in (jobs[0].get("overrides") or []) if o in shared] if jobs else []


def label(job: dict, common: tuple = ()) -> str:
    overrides = [o for o in job.get("overrides") or [] if o not in common]
    return " ".join(overrides) if overrides else job["_dir"]


def pareto_front(points: list[tuple[float | int, tuple[float, float]]]) -> list[bool]:
    """points: (memory, (time low, time high)), lower-better; a time is the range it was measured in
    (a single number: low == high). One time is measurably faster than another only when its range
    lies wholly below the other's. True where no other point dominates."""

    def faster(a, b):
        return a[1] < b[0]

    out = []
    for i, (m, t) in enumerate(points):
        dominated = any(
            m2 <= m and not faster(t, t2) and (m2 < m or faster(t2, t)) for j, (m2, t2) in enumerate(points) if j != i
        )
        out.append(not dominated)
    return out


def time_range(job: dict) -> tuple[float, float]:
    """The job's interquartile range of step times; its median alone when the summary has no spread."""
    q = job.get("step_time_quantiles_s") or {}
    if "p25" in q and "p75" in q:
        return q["p25"], q["p75"]
    return job["step_time_s"], job["step_time_s"]


def _mib(x: Optional[float | int]) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def _fmt(x: Optional[float | int], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _eval(ev: Optional[dict]) -> str:
    """The last held-out loss and its perplexity (`-` for a run without an eval split)."""
    return "-" if not ev else f"{ev['eval_loss']:.4f} ({ev['eval_perplexity']:.2f})"


def analyse(jobs: list[dict]) -> list[dict]:
    ok = [
        j for j in jobs if j.get("status") == "ok" and j.get("peak_memory_bytes") is not None and j.get("step_time_s")
    ]
    front = pareto_front([(j["peak_memory_bytes"], time_range(j)) for j in ok])
    for j, f in zip(ok, front):
        j["_pareto"] = f
    return jobs


def ran_no_steps(job: dict) -> Optional[str]:
    """Why a job that ended well has no step time (a resume that found its steps already done), else None."""
    if job.get("status") != "ok" or job.get("step_time_s") is not None:
        return None
    start, steps = job.get("start_step"), job.get("steps")
    if start is not None and steps is not None:
        return f"ran no steps (its checkpoint was already at step {start} of trainer.steps={steps})"
    return "ran no steps"


def markdown(jobs: list[dict]) -> str:
    common = tuple(common_overrides(jobs))
    rows = [
        f"Overrides of every job: `{' '.join(common)}`\n" if common else "",
        "Step time: the median over the timed steps (all but the first); a Pareto front uses a time difference only "
        "where the p25-p75 ranges do not overlap.\n",
        "| job | status | step time (ms) | p25-p75 (ms) | min-max (ms) | timed steps | peak memory (MiB) | memory "
        "source | tokens/s | TFLOP/s/device | MFU | loss first -> last | eval loss (ppl) | Pareto |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | :---: |",
    ]
    for j in jobs:
        if ran_no_steps(j):
            rows.append(f"| {label(j, common)} | {ran_no_steps(j)} | - | - | - | - | - | - | - | - | - | - | - | |")
        elif j.get("status") == "ok":
            q = j.get("step_time_quantiles_s") or {}
            spread = (
                (f"{1e3 * q['p25']:.1f}-{1e3 * q['p75']:.1f}", f"{1e3 * q['min']:.1f}-{1e3 * q['max']:.1f}")
                if q
                else ("-", "-")
            )
            rows.append(
                f"| {label(j, common)} | ok | {_fmt(1e3 * j['step_time_s'], '.1f')} | {spread[0]} | {spread[1]} | "
                f"{j.get('timed_steps', '-')} | {_mib(j.get('peak_memory_bytes'))} | "
                f"{j.get('peak_memory_source', '-')} | {_fmt(j.get('tokens_per_s'), '.0f')} | "
                f"{_fmt(j.get('tflops_per_device'), '.4f')} | "
                f"{_fmt(100 * j['mfu'] if j.get('mfu') is not None else None, '.2f')}% | "
                f"{_fmt(j.get('first_loss'), '.4f')} -> {_fmt(j.get('last_loss'), '.4f')} | {_eval(j.get('eval'))} | "
                f"{'yes' if j.get('_pareto') else ''} |"
            )
        else:
            err = str(j.get("error", "")).replace("|", "\\|")
            rows.append(f"| {label(j, common)} | failed: {err} | - | - | - | - | - | - | - | - | - | - | - | |")
    return "\n".join(rows) + "\n"


def plot(jobs: list[dict], path: pathlib.Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [j for j in jobs if "_pareto" in j]
    common = tuple(common_overrides(jobs))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    if not ok:
        ax.text(0.5, 0.5, "no successful job", ha="center", va="center", transform=ax.transAxes)
    else:
        xs = [j["peak_memory_bytes"] / 2**20 for j in ok]
        ys = [1e3 * j["step_time_s"] for j in ok]
        on = [j["_pareto"] for j in ok]
        ranges = [time_range(j) for j in ok]  # the interquartile range of each job's step times
        low = [y - 1e3 * r[0] for y, r in zip(ys, ranges)]
        high = [1e3 * r[1] - y for y, r in zip(ys, ranges)]
        ax.errorbar(xs, ys, yerr=[low, high], fmt="none", ecolor="tab:gray", alpha=0.6, capsize=3, zorder=1)
        ax.scatter(
            [x for x, f in zip(xs, on) if not f],
            [y for y, f in zip(ys, on) if not f],
            c="tab:gray",
            label="dominated",
            zorder=3,
        )
        ax.scatter(
            [x for x, f in zip(xs, on) if f],
            [y for y, f in zip(ys, on) if f],
            c="tab:red",
            label="Pareto front",
            zorder=4,
        )
        front = sorted((x, y) for x, y, f in zip(xs, ys, on) if f)
        if len(front) > 1:
            ax.step([p[0] for p in front], [p[1] for p in front], where="post", c="tab:red", alpha=0.5, zorder=2)
        for j, x, y in zip(ok, xs, ys):
            ax.annotate(label(j, common), (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
        ax.margins(x=0.3, y=0.15)
        sources = sorted({j.get("peak_memory_source", "?") for j in ok})
        ax.set_xlabel(f"peak device memory per device (MiB; {', '.join(sources)})")
        ax.legend(loc="best", fontsize=8)
    idle = sum(1 for j in jobs if ran_no_steps(j))
    failed = len(jobs) - len(ok) - idle
    ax.set_ylabel("step time (ms; median, bars p25-p75)")
    ax.set_title(f"step time vs peak memory: {len(ok)} job(s)" + (f", {failed} failed" if failed else "")
                 + (f", {idle} ran no steps" if idle else ""), fontsize=11)  # fmt: skip
    if common:
        fig.text(0.01, 0.01, "all jobs: " + " ".join(common), fontsize=7, color="tab:gray")
    ax.grid(alpha=0.3)
    with (
        warnings.catch_warnings()
    ):  # long job labels: matplotlib warns it cannot fit the margins, and draws the plot anyway
        warnings.filterwarnings("ignore", message="Tight layout not applied")
        fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def report(root: pathlib.Path, out: Optional[pathlib.Path] = None) -> tuple[pathlib.Path, pathlib.Path]:
    out = out or root
    out.mkdir(parents=True, exist_ok=True)
    jobs = analyse(load_summaries(root))
    if not jobs:
        raise FileNotFoundError(f"no summary.json under {root}")
    md_path, png_path = out / "report.md", out / "report.png"
    md_path.write_text(
        f"# Sweep report: {root}\n\n" + markdown(jobs) + f"\n![step time vs peak memory]({png_path.name})\n"
    )
    plot(jobs, png_path)
    return md_path, png_path


RUN_PLOT = "expert_load.png"


def load_metrics(run_dir: pathlib.Path) -> list[dict]:
    """The records of a run's metrics.jsonl, in step order (a line cut short by a kill, or damaged, is
    skipped); ConfigError (one line) when the file has content but no line is a step record."""
    path = run_dir / "metrics.jsonl"
    records, first_problem = [], None
    for line in path.read_bytes().splitlines():
        try:
            r = json.loads(line.decode())
        except ValueError as e:  # not UTF-8 (UnicodeDecodeError) or not JSON
            first_problem = first_problem or _unreadable(e)
            continue
        if isinstance(r, dict) and isinstance(r.get("step"), int):
            records.append(r)
    if not records and first_problem:
        raise ConfigError(
            f"dir: {path} holds no step record ({first_problem}): damaged, or not train.py's; "
            "give the directory of a train.py run"
        )
    return sorted(records, key=lambda r: r["step"])


def _per_layer(records: list[dict], key: str) -> tuple[list[int], list[list[float]]]:
    """(steps, series per MoE layer) of a per-layer metric; steps that lack it are left out."""
    rows = [(r["step"], r[key]) for r in records if isinstance(r.get(key), list) and r[key]]
    if not rows:
        return [], []
    layers = max(len(v) for _, v in rows)
    series = [
        [(float(v[i]) if i < len(v) and v[i] is not None else float("nan")) for _, v in rows] for i in range(layers)
    ]
    return [s + 1 for s, _ in rows], series


def run_report(run_dir: pathlib.Path, out: Optional[pathlib.Path] = None) -> Optional[pathlib.Path]:
    """One training run's MoE routing over its steps, plotted from `run_dir/metrics.jsonl`: expert
    load max/mean per MoE layer, the fraction of assignments dropped per layer, and (when logged) the
    router entropy, the correction bias's range (max - min) and the expert exchange's rounds per layer. Writes
    `expert_load.png` in `out` (default `run_dir`) and returns it; None for a run without MoE metrics (a dense model).
    Layers are labelled by their model index (summary.json's `moe_layers`) where the run finished, else by their row
    among the MoE layers."""
    records = load_metrics(run_dir)
    steps, load = _per_layer(records, "expert_load_max_over_mean")
    if not steps:
        return None
    drop_steps, drops = _per_layer(records, "moe_dropped_fraction")
    ent_steps, entropy = _per_layer(records, "router_entropy")
    try:
        names = json.loads((run_dir / "summary.json").read_text()).get("moe_layers")
    except (OSError, ValueError, AttributeError):
        names = None
    if not isinstance(names, list) or len(names) != len(load):
        names, prefix = list(range(len(load))), "MoE layer "
    else:
        prefix = "layer "

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("expert load max/mean", steps, load), ("dropped fraction of assignments", drop_steps, drops)]
    if ent_steps:
        panels.append(("router entropy (nats)", ent_steps, entropy))
    bias_steps, bias_max = _per_layer(records, "moe_bias_max")
    _, bias_min = _per_layer(records, "moe_bias_min")
    if bias_steps and len(bias_min) == len(bias_max):
        panels.append(
            (
                "correction bias max - min",
                bias_steps,
                [[hi - lo for lo, hi in zip(a, b)] for a, b in zip(bias_min, bias_max)],
            )
        )
    round_steps, rounds = _per_layer(records, "moe_exchange_rounds")
    if round_steps:  # the dropless expert-parallel exchange: more than 1 is the price of that step's imbalance
        panels.append(("expert exchange rounds", round_steps, rounds))
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.8 * len(panels)), dpi=110, sharex=True, squeeze=False)
    colors = plt.get_cmap("viridis")
    n = len(load)
    for ax, (title, xs, series) in zip(axes[:, 0], panels):
        for i, ys in enumerate(series):
            ax.plot(xs, ys, color=colors(i / max(n - 1, 1)), lw=1.2, label=f"{prefix}{names[i]}")
        ax.set_ylabel(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0, 0].axhline(1.0, color="tab:gray", lw=0.8, ls="--")  # perfectly balanced
    if n <= 12:
        axes[0, 0].legend(loc="upper right", fontsize=7, ncol=min(n, 4))
    else:
        fig.colorbar(
            plt.cm.ScalarMappable(cmap=colors, norm=plt.Normalize(names[0], names[-1])),
            ax=axes[:, 0].tolist(),
            label="layer",
        )
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].set_title(f"MoE routing over steps: {run_dir}", fontsize=10)
    path = (out or run_dir) / RUN_PLOT
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _check_outputs(folder: pathlib.Path, names, key: str, overwrite: bool) -> None:
    """Each file the report writes into `folder`, before anything is read: writable, and no file but the
    report's own earlier one (a user's report.md, a run's files) replaced without --overwrite (zoo.tools.kit)."""
    from zoo.tools.kit import check_output

    if folder.is_file():
        raise ConfigError(f"{key}: {folder} is a file; give a directory, e.g. {key} {folder.parent / 'report'}")
    for name in names:
        check_output(folder / name, key, "report", "--overwrite", overwrite)


def _main_run(run_dir: pathlib.Path, out: Optional[pathlib.Path], overwrite: bool = False) -> int:
    """`python -m zoo.tools.report RUN_DIR`: the run's expert-load plot, one line on stdout naming it."""
    try:
        _check_outputs(out or run_dir, [RUN_PLOT], "--out" if out else "dir", overwrite)
        png = run_report(run_dir, out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if png is None:
        print(f"no MoE data in {run_dir / 'metrics.jsonl'} (a dense model, or no step logged); nothing to plot")
    else:
        print(f"wrote {png}")
    return 0


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m zoo.tools.report", description=__doc__.splitlines()[0])
    p.add_argument(
        "dir",
        type=pathlib.Path,
        help="a multirun directory (or any directory holding summary.json files), or one run's directory "
        f"(it holds metrics.jsonl): its MoE routing over steps, plotted to {RUN_PLOT}",
    )
    p.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="where report.md and report.png (or a run's plot) go (default: dir)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace files there that the report did not write itself (by default it replaces only its own)",
    )
    a = p.parse_args(argv)
    return run_tool(lambda: _main(a), p.prog)  # Ctrl-C: one line, exit code 130


def _main(a) -> int:
    if not a.dir.is_dir():
        print(f"error: dir: {a.dir} is not a directory; pass the multirun output directory", file=sys.stderr)
        return 2
    if (a.dir / "metrics.jsonl").is_file():
        return _main_run(a.dir, a.out, a.overwrite)

    try:
        _check_outputs(a.out or a.dir, ["report.md", "report.png"], "--out" if a.out else "dir", a.overwrite)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        md, png = report(a.dir, a.out)
    except FileNotFoundError as e:
        print(f"error: dir: {e}; run a sweep first (python train.py -m ...)", file=sys.stderr)
        return 2
    print(md.read_text())
    jobs = load_summaries(a.dir)
    for j in jobs:
        if j.get("_unreadable"):
            print(
                f"note: {a.dir / j['_dir'] / 'summary.json'} is unreadable ({j['_unreadable']}); marked failed in "
                f"{md.name}",
                file=sys.stderr,
            )
    idle = [j for j in jobs if ran_no_steps(j)]
    if idle:
        print(
            f"note: job(s) {', '.join(j['_dir'] for j in idle)} ran no steps, so they have no timing; marked in "
            f"{md.name}",
            file=sys.stderr,
        )
    print(f"wrote {md} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
