"""Zoo beside MaxText on one TPU: the same layers, batch, sequence, dtypes, optimizer and attention kernel
under each remat/offload policy both have, the two alternated in one lease (MaxText through its own
trainer, `maxtext.trainers.pre_train.train.main`, on its synthetic data).

    python bench/peer_maxtext.py --shapes llama1b_8192,llama8b_8192 --out bench_maxtext.json     # a TPU with MaxText
    python bench/peer_maxtext.py --dims emb=4096,mlp=14336,heads=32,kv_heads=8,head_dim=128,layers=2,vocab=32768 \\
        --batch 1 --seq 8192 --out any.json                                                    # a shape of yours
    python bench/peer_maxtext.py --toy --out /tmp/m.json        # any CPU with MaxText installed: tiny dims (tests)
    python bench/peer_maxtext.py --render docs/bench_maxtext.json   # the tables of a record

MaxText is not a Zoo dependency (like torch for bench/peer.py): `--maxtext-python` names a Python that
has it (default: this one) and `--maxtext-pythonpath` the PYTHONPATH its process gets (default: this one's).
`bash bench/maxtext_wheels.sh` gathers MaxText 0.2.4 and the wheels it needs for a TPU machine on
Python 3.11, `bench/maxtext_setup.sh` installs them there (docs/benchmarks.md, "Against MaxText").

Each round runs Zoo's policies in one process (bench/tpu.py's setup runner: every policy compiled,
then timed in alternation) and MaxText's in another (one trainer run per policy), the two processes in
alternating order, sharing one persistent compilation cache so a later round does not compile again.
Both get the same libtpu flags (conf/xla/tpu_host_offload.yaml). Per policy: the median step time
over every timed step of every round (MaxText's `perf/step_time_seconds`, its first two steps left
out), model FLOPs counted one way for both (zoo.counts.flops_per_token of the same dimensions: 6 per
matmul weight per token, attention's scores and context at causal length), MFU against the v5e's
197 TFLOP/s, and XLA's compiled memory (argument + output - alias + temporaries, each side's compiled
step; on a TPU also the heap simulation's peak).
"""

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common as C  # noqa: E402 - stdlib only: MaxText's Python runs this file too
from bench.skeleton import log  # noqa: E402

SCHEMA = "zoo.bench.maxtext/1"
PEAK_FLOPS = 1.97e14  # v5e bf16 datasheet, as bench/tpu.py's (conf/hardware/tpu_v5e.yaml)
HBM_BYTES = 16909336064  # what the runtime gives one program on the v5e (docs/benchmarks.md)
MAXTEXT_VERSION = "0.2.4"  # its tpu extra pins jax >= 0.10.2 and libtpu >= 0.0.42.1, the chip's; 0.2.5 wants jax 0.11
WARMUP_STEPS = 2  # MaxText's steps left out of its median (the first includes compilation's tail)


from bench.maxtext_shapes import (  # noqa: E402
    POLICIES,
    recompute_only,
    SHAPES,
    TOY_SHAPES,
    Shape,
    zoo_label,
    zoo_setup,
)


class BadInput(ValueError):
    """One line for the user: what is wrong and the fix."""


def parse_dims(text: str, batch: Optional[int], seq: Optional[int]) -> Shape:
    fields = {f.name: f for f in dataclasses.fields(Shape)}
    values: dict = {}
    for item in filter(None, text.split(",")):
        key, sep, val = item.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise BadInput(f"--dims: {item!r} is not one of {', '.join(f'{k}=N' for k in fields)}")
        try:
            values[key] = (val.strip().lower() in ("1", "true", "yes")) if key == "tied" else int(val)
        except ValueError:
            raise BadInput(f"--dims: {key}={val!r} is not a whole number") from None
    if batch is not None:
        values["batch"] = batch
    if seq is not None:
        values["seq"] = seq
    missing = [k for k in ("emb", "mlp", "heads", "kv_heads", "head_dim", "layers", "vocab", "batch", "seq")
               if k not in values and not (k == "kv_heads" and values.get("kv_lora"))]  # fmt: skip
    if missing:
        raise BadInput(f"--dims: give {', '.join(missing)} (with --batch and --seq, or as batch=N,seq=N)")
    values.setdefault("kv_heads", values.get("heads", 1))
    return Shape(**values)


def check_shapes(shapes: dict[str, Shape], hbm_bytes: float) -> None:
    for name, s in shapes.items():
        bad = s.problems()
        if bad:
            raise BadInput(f"shape {name}: {bad[0]}")
        need = s.state_bytes()
        if need > 0.95 * hbm_bytes:
            raise BadInput(
                f"shape {name}: its float32 parameters, gradients and AdamW state alone take {need / 1e9:.1f} GB, "
                f"more than the {hbm_bytes / 1e9:.1f} GB the chip holds: fewer layers, experts or a smaller vocab"
            )


# --- children ------------------------------------------------------------------------------------


def child_zoo(spec: dict, result_path: pathlib.Path) -> dict:
    """Zoo's policies for one shape: bench/tpu.py's setup runner (compile all, time in alternation)."""
    from bench import tpu as T

    shape = Shape(**spec["shape"])
    setup = zoo_setup(spec["name"], shape, [zoo_label(p) for p in spec["policies"]], spec["group"])
    tspec = {
        "setup_names": [spec["name"]],
        "setups": {spec["name"]: setup},
        "deadline": spec["deadline"],
        "workers": spec["workers"],
        "rounds": 1,
        "steps": spec["steps"],
        "toy": spec.get("toy", False),
    }
    res = T.child_setups(tspec, result_path)
    runs = res["setups"][spec["name"]]["runs"]
    out = {}
    for policy in spec["policies"]:
        r = runs.get(zoo_label(policy), {})
        out[policy] = {
            "status": r.get("status", "missing"),
            "error": r.get("error"),
            "step_times_s": r.get("step_times_s", []),
            "compiled_memory": r.get("compiled_memory"),
            "loss": r.get("loss"),
            "planner": r.get("planner"),
            "kernels": r.get("kernels"),
        }
    return {"env": res.get("env"), "runs": out}


def _install_maxtext_stubs() -> None:
    """MaxText 0.2.4's mHC kernels (maxtext/kernels/mhc) use Python 3.12's `type X = ...` statement and
    do not parse on 3.11; none of the models here uses them, so their import is answered by a stand-in."""
    import types

    if sys.version_info >= (3, 12):
        return
    api = types.ModuleType("maxtext.kernels.mhc.api")
    api.__getattr__ = lambda attr: type(attr, (), {})
    pkg = types.ModuleType("maxtext.kernels.mhc")
    pkg.__path__ = []
    pkg.api = api
    pkg.__getattr__ = lambda attr: getattr(api, attr)
    sys.modules.update({"maxtext.kernels.mhc": pkg, "maxtext.kernels.mhc.api": api})


def _memory_fields(stats) -> dict:
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
            "host_temp_size_in_bytes", "host_argument_size_in_bytes", "host_output_size_in_bytes",
            "host_alias_size_in_bytes", "peak_memory_in_bytes")  # fmt: skip
    return {k: int(getattr(stats, k)) for k in keys if getattr(stats, k, None) is not None}


def child_maxtext(spec: dict, result_path: pathlib.Path) -> dict:
    """MaxText's policies for one shape, each one run of its own trainer on synthetic data."""
    _install_maxtext_stubs()
    import maxtext
    from maxtext.trainers.pre_train import train
    from maxtext.utils import max_utils

    captured: dict = {}
    printed = max_utils.print_compiled_memory_stats

    def capture(stats):  # the trainer prints its compiled step's memory analysis; keep the figures too
        captured["memory"] = _memory_fields(stats) if stats is not None else None
        return printed(stats)

    max_utils.print_compiled_memory_stats = capture
    base = str(pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml")
    shape = Shape(**spec["shape"])
    workdir = pathlib.Path(spec["workdir"])
    out: dict = {"env": {"maxtext": getattr(maxtext, "__version__", None), "python": sys.version.split()[0]}}
    runs = out["runs"] = {}
    for policy in spec["policies"]:
        if time.time() > spec["deadline"]:
            runs[policy] = {"status": "skipped", "error": "budget"}
            continue
        metrics = workdir / f"maxtext_{spec['name']}_{policy}_{os.getpid()}.jsonl"
        argv = ["train", base, *common_maxtext_args(spec, shape, metrics), *POLICIES[policy][1]]
        captured.clear()
        t = time.perf_counter()
        run = runs[policy] = {"argv": argv[2:]}
        try:
            train.main(argv)
            run["status"] = "ok"
        except BaseException as e:  # noqa: BLE001 - SystemExit included: MaxText exits on a bad config
            text = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400] if str(e).strip() else ''}"
            oom = "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()
            run.update(status="oom" if oom else "error", error=text)
        run["wall_s"] = time.perf_counter() - t
        run["compiled_memory"] = captured.get("memory")
        lines = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        run["step_times_s"] = [m["perf/step_time_seconds"] for m in lines[WARMUP_STEPS:]]
        run["maxtext_tflops_per_step"] = lines[0].get("perf/per_device_tflops") if lines else None
        run["loss"] = lines[-1].get("learning/loss") if lines else None
        log(f"maxtext {spec['name']} {policy}: {run['status']}, {len(run['step_times_s'])} timed steps")
        result_path.write_text(json.dumps(out, indent=1))
    return out


def common_maxtext_args(spec: dict, shape: Shape, metrics: pathlib.Path) -> list[str]:
    """MaxText's run: its synthetic data, no checkpoints, one process, the same optimizer and dtypes
    as Zoo's bench (AdamW, bfloat16 compute over float32 weights), its splash kernel on a TPU."""
    toy = spec.get("toy", False)
    return [
        f"run_name={spec['name']}",
        f"base_output_directory={pathlib.Path(spec['workdir']) / 'maxtext_out'}",
        "dataset_type=synthetic",
        f"steps={WARMUP_STEPS + spec['steps']}",
        f"hardware={'cpu' if toy else 'tpu'}",
        "skip_jax_distributed_system=true",  # one process; the TPU machine opens no sockets
        "enable_checkpointing=false",
        "enable_tensorboard=false",
        f"metrics_file={metrics}",
        "log_period=1000000",
        "dtype=bfloat16",
        "weight_dtype=float32",
        "opt_type=adamw",
        "enable_dropout=false",
        f"attention={'dot_product' if toy else 'flash'}",
        *shape.maxtext_args(),
    ]


# --- parent --------------------------------------------------------------------------------------


def run_child(side: str, spec: dict, workdir: pathlib.Path, args, timeout: float) -> dict:
    tag = f"{side}_{spec['name']}_{spec['round']}"
    spec_path, result_path = workdir / f"{tag}_spec.json", workdir / f"{tag}_result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    python = sys.executable if side == "zoo" else (args.maxtext_python or sys.executable)
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = env.pop("ZOO_BENCH_JAX_PLATFORMS", "")
    if not env["JAX_PLATFORMS"]:
        del env["JAX_PLATFORMS"]
    env["JAX_COMPILATION_CACHE_DIR"] = str(workdir / "jax_cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    from bench.tpu import _tpu_flags

    flags = _tpu_flags(spec["group"])
    if flags:
        env["LIBTPU_INIT_ARGS"] = " ".join([os.environ.get("LIBTPU_INIT_ARGS", ""), *flags]).strip()
    if side == "maxtext" and args.maxtext_pythonpath is not None:
        env["PYTHONPATH"] = args.maxtext_pythonpath
    cmd = [python, str(pathlib.Path(__file__).resolve()), "--child", side, "--spec", str(spec_path),
           "--result", str(result_path)]  # fmt: skip
    t = time.perf_counter()
    try:
        rc = subprocess.run(cmd, env=env, timeout=max(30.0, timeout)).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    out = json.loads(result_path.read_text()) if result_path.exists() else {}
    out["process"] = {"returncode": rc, "wall_s": time.perf_counter() - t}
    return out


def merge_round(record: dict, name: str, side: str, child: dict) -> None:
    sides = record["shapes"][name].setdefault(side, {"runs": {}, "processes": []})
    sides["processes"].append(child.get("process"))
    if child.get("env"):
        sides["env"] = child["env"]
    for policy, r in (child.get("runs") or {}).items():
        acc = sides["runs"].setdefault(policy, {"step_times_s": []})
        acc["step_times_s"] += r.get("step_times_s") or []
        for k, v in r.items():
            if k != "step_times_s" and (v is not None or k not in acc):
                acc[k] = v


def peak_bytes(memory: Optional[dict]) -> Optional[float]:
    """XLA's compiled peak: on a TPU its heap simulation less host-resident arguments (as Zoo's bench
    reads it), elsewhere arguments + outputs - aliased + temporaries."""
    if not memory:
        return None
    if memory.get("peak_memory_in_bytes"):
        from zoo.train.metrics import device_peak_of_simulation

        return device_peak_of_simulation({**memory, "simulated_peak_bytes": memory["peak_memory_in_bytes"]})
    if memory.get("simulated_peak_bytes") and memory.get("estimated_peak_bytes"):
        return memory["estimated_peak_bytes"]
    return (memory.get("argument_size_in_bytes", 0) + memory.get("output_size_in_bytes", 0)
            - memory.get("alias_size_in_bytes", 0) + memory.get("temp_size_in_bytes", 0))  # fmt: skip


def derive(record: dict) -> None:
    """Per shape and side: median step, MFU and peak per policy; each side's fastest; Zoo over MaxText."""
    from zoo.counts import flops_per_token

    for name, entry in record["shapes"].items():
        shape = Shape(**entry["shape"])
        flops = flops_per_token(shape.zoo_model(), shape.seq) * shape.batch * shape.seq
        entry["model_flops_per_step"] = flops
        for side in ("zoo", "maxtext"):
            runs = (entry.get(side) or {}).get("runs", {})
            for r in runs.values():
                ts = r.get("step_times_s") or []
                if ts and r.get("status") in ("ok", "compiled"):
                    r["status"] = "ok"
                    r["median_step_s"] = statistics.median(ts)
                    r["mfu"] = flops / r["median_step_s"] / PEAK_FLOPS
                r["xla_peak_bytes"] = peak_bytes(r.get("compiled_memory"))
            timed = {p: r["median_step_s"] for p, r in runs.items() if r.get("median_step_s")}
            if timed:
                best = min(timed, key=timed.get)
                entry.setdefault("fastest", {})[side] = {"policy": best, "step_s": timed[best]}
                rec = {p: t for p, t in timed.items() if recompute_only(p)}
                off = {p: t for p, t in timed.items() if not recompute_only(p)}
                if rec and off:
                    b_off, b_rec = min(off, key=off.get), min(rec, key=rec.get)
                    entry.setdefault("offload_vs_recompute", {})[side] = {
                        "offload": b_off, "recompute": b_rec, "ratio": off[b_off] / rec[b_rec]}  # fmt: skip
        fast = entry.get("fastest", {})
        if "zoo" in fast and "maxtext" in fast:
            entry["zoo_over_maxtext_fastest"] = fast["zoo"]["step_s"] / fast["maxtext"]["step_s"]


def assignment_label(assignment: dict[str, str]) -> str:
    """An assignment as a label of bench/tpu.py's syntax: `full` (every tag recomputed) and each tag
    that is not."""
    return "full:" + ",".join(f"{t}={a}" for t, a in assignment.items() if a != "remat")


def planner_picks(record: dict, profile: str = "tpu_v5e", compile_n: int = 0) -> None:
    """Per shape of `record`: zoo.tools.plan's pick for the shape's model and batch on the hardware
    `profile` (the estimate alone; `compile_n` > 0: plan.compile, ahead of time with libtpu), beside the
    fastest Zoo policy the chip measured, in `entry["planner"]`: its label, estimate, and, where the
    record timed the same assignment, its step and its ratio to the fastest."""
    import jax

    from bench import tpu as T
    from zoo.backend import lowering_for, pallas_interpreted
    from zoo.offload import conf_dir
    from zoo.plan.options import PlanConfig
    from zoo.plan.compiled import compile_checked
    from zoo.plan.search import search
    from zoo.plan.traced import none_estimate, none_note, problem_from_config

    hw = T.load_profile(profile)
    for name, entry in record["shapes"].items():
        setup = zoo_setup(name, Shape(**entry["shape"]), ["full"], "tpu_host_offload")
        opts = PlanConfig(compile=compile_n)
        with lowering_for("tpu"), pallas_interpreted():
            c, tr = T.build(setup, "full", jax.devices()[:1], hw, False)
            p, info = problem_from_config(c, tr, opts, conf_dir() / "hardware")
        none = none_estimate(p, info["none_residual_bytes"]) if info["none_residual_bytes"] is not None else None
        if compile_n:
            log(f"plan.compile={compile_n} for {name} (ahead of time with libtpu) ...")
            pick, checked, _ = compile_checked(p, c, tr.plan, jax.devices()[:1], opts, echo=_echo, none=none)
            label = "none" if checked.label == "none" else assignment_label(pick.assignment)
        else:
            pick = search(p)
            note = none is not None and none_note(p, pick, none, False)
            pick, label = (none, "none") if note else (pick, assignment_label(pick.assignment))
        runs = _runs(entry, "zoo")
        same = [
            policy
            for policy, r in runs.items()
            if r.get("median_step_s")
            and (policy == "none" if label == "none" else (r.get("planner") or {}).get("assignment") == pick.assignment)
        ]
        measured = runs[same[0]]["median_step_s"] if same else (runs.get(label) or {}).get("median_step_s")
        fastest = (entry.get("fastest") or {}).get("zoo")
        entry["planner"] = {
            "profile": profile,
            "compiled": bool(compile_n),
            "label": same[0] if same else label,
            "estimated_step_s": pick.time_s,
            "measured_step_s": measured,
            "over_fastest": measured / fastest["step_s"] if measured and fastest else None,
        }


def _echo(*a, **_):
    log(" ".join(map(str, a)))


def _ms(x):
    return f"{1e3 * x:.1f}" if x else "-"


def markdown(record: dict) -> str:
    lines = []
    for name, e in record["shapes"].items():
        s = Shape(**e["shape"])
        lines.append(f"### {name}: {s.layers} layer(s) of {s.emb} wide, batch {s.batch} x {s.seq}\n")
        lines.append("| policy | Zoo ms | MaxText ms | Zoo / MaxText | Zoo MFU | MaxText MFU | Zoo XLA peak GB | "
                     "MaxText XLA peak GB |")  # fmt: skip
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        z, m = (e.get("zoo") or {}).get("runs", {}), (e.get("maxtext") or {}).get("runs", {})
        for p in [*POLICIES, *(q for q in z if q not in POLICIES)]:
            if p not in z and p not in m:
                continue
            zr, mr = z.get(p, {}), m.get(p, {})

            def cell(r):
                return _ms(r.get("median_step_s")) if r.get("median_step_s") else (r.get("status") or "-")

            ratio = (f"{zr['median_step_s'] / mr['median_step_s']:.3f}"
                     if zr.get("median_step_s") and mr.get("median_step_s") else "-")  # fmt: skip
            mfu = [f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-" for r in (zr, mr)]
            peak = [f"{r['xla_peak_bytes'] / 1e9:.2f}" if r.get("xla_peak_bytes") else "-" for r in (zr, mr)]
            lines.append(f"| {p} | {cell(zr)} | {cell(mr)} | {ratio} | {mfu[0]} | {mfu[1]} | {peak[0]} | {peak[1]} |")
        fast = e.get("fastest", {})
        if fast:
            said = ", ".join(f"{side} {f['policy']} {_ms(f['step_s'])} ms" for side, f in fast.items())
            ratio = e.get("zoo_over_maxtext_fastest")
            lines.append(f"\nfastest: {said}" + (f"; Zoo's fastest / MaxText's fastest {ratio:.3f}" if ratio else ""))
        for side, o in (e.get("offload_vs_recompute") or {}).items():
            lines.append(f"{side}: fastest offload {o['offload']} / fastest recompute-only {o['recompute']} "
                         f"= {o['ratio']:.3f}")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)} (default: all)")
    ap.add_argument("--dims", help="a shape of yours: emb=,mlp=,heads=,kv_heads=,head_dim=,layers=,vocab= "
                    "(MLA: q_lora=,kv_lora=,qk_nope=,qk_rope=,v_head=; experts: experts=,top_k=,shared=)")  # fmt: skip
    ap.add_argument("--batch", type=int, help="with --dims: the batch")
    ap.add_argument("--seq", type=int, help="with --dims: the sequence length")
    ap.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated (or ';' where a Zoo label has commas), of {', '.join(POLICIES)}",
    )
    ap.add_argument("--sides", default="zoo,maxtext", help="zoo, maxtext or both")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per policy per round")
    ap.add_argument("--budget-s", type=float, default=560.0, help="stop starting work after this many seconds")
    ap.add_argument("--toy", action="store_true", help="tiny shapes on the CPU (tests)")
    ap.add_argument("--maxtext-python", help="the Python that has MaxText (default: this one)")
    ap.add_argument("--maxtext-pythonpath", help="PYTHONPATH of MaxText's process (default: this one's)")
    ap.add_argument("--workdir", default="/tmp/zoo_maxtext")
    ap.add_argument("--out", help="the JSON record (written after every process)")
    ap.add_argument("--render", help="print the tables of a record and exit")
    ap.add_argument("--child", choices=["zoo", "maxtext"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _maxtext_missing(args) -> Optional[str]:
    """None when the MaxText Python imports MaxText; else why not."""
    python = args.maxtext_python or sys.executable
    env = dict(os.environ)
    if args.maxtext_pythonpath is not None:
        env["PYTHONPATH"] = args.maxtext_pythonpath
    code = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('maxtext') else 3)"
    try:
        rc = subprocess.run([python, "-c", code], env=env, timeout=120).returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} could not be run ({e})"
    return None if rc == 0 else f"{python} has no MaxText"


def check_policies(policies: list[str], sides: list[str]) -> None:
    """Each a shared policy (POLICIES), or with --sides zoo a Zoo label of bench/tpu.py's syntax."""
    for p in policies:
        if p in POLICIES:
            continue
        if sides != ["zoo"]:
            raise BadInput(
                f"--policies: unknown {p!r}; choose from {', '.join(POLICIES)} (a Zoo label such as "
                "full:context=offload goes with --sides zoo)"
            )
        from zoo.offload import policy_from_label

        try:
            policy_from_label(p)
        except Exception as e:  # noqa: BLE001 - a bad label: its one line
            raise BadInput(
                f"--policies: unknown {p!r}: neither a shared policy ({', '.join(POLICIES)}) nor a Zoo label "
                f"({str(e).splitlines()[0]})"
            ) from None


def plan_shapes(args) -> dict[str, Shape]:
    if args.dims:
        return {"custom": parse_dims(args.dims, args.batch, args.seq)}
    if args.batch is not None or args.seq is not None:
        raise BadInput("--batch and --seq go with --dims (a named shape has its own)")
    table = TOY_SHAPES if args.toy else SHAPES
    names = args.shapes.split(",") if args.shapes else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise BadInput(f"--shapes: unknown {unknown[0]!r}; choose from {', '.join(table)} or give --dims")
    return {n: table[n] for n in names}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        spec = json.loads(pathlib.Path(args.spec).read_text())
        fn = child_zoo if args.child == "zoo" else child_maxtext
        res = fn(spec, pathlib.Path(args.result))
        pathlib.Path(args.result).write_text(json.dumps(res, indent=1))
        return 0
    # This process reads shapes and counts FLOPs on the CPU: the chip is the children's, one program at a time.
    os.environ["ZOO_BENCH_JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS", "")
    os.environ["JAX_PLATFORMS"] = "cpu"
    if args.render:
        record = json.loads(pathlib.Path(args.render).read_text())
        derive(record)
        print(markdown(record))
        return 0
    try:
        shapes = plan_shapes(args)
        # ';' between policies where a Zoo label has commas of its own (full:context=offload,out_proj=offload)
        policies = [p for p in args.policies.split(";" if ";" in args.policies else ",") if p]
        sides = [s for s in args.sides.split(",") if s]
        if not sides or any(s not in ("zoo", "maxtext") for s in sides):
            raise BadInput(f"--sides {args.sides!r}: zoo, maxtext or zoo,maxtext")
        check_policies(policies, sides)
        if args.rounds < 1 or args.steps < 1:
            raise BadInput("--rounds and --steps: at least 1")
        check_shapes(shapes, HBM_BYTES)
        if "maxtext" in sides:
            why = _maxtext_missing(args)
            if why:
                raise BadInput(
                    f"{why}: pip install --no-deps --ignore-requires-python maxtext=={MAXTEXT_VERSION} and what it "
                    "imports (bash bench/maxtext_wheels.sh; docs/benchmarks.md, 'Against MaxText'), or pass "
                    "--maxtext-python / --maxtext-pythonpath, or --sides zoo"
                )
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run(args, shapes, policies, sides)


def run(args, shapes: dict[str, Shape], policies: list[str], sides: list[str]) -> int:
    workdir = pathlib.Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    deadline = t_start + args.budget_s
    record = {
        "schema": SCHEMA,
        "command": " ".join(["python", "bench/peer_maxtext.py", *(sys.argv[1:] if argv_is_cli() else [])]),
        "date": time.strftime("%Y-%m-%d"),
        "shapes": {n: {"shape": dataclasses.asdict(s)} for n, s in shapes.items()},
    }
    for rnd in range(args.rounds):
        for name, shape in shapes.items():
            order = sides if rnd % 2 == 0 else sides[::-1]
            for side in order:
                if time.time() > deadline - 30:
                    record["shapes"][name].setdefault("skipped", []).append(f"{side} round {rnd + 1}: budget")
                    continue
                spec = {
                    "name": name,
                    "round": rnd,
                    "shape": dataclasses.asdict(shape),
                    "policies": policies,
                    "steps": args.steps,
                    "group": "default" if args.toy else "tpu_host_offload",
                    "toy": args.toy,
                    "workdir": str(workdir),
                    "workers": min(8, os.cpu_count() or 1),
                    "deadline": deadline,
                }
                log(f"round {rnd + 1}: {side} on {name}")
                child = run_child(side, spec, workdir, args, deadline - time.time() + 60)
                merge_round(record, name, side, child)
                if args.out:
                    C.write_json(args.out, record)
    derive(record)
    if args.out:
        C.write_json(args.out, record)
    print(markdown(record))
    runs = [r for e in record["shapes"].values() for side in ("zoo", "maxtext") for r in _runs(e, side).values()]
    if not any(r.get("median_step_s") for r in runs):
        print("error: no policy ran on either side (every one out of memory or failed: see the record's errors); "
              "a smaller --batch or shape fits", file=sys.stderr)  # fmt: skip
        return 2
    return 0


def _runs(entry: dict, side: str) -> dict:
    return (entry.get(side) or {}).get("runs", {})


def argv_is_cli() -> bool:
    return pathlib.Path(sys.argv[0]).name == "peer_maxtext.py"


if __name__ == "__main__":
    raise SystemExit(main())
