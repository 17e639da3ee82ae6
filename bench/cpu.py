"""CPU benchmark: every offload preset on a Llama and a DeepSeek-V3-shaped model, against this
machine's own measured float32 matmul rate, plus compile time against depth.

    python bench/cpu.py                        # the full run (docs/benchmarks.md), ~8 min on 2 cores
    python bench/cpu.py --quick                # toy sizes, ~1 min (tests/test_bench.py)
    python bench/cpu.py --out docs/bench_cpu.json --plot docs/bench_cpu.png --profile

For each model and every preset of conf/offload (`custom` left out: it is `full` until set) it
builds train.py's own step (`zoo.train.step.Trainer`) from the dataclasses, and reports

- what the backward pass keeps, by tag (read from the traced program by `zoo.tools.inspect_step`): on device,
  on host, recomputed, plus untagged residuals;
- XLA's compiled memory analysis (device temp and host temp bytes; on CPU host temp is always 0 and
  offloaded residuals count as device temp: XLA:CPU moves no bytes, see docs/offload.md, "The inspector");
- the step time, timed round-robin: every round runs one step of every preset in a rotated order,
  so load from other processes hits all presets alike; the ratio to `none` is the median over rounds
  of (this preset's step / `none`'s step in the same round);
- the model-FLOP rate (zoo.counts.flops_per_token: the model's FLOPs, not the recomputation) as a
  fraction of the float32 matmul rate measured in the same run (the best of n = 1024 and 2048, at
  the start and at the end).

One process, one device; nothing here needs Hydra.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as C  # noqa: E402
from bench.skeleton import command_line, finish, log, parser, pyplot, render, round_order, save_figure  # noqa: E402
from bench.skeleton import timed_steps  # noqa: E402

SCHEMA = "zoo.bench.cpu/1"
PRESETS = (
    "none",
    "full",
    "minimal",
    "save_qkv_proj",
    "qkv_proj_offloaded",
    "minimal_offloaded",
    "llama_qkv_offload",
    "deepseek_mla_moe_offload",
    "optimizer_host",
    "params_host",
)

# The benchmark models: the zoo's ~100M sizes. The routed experts use the capacity kernel, with which
# docs/benchmarks.md's CPU figures were measured (the default became dropless after them).
FULL = {
    "models": {"llama": ("llama_100m", {}), "dsv3": ("dsv3_100m", {"moe_impl": "capacity"})},
    "batch": 1,
    "seq": 512,
    "rounds": 3,
    "depths": (4, 16, 64),
    "depth_model": "llama",
    "depth_presets": ("none", "full"),
    "matmul_sizes": (512, 1024, 2048),
    "presets": PRESETS,
    "fast_compile": False,
}
QUICK = {
    "models": {"llama": ("llama_tiny_a", {}), "dsv3": ("dsv3_tiny_a", {"moe_impl": "capacity"})},
    "batch": 2,
    "seq": 64,
    "rounds": 2,
    "depths": (1, 2),
    "depth_model": "llama",
    "depth_presets": ("full",),
    "matmul_sizes": (256,),
    "presets": ("none", "full", "llama_qkv_offload", "optimizer_host"),
    "fast_compile": True,  # LLVM optimisations off: compiles ~2x faster; a smoke test, not a measurement
}


def measure_matmuls(sizes) -> list[dict]:
    from zoo.tools.measure_hardware import measure_matmul

    out = []
    for n in sizes:
        rate = measure_matmul(n, "float32", repeats=5, chain=4)
        out.append({"n": n, "dtype": "float32", "flops_per_s": rate})
        log(f"matmul {n}x{n}x{n} float32: {rate / 1e9:.1f} GFLOP/s")
    return out


def measure_matmul(n, dtype, repeats, chain):
    from zoo.tools.measure_hardware import measure_matmul as mm

    return mm(n, dtype, repeats=repeats, chain=chain)


def _compile_presets(model, presets, batch: int, seq: int, fast_compile: bool) -> tuple[dict, dict, dict]:
    """Every preset's step traced and lowered, then compiled two at a time: (trainers, compiled, rows)."""
    trainers, lowered, rows = {}, {}, {}
    for p in presets:
        tr = C.make_trainer(C.train_config(model, [p], batch, seq, fast_compile=fast_compile))
        lowered[p], kept, secs = C.trace_lower(tr)
        trainers[p] = tr
        rows[p] = {"policy": tr.cfg.offload.describe(), "kept": kept, "compile": secs}
    workers = min(2, os.cpu_count() or 1)
    t0 = time.perf_counter()
    compiled = C.compile_many([(p, lowered[p], trainers[p].compiler_options) for p in presets], workers)
    log(f"  compiled {len(presets)} steps in {time.perf_counter() - t0:.1f}s ({workers} at a time)")
    for p in presets:
        exe, secs = compiled[p]
        if isinstance(exe, Exception):
            raise exe
        compiled[p] = exe
        mem = C.compiled_memory(exe)
        kept = rows[p]["kept"]
        rows[p].update(compiled_memory=mem, xla_flops_per_step=C.compiled_flops(exe))
        rows[p]["compile"].update(
            compile_s=secs,
            total_s=rows[p]["compile"]["trace_s"] + rows[p]["compile"]["lower_s"] + secs,
            concurrent=workers,
        )
        log(
            f"  {p}: temp {mem['temp_size_in_bytes'] / 1e6:.1f} MB, kept on device {kept['device_bytes'] / 1e6:.1f} "
            "MB, "
            f"on host {kept['host_bytes'] / 1e6:.1f} MB, recomputed {kept['recomputed_bytes'] / 1e6:.1f} MB"
        )
    return trainers, compiled, rows


def _time_presets(trainers: dict, compiled: dict, rows: dict, presets, rounds: int, state, tokens):
    """A warm-up step of each preset, then `rounds` alternated rounds of one step each, the matmul rate
    measured before each round. Returns (step seconds per preset, the rounds' matmul rates, state)."""
    import jax

    def run(p):
        nonlocal state
        state = jax.device_put(state, trainers[p].state_shardings)  # memory kinds differ between presets
        jax.block_until_ready(state)
        state, m, times = timed_steps(compiled[p], state, tokens, warmup=0, steps=1)
        return times[0], float(m["loss"])

    for p in presets:  # warm-up: first-call allocation and dispatch costs
        rows[p]["warmup_s"], rows[p]["loss"] = run(p)
    times = {p: [] for p in presets}
    round_rates = []
    for r in range(rounds):
        # The matmul rate right before the round, under the same load as the round's steps.
        round_rates.append(max(measure_matmul(n, "float32", repeats=3, chain=4) for n in (512, 1024)))
        for p in round_order(presets, r):
            times[p].append(run(p)[0])
        log(
            f"  round {r + 1}/{rounds} (matmul {round_rates[-1] / 1e9:.0f} GFLOP/s): "
            + ", ".join(f"{p} {times[p][-1]:.2f}s" for p in presets)
        )
    return times, round_rates, state


def bench_family(
    key: str, model, presets, batch: int, seq: int, rounds: int, profile: bool, fast_compile: bool = False
) -> dict:
    import jax

    from zoo.counts import count_params, flops_per_token

    tokens_per_step = batch * seq
    fpt = flops_per_token(model, seq)
    log(
        f"{key}: {count_params(model) / 1e6:.1f}M params ({count_params(model, active=True) / 1e6:.1f}M active), "
        f"{fpt / 1e6:.1f} MFLOP/token, batch {batch}x{seq}"
    )
    trainers, compiled, rows = _compile_presets(model, presets, batch, seq, fast_compile)
    t0 = time.perf_counter()
    state = trainers["none"].init()
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    tokens = C.tokens_for(trainers["none"])
    times, round_rates, state = _time_presets(trainers, compiled, rows, presets, rounds, state, tokens)
    for p in presets:
        ratios = [t / n for t, n in zip(times[p], times["none"])]
        med = C.median(times[p])
        same_round = [fpt * tokens_per_step / t / rate for t, rate in zip(times[p], round_rates)]
        rows[p].update(
            fraction_of_round_matmul_rate=C.median(same_round),
            step_times_s=times[p],
            median_step_s=med,
            ratio_to_none=C.median(ratios),
            ratios_to_none=ratios,
            model_flops_per_s=fpt * tokens_per_step / med,
        )
    out = {
        "model": {
            "name": key,
            "config": _model_dict(model),
            "params": count_params(model),
            "active_params": count_params(model, active=True),
        },
        "batch": batch,
        "seq": seq,
        "tokens_per_step": tokens_per_step,
        "model_flops_per_token": fpt,
        "init_s": init_s,
        "rounds": rounds,
        "round_matmul_flops_per_s": round_rates,
        "presets": rows,
    }
    if profile:
        log(f"  profiling {key} none")
        out["profile_none"], state = C.profile_step(
            compiled["none"], jax.device_put(state, trainers["none"].state_shardings), tokens
        )
    del state, compiled
    return out


def _model_dict(model) -> dict:
    import dataclasses

    return dataclasses.asdict(model)


def compile_vs_depth(
    model, depths, batch: int, seq: int, presets=("none", "full"), fast_compile: bool = False
) -> list[dict]:
    out = []
    for p in presets:
        for d in depths:
            tr = C.make_trainer(C.train_config(model.replace(num_layers=d), [p], batch, seq, fast_compile=fast_compile))
            _, _, secs = C.trace_and_compile(tr)
            out.append({"preset": p, "num_layers": d, **secs})
            log(
                f"compile {p} at {d} layers: {secs['total_s']:.1f}s (trace {secs['trace_s']:.1f}, lower "
                f"{secs['lower_s']:.1f}, compile {secs['compile_s']:.1f})"
            )
    return out


# --- reporting ---------------------------------------------------------------------------------


def _mb(b) -> str:
    return "-" if b is None else f"{b / 1e6:.1f}"


def markdown(res: dict) -> str:
    peak = res["matmul"]["best_flops_per_s"]
    lines = []
    for key, fam in res["families"].items():
        m = fam["model"]
        lines += [
            f"**{key}** ({m['config']['family']}, {m['params'] / 1e6:.1f}M params, {m['active_params'] / 1e6:.1f}M "
            "active; "
            f"batch {fam['batch']} x {fam['seq']}; {fam['model_flops_per_token'] / 1e6:.1f} MFLOP/token; medians of "
            f"{fam['rounds']} rounds)",
            "",
            "| preset | tags kept on device (MB) | on host (MB) | recomputed (MB) | compiled temp (MB) | host temp "
            "(MB) | step (s) | ratio to none | model GFLOP/s | of matmul rate (same round) | of best matmul rate | "
            "compile (s, 2 at a time) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p, r in fam["presets"].items():
            k, mem = r["kept"], r["compiled_memory"] or {}
            lines.append(
                f"| {p} | {_mb(k['device_bytes'])} | {_mb(k['host_bytes'])} | {_mb(k['recomputed_bytes'])} | "
                f"{_mb(mem.get('temp_size_in_bytes'))} | "
                f"{_mb(mem.get('host_temp_size_in_bytes'))} | {r['median_step_s']:.3f} | {r['ratio_to_none']:.3f} | "
                f"{r['model_flops_per_s'] / 1e9:.1f} | {100 * r['fraction_of_round_matmul_rate']:.1f}% | "
                f"{100 * r['model_flops_per_s'] / peak:.1f}% | "
                f"{r['compile']['total_s']:.1f} |"
            )
        lines.append("")
        rr = ", ".join(f"{x / 1e9:.0f}" for x in fam["round_matmul_flops_per_s"])
        lines.append(f"float32 matmul GFLOP/s before each round (best of n = 512, 1024): {rr}")
        lines.append("")
        prof = fam.get("profile_none")
        if prof and "by_category_s" in prof:
            cats = ", ".join(f"{c} {s:.3f}" for c, s in prof["by_category_s"].items())
            gaps = (
                f", {prof['no_op_running_s']:.3f} s with no traced op running (XLA's own dots run there)"
                if "no_op_running_s" in prof
                else ""
            )
            lines.append(
                f"profile of one `none` step ({prof['step_wall_s']:.3f} s wall, {prof['op_seconds_per_step']:.3f} s "
                f"in XLA ops{gaps}), seconds by kind of op: {cats}"
            )
            lines.append("")
    if res.get("compile_vs_depth"):
        lines += [
            "| preset | layers | trace (s) | lower (s) | compile (s) | total (s) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for d in res["compile_vs_depth"]:
            lines.append(
                f"| {d['preset']} | {d['num_layers']} | {d['trace_s']:.1f} | {d['lower_s']:.1f} | "
                f"{d['compile_s']:.1f} | {d['total_s']:.1f} |"
            )
        lines.append("")
    mm = ", ".join(f"{x['n']}: {x['flops_per_s'] / 1e9:.1f}" for x in res["matmul"]["start"] + res["matmul"]["end"])
    lines.append(f"float32 matmul GFLOP/s (n: rate; start then end of the run): {mm}; best {peak / 1e9:.1f}")
    return "\n".join(lines)


_SHORT = {"device": "D", "host": "H", "recomputed": "R", "unread": "-", "mixed": "M"}


def tag_tables(res: dict) -> str:
    """Per model: every tag's bytes over all layers and where the backward pass finds it, per preset
    (D on device, H on host, R recomputed, - not read by the backward pass)."""
    lines = []
    for key, fam in res["families"].items():
        presets = list(fam["presets"])
        tags = list(dict.fromkeys(t for r in fam["presets"].values() for t in r["kept"]["tags"]))
        lines += [
            f"**{key}**: MB per tag over all layers, and where the backward pass finds it (D device, H host, R "
            "recomputed, - unread)",
            "",
            "| tag | " + " | ".join(presets) + " |",
            "|---|" + "---|" * len(presets),
        ]
        for t in tags:
            cells = []
            for p in presets:
                info = fam["presets"][p]["kept"]["tags"].get(t)
                cells.append("" if info is None else f"{_SHORT.get(info['placement'], '?')} {info['bytes'] / 1e6:.1f}")
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    fams = list(res["families"].items())
    fig, axes = plt.subplots(1, len(fams) + 1, figsize=(6 * (len(fams) + 1), 4.8))
    for ax, (key, fam) in zip(axes, fams):
        for p, r in fam["presets"].items():
            k = r["kept"]
            x = (k["device_bytes"] + k["untagged_device_bytes"]) / 1e6
            ax.scatter(x, r["ratio_to_none"], color="tab:red" if k["host_bytes"] else "tab:blue")
            ax.annotate(p, (x, r["ratio_to_none"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("residuals kept on device for the backward pass (MB)")
        ax.set_ylabel("step time / none (median over rounds)")
        ax.set_title(
            f"{key}: {fam['model']['params'] / 1e6:.3g}M params, batch {fam['batch']}x{fam['seq']} (red: offloads)",
            fontsize=9,
        )
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for p in sorted({d["preset"] for d in res.get("compile_vs_depth", [])}):
        pts = [(d["num_layers"], d["total_s"]) for d in res["compile_vs_depth"] if d["preset"] == p]
        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=p)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("layers")
    ax.set_ylabel("trace + lower + compile (s)")
    ax.set_title("compile time against depth (scanned layers)", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.suptitle(
        f"bench/cpu.py, {res['env']['date_utc']}, {res['env']['host_cpu']} ({res['env']['cpu_count']} cores)",
        fontsize=9,
    )
    save_figure(fig, path)


def tables(res: dict) -> str:
    """Everything the record renders: the presets' tables, then where each tag went."""
    return markdown(res) + "\n\n" + tag_tables(res)


def main(argv=None) -> int:
    ap = parser(__doc__, "bench_cpu.json")
    ap.add_argument("--quick", action="store_true", help="toy models and sizes (a smoke test, ~1 min)")
    ap.add_argument("--models", default=None, help="comma list of llama,dsv3 (default both)")
    ap.add_argument("--presets", default=None, help=f"comma list (default all: {','.join(PRESETS)})")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3; quick 2)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument(
        "--depths", default=None, help="comma list of layer counts for compile time (default 4,16,64; '' skips)"
    )
    ap.add_argument(
        "--profile", action="store_true", help="profile one `none` step per model: where the time goes, by op"
    )
    ap.add_argument("--render", default=None, help="print the tables of an earlier run's JSON (nothing runs)")
    args = ap.parse_args(argv)
    if args.render:
        import json

        return render(json.loads(Path(args.render).read_text()), args, tables)
    spec = dict(QUICK if args.quick else FULL)
    presets = tuple(args.presets.split(",")) if args.presets else spec["presets"]
    if "none" not in presets:
        presets = ("none", *presets)
    t_start = time.perf_counter()
    import jax

    env = C.env_info(jax.devices()[:1])
    log(
        f"bench/cpu.py on {env['host_cpu']} ({env['cpu_count']} cores), load {env['load_average']}, jax "
        f"{env['versions']['jax']}"
    )
    res = {
        "schema": SCHEMA,
        "command": command_line("bench/cpu.py", argv),
        "quick": args.quick,
        "fast_compile": spec["fast_compile"],
        "env": env,
        "presets": list(presets),
        "matmul": {"start": measure_matmuls(spec["matmul_sizes"])},
        "families": {},
    }
    _run(res, args, spec, presets)
    res["env"]["load_average_end"] = C.env_info()["load_average"]
    res["wall_s"] = time.perf_counter() - t_start
    C.write_json(args.out, res)
    finish(res, args, tables, plot)
    return 0


def _run(res: dict, args, spec: dict, presets) -> None:
    """Each model's presets (the record written after each), compile time against depth, the matmul rate."""
    batch, seq = args.batch or spec["batch"], args.seq or spec["seq"]
    rounds = args.rounds or spec["rounds"]
    depths = spec["depths"] if args.depths is None else tuple(int(x) for x in args.depths.split(",") if x)
    for key in args.models.split(",") if args.models else list(spec["models"]):
        name, changes = spec["models"][key]
        model = C.bench_model(name, **changes)
        res["families"][key] = bench_family(key, model, presets, batch, seq, rounds, args.profile, spec["fast_compile"])
        res["families"][key]["model"]["size"] = name
        res["families"][key]["model"]["changes"] = changes
        C.write_json(args.out, res)
    if depths:
        name, changes = spec["models"][spec["depth_model"]]
        res["compile_vs_depth"] = compile_vs_depth(
            C.bench_model(name, **changes), depths, batch, seq, spec["depth_presets"], spec["fast_compile"]
        )
    res["matmul"]["end"] = measure_matmuls(spec["matmul_sizes"])
    best = max(x["flops_per_s"] for x in res["matmul"]["start"] + res["matmul"]["end"])
    res["matmul"]["best_flops_per_s"] = best
    for fam in res["families"].values():
        for r in fam["presets"].values():
            r["fraction_of_matmul_rate"] = r["model_flops_per_s"] / best


if __name__ == "__main__":
    from zoo.train.huge_pages import reexec_with_huge_pages

    reexec_with_huge_pages()  # as train.py: glibc reads its malloc tunables only as a process starts
    raise SystemExit(main())
