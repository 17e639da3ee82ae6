"""The benchmarks run end to end on CPU at toy sizes, and their JSON holds what docs/benchmarks.md reads.

bench/cpu.py --quick (both families, four presets, LLVM optimisations off, one step profiled) and bench/gpu.py --toy
(Llama, none and its offload preset, two XLA groups in their own processes, the largest-batch
prediction against a made-up memory limit, and the predicted batches run) each run as a subprocess, as a user would run
them. The default run renders the recorded docs/bench_cpu.json the same way. Nothing here imports bench/ (one
child process does: the pieces that keep a stopped bench's finished compiles, checked without stopping one).

The docs' TPU figures are checked against what their record renders: each row of docs/benchmarks.md's TPU
tables against `bench/tpu.py --render docs/bench_tpu.json` (planner columns and the counts quoted in the README,
docs and conf/hardware/tpu_v5e.yaml against `--replan tpu_v5e`, slow tier), so a retyped figure that drifts fails.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = ""  # one CPU device, not the suite's eight
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(args, tmp_path, timeout):
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_cpu_bench_quick(tmp_path):
    out, png = tmp_path / "cpu.json", tmp_path / "cpu.png"
    proc = _run(["bench/cpu.py", "--quick", "--profile", "--out", str(out), "--plot", str(png)], tmp_path, timeout=400)
    res = json.loads(out.read_text())
    assert res["schema"] == "zoo.bench.cpu/1"
    assert res["env"]["host_cpu"] and res["env"]["versions"]["jax"] and res["env"]["date_utc"]
    assert res["matmul"]["best_flops_per_s"] > 0
    assert set(res["families"]) == {"llama", "dsv3"}
    for key, fam in res["families"].items():
        rows = fam["presets"]
        assert set(rows) == {"none", "full", "llama_qkv_offload", "optimizer_host"}
        assert rows["none"]["ratio_to_none"] == pytest.approx(1.0)
        for p, r in rows.items():
            assert math.isfinite(r["loss"]), (key, p)
            assert r["median_step_s"] > 0 and r["ratio_to_none"] > 0 and r["model_flops_per_s"] > 0
            assert 0 < r["fraction_of_matmul_rate"]
            assert len(r["step_times_s"]) == fam["rounds"] == 2
            assert r["compiled_memory"]["temp_size_in_bytes"] > 0
            assert r["compile"]["total_s"] > 0
        kept = {p: r["kept"] for p, r in rows.items()}
        assert kept["none"]["device_bytes"] > kept["full"]["device_bytes"]
        assert kept["full"]["recomputed_bytes"] > 0 and kept["full"]["host_bytes"] == 0
        assert kept["llama_qkv_offload"]["host_bytes"] > 0
        assert kept["llama_qkv_offload"]["tags"]["query_proj"]["placement"] == "host"
        assert rows["optimizer_host"]["policy"] == "none + opt_state on pinned_host"
        prof = fam["profile_none"]  # --profile: where one `none` step's time went, by kind of op
        assert prof["op_seconds_per_step"] > 0 and prof["by_category_s"]["matmul"] > 0
        # the time no traced op covers lies within the step's wall time (overlapping spans count once)
        assert 0 <= prof["no_op_running_s"] < prof["step_wall_s"]
    assert [d["num_layers"] for d in res["compile_vs_depth"]] == [1, 2]
    assert "| preset |" in proc.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_gpu_bench_toy_on_cpu(tmp_path):
    out, png, md = tmp_path / "gpu.json", tmp_path / "gpu.png", tmp_path / "gpu.md"
    _run(
        [
            "bench/gpu.py",
            "--toy",
            "--models",
            "llama",
            "--presets",
            "none,offload",
            "--groups",
            "default,latency_hiding_pipelined_offload",
            "--memory-limit-gb",
            "0.05",
            "--probe-runs",
            "--out",
            str(out),
            "--plot",
            str(png),
            "--md",
            str(md),
        ],
        tmp_path,
        timeout=400,
    )
    res = json.loads(out.read_text())
    assert res["schema"] == "zoo.bench.gpu/1" and res["toy"]
    hw = res["hw"]
    assert hw["link"]["h2d_gbps"] > 0 and hw["link"]["d2h_gbps"] > 0
    assert hw["matmul"]["flops_per_s"] > 0 and hw["matmul"]["dtype"] == "bfloat16"
    assert set(res["groups"]) == {"default", "latency_hiding_pipelined_offload"}
    # Each group ran in its own process, with its own flags.
    assert (
        "--xla_gpu_enable_pipelined_host_offloading=true"
        in res["groups"]["latency_hiding_pipelined_offload"]["xla_flags"]
    )
    assert "pipelined" not in res["groups"]["default"]["xla_flags"]
    for g, group in res["groups"].items():
        runs = {r["preset"]: r for r in group["runs"]}
        assert set(runs) == {"none", "llama_qkv_offload"}
        for p, r in runs.items():
            assert r["status"] == "ok", (g, p, r.get("error"))
            assert r["median_step_s"] > 0 and r["tflops_per_device"] > 0 and r["mfu_vs_matmul"] > 0
            assert r["ratio_to_none"] > 0
            assert r["compiled_memory"]["estimated_peak_bytes"] > 0
        assert runs["none"]["transfer"]["to_host_bytes"] == 0
        off = runs["llama_qkv_offload"]
        assert off["transfer"]["to_host_bytes"] > 0 and off["transfer_time_s"] > 0
        assert "exposed_fraction_vs_none" in off
    planner = {r["preset"]: r["planner"] for r in res["groups"]["default"]["runs"]}
    assert planner["none"]["host_tag_bytes"] == 0 and planner["llama_qkv_offload"]["host_tag_bytes"] > 0
    assert planner["none"]["hides"] is False
    probes = {p["preset"]: p for p in res["probe"]["probes"]}
    assert res["probe"]["limit_bytes"] == 50_000_000 and res["probe"]["verified_by_running"] is True
    assert probes["llama_qkv_offload"]["bytes_per_sequence"] < probes["none"]["bytes_per_sequence"]
    assert probes["llama_qkv_offload"]["predicted_max_batch"] > probes["none"]["predicted_max_batch"] >= 1
    for p in probes.values():  # the predicted batch and one more were run (on CPU nothing runs out of memory)
        b = p["predicted_max_batch"]
        assert p["runs"] == {str(b): "fits", str(b + 1): "fits"} and p["largest_batch_run"] == b + 1
    assert res["targets"]["fits_where_none_does_not"][0]["fits_where_none_does_not"] is True
    assert "| group |" in md.read_text()
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cpu_bench_renders_the_recorded_run():
    """`bench/cpu.py --render docs/bench_cpu.json` (nothing compiles) prints the tables
    docs/benchmarks.md shows: one row per preset with its recorded median step, and the profile line."""
    res = json.loads((ROOT / "docs" / "bench_cpu.json").read_text())
    proc = _run(["bench/cpu.py", "--render", "docs/bench_cpu.json"], None, timeout=120)
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ")]
    for fam in res["families"].values():
        for preset, r in fam["presets"].items():
            assert any(ln.startswith(f"| {preset} |") and f"| {r['median_step_s']:.3f} |" in ln for ln in rows), preset
    assert (
        proc.stdout.count("profile of one `none` step")
        == sum("profile_none" in f for f in res["families"].values())
        > 0
    )


@pytest.mark.slow
def test_sampling_bench_small(tmp_path):
    """bench/sampling.py --small: Zoo and transformers each in its own process, the same greedy tokens."""
    pytest.importorskip("transformers")
    out = tmp_path / "sampling.json"
    _run(["bench/sampling.py", "--small", "--cache-dir", str(tmp_path), "--json", str(out)], tmp_path, timeout=300)
    res = json.loads(out.read_text())
    assert res["same_tokens"] and res["rounds"] == 1 and len(res["runs"][0]["zoo"]["tokens"]) == res["tokens"] == 32
    assert all(s > 0 for s in res["zoo_s_per_token"] + res["torch_s_per_token"]) and res["median_ratio"] > 0
    assert (tmp_path / "qwen2.5-0.5b-shape-small" / "config.json").is_file()  # kept for the next run


def test_gpu_bench_renders_the_recorded_h200_session():
    """`bench/gpu.py --render docs/gpu_h200.json` (nothing runs) prints every recorded run with its
    measured step and compiled peak, and the record holds what docs/benchmarks.md quotes from it."""
    record = json.loads((ROOT / "docs" / "gpu_h200.json").read_text())
    proc = _run(["bench/gpu.py", "--render", "docs/gpu_h200.json"], None, timeout=120)
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ") and not ln.startswith("| group")]
    results = [res for call in record["calls"] for res in call["results"]]
    runs = [r for res in results for g in res["groups"].values() for r in g["runs"]]
    assert len(rows) == len(runs) > 0
    for r in runs:
        peak = (r.get("compiled_memory") or {}).get("estimated_peak_bytes")
        step = f"| {1e3 * r['median_step_s']:.1f} |" if r.get("median_step_s") else "| - |"
        assert any(
            f"| {r['model']} | {r['preset']} | {r['status']} {step}" in ln
            and (peak is None or f"| {peak / 2**30:.2f} |" in ln)
            for ln in rows
        ), (r["model"], r["preset"])
    ok = {(r["model"], r["preset"]): r for r in runs if r["status"] == "ok"}
    none, full, off = (ok[("llama", p)] for p in ("none", "full", "llama_qkv_offload"))
    assert (
        round(100 * none["tflops_per_device"] * 1e12 / results[0]["hw"]["matmul"]["flops_per_s"], 1) == 71.2
    )  # docs: 71.2% of the rate
    assert round(off["median_step_s"] / full["median_step_s"], 3) == 1.225
    assert all(res["dropped_xla_flags"] == [] for res in results)


@pytest.mark.slow
def test_tpu_bench_toy_on_cpu(tmp_path):
    """`bench/tpu.py --toy`: the hardware child, the kernels timed, every toy policy compiled and run in
    alternation (in microbatches), the planner against each run, the derived fastest / fastest
    recompute-only and state-on-host ratio, the JSON and the plot."""
    out = tmp_path / "t.json"
    _run(["bench/tpu.py", "--toy", "--out", str(out), "--plot", str(tmp_path / "t.png")], tmp_path, timeout=900)
    res = json.loads(out.read_text())
    dense = res["setups"]["dense"]
    assert {r["status"] for r in dense["runs"].values()} == {"ok"}, dense["runs"]
    assert dense["fastest"] in dense["runs"] and dense["runs"][dense["fastest_recompute_only"]]["recompute_only"]
    assert all(r["planner"]["time_s"] > 0 for r in dense["runs"].values())
    assert all(r["xla_rematerialized_bytes"] == 0 for r in dense["runs"].values())  # XLA:CPU has no such pass
    # What XLA holds at its peak besides the state, largest first (its live-range dump).
    live = [[v["bytes"] for v in r["xla_live_at_peak"]] for r in dense["runs"].values()]
    assert all(b and b == sorted(b, reverse=True) and b[0] > 0 for b in live), live
    assert res["hw"]["program_link"]["moves"] is False  # on a CPU nothing moves inside a program
    assert dense["runs"]["full+optimizer_host"]["over_state_on_device"] > 0  # against `full`, same run
    kernels = res["kernels"]
    assert all(
        isinstance(ms, float) and ms > 0
        for row in kernels["attention"] + kernels["experts"]
        for ms in row["ms"].values()
    )
    assert (tmp_path / "t.png").stat().st_size > 0


def test_tpu_bench_renders_the_recorded_v5e_session():
    """`bench/tpu.py --render docs/bench_tpu.json` prints each recorded run of the v5e with its measured
    step, and the record holds what docs/benchmarks.md quotes: offload beat the best recompute-only policy."""
    record = json.loads((ROOT / "docs" / "bench_tpu.json").read_text())
    proc = _run(["bench/tpu.py", "--render", "docs/bench_tpu.json"], None, timeout=120)
    runs = record["setups"]["dense"]["runs"]
    for label, r in runs.items():
        if r.get("median_step_s"):
            assert f"| {label} | ok | {1e3 * r['median_step_s']:.1f} |" in proc.stdout, label
    step = {k: r["median_step_s"] for k, r in runs.items() if r.get("median_step_s")}
    assert round(step["minimal_context_offloaded"] / step["minimal"], 3) == 0.935
    assert "fastest minimal_context_offloaded, fastest recompute-only minimal, ratio 0.935" in proc.stdout
    kept_84 = record["setups"]["moe_full_84"]["runs"]["full:context=device"]  # XLA rematerialized 2.14 GB to fit it
    assert f"| {kept_84['compiled_memory']['estimated_peak_bytes'] / 1e9:.2f} (2.14 rematerialized) |" in proc.stdout
    # The MoE: where keeping the attention output no longer fits, offloading it beats recomputing it.
    moe = record["setups"]["moe_full_90"]
    assert all(moe["runs"][p]["status"] == "oom" for p in ("none", "minimal", "save_qkv_proj", "full:context=device"))
    assert "fastest full:context=offload, fastest recompute-only full, ratio 0.969" in proc.stdout


@pytest.mark.slow
def test_the_planners_estimates_against_every_v5e_run():
    """`--render --replan tpu_v5e`: today's planner against each recorded run of the chip, as
    docs/benchmarks.md counts them: the HBM estimate within 10% of XLA's compiled peak for 62 of the
    68 runs, the step within 15% of the measured one for 65, and for every run of `none`, `minimal`
    and `full` on llama_1b's and dsv3_100m's layers (the models the step model was fitted on; two of
    those setups ran only after the fit). Mixtral's and Qwen3-MoE's checkpointed runs (out of
    sample, another family each) are not: docs/benchmarks.md says by how much."""
    proc = _run(["bench/tpu.py", "--render", "docs/bench_tpu.json", "--replan", "tpu_v5e"], None, timeout=600)
    rows, model = [], None
    for ln in proc.stdout.splitlines():
        if ln.startswith("**"):  # a setup's header: **name**: model ...
            model = ln.split(":", 1)[1].split()[0]
        elif ln.startswith("| ") and "| ok |" in ln:
            rows.append((model, ln.strip().strip("|").split("|")))
    hbm, step, presets = [], [], {}
    for model, cells in rows:
        cells = [c.strip() for c in cells]
        xla, planned = float(cells[5].split()[0]), float(cells[7])
        measured, estimated = float(cells[2].split()[0]), float(cells[8])
        hbm.append(abs(planned / xla - 1) <= 0.10)
        step.append(abs(estimated / measured - 1) <= 0.15)
        if cells[0] in ("none", "minimal", "full") and model in ("llama_1b", "dsv3_100m"):
            presets.setdefault(cells[0], []).append(estimated / measured - 1)
    assert len(rows) == 68 and sum(hbm) >= 62 and sum(step) >= 65, (len(rows), sum(hbm), sum(step))
    assert len(presets["none"]) >= 4 and all(abs(e) <= 0.15 for es in presets.values() for e in es), presets
    # The docs' tables, planner columns included, are these estimates; their counts are these counts.
    checked, wrong = _unchecked_doc_rows(proc.stdout, set(_COLUMNS.values()))
    assert checked >= 40 and not wrong, (checked, wrong)
    counts = _planner_counts(proc.stdout)
    assert counts["dense15"] == counts["dense"]  # the docs say "all" of them
    for path, phrase in COUNTS_QUOTED:
        assert phrase.format(**counts) in _flat(path), (path, phrase.format(**counts))


def test_a_stopped_bench_keeps_the_compiles_that_finished():
    """bench/common.py's compile_many reports each compile as it finishes (bench/tpu.py writes each
    one then), and bench/tpu.py's parent marks a run whose compile had not finished when the process
    was stopped at --budget-s as `timeout`, keeping the finished ones. Run in a child, as bench's own
    processes are."""
    code = """
import json, jax, jax.numpy as jnp
from bench import common as C
from bench.tpu import mark_unfinished
x = jnp.ones((8, 8))
items = [(k, jax.jit(lambda a, f=f: a * f).lower(x), None) for f, k in enumerate("abc")]
seen = []
out = C.compile_many(items, 2, done=lambda k, exe, secs: seen.append((k, type(exe).__name__, secs > 0)))
setup = {"runs": {"a": {"status": "compiled"}, "b": {"policy": "b"}, "c": {"status": "oom"}}}
mark_unfinished(setup, 500)
print(json.dumps({"seen": sorted(seen), "keys": sorted(out), "runs": setup["runs"]}))
"""
    proc = _run(["-c", code], None, timeout=120)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [k for k, name, positive in got["seen"]] == ["a", "b", "c"] == got["keys"]
    assert all(name != "Exception" and positive for _, name, positive in got["seen"])
    assert got["runs"]["b"] == {"policy": "b", "status": "timeout", "error": "compile unfinished at --budget-s (500 s)"}
    assert got["runs"]["a"] == {"status": "compiled"} and got["runs"]["c"] == {"status": "oom"}


# --- the docs' TPU figures, checked against what the record renders ---------------------------------

# docs/benchmarks.md's column names -> bench/tpu.py's rendered ones (their cells formatted alike).
_COLUMNS = {
    "step (ms)": "step (ms)",
    "model TFLOP/s": "TFLOP/s",
    "MFU": "MFU",
    "XLA peak (GB)": "XLA peak (GB)",
    "offloaded (GB)": "offloaded (GB)",
    "planner peak (GB)": "planner peak (GB)",
    "planner step (ms)": "planner step (ms)",
}


def _rows(text: str):
    """(header cells, row cells) of each markdown table row in `text`."""
    header = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(line) <= set("|-: "):
            yield header, cells


def _leading_number(cell: str):
    m = __import__("re").match(r"(-?\d+(?:\.\d+)?%?)", cell.replace("*", "").strip())
    return m.group(1) if m else None


def _unchecked_doc_rows(rendered: str, columns) -> tuple[int, list]:
    """Each row of docs/benchmarks.md's TPU tables naming a recorded policy must equal, in every one of
    `columns` it has a figure in, one rendered run of that policy. Returns (rows checked, rows that equal none)."""
    runs = {}
    for header, cells in _rows(rendered):
        if header[:2] == ["policy", "status"]:
            runs.setdefault(cells[0], []).append(dict(zip(header, cells)))
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    tpu = doc[doc.index("## TPU v5e") : doc.index("## Published figures")]
    checked, wrong = 0, []
    for header, cells in _rows(tpu):
        if "policy" not in header:
            continue
        row = dict(zip(header, cells))
        label = row["policy"].replace("*", "").split(" (")[0].strip()
        figures = {_COLUMNS[c]: _leading_number(v) for c, v in row.items() if c in _COLUMNS and _COLUMNS[c] in columns}
        figures = {c: v for c, v in figures.items() if v is not None}
        if label not in runs or not figures:
            continue
        checked += 1
        if not any(all(_leading_number(run[c]) == v for c, v in figures.items()) for run in runs[label]):
            wrong.append((label, figures))
    return checked, wrong


def test_the_docs_tpu_tables_are_the_records():
    """Every measured figure in docs/benchmarks.md's TPU tables (step, throughput, MFU, XLA's peak, bytes
    offloaded) is what `bench/tpu.py --render docs/bench_tpu.json` prints for that policy: a figure
    retyped wrong, or a record changed without its docs, fails here."""
    proc = _run(["bench/tpu.py", "--render", "docs/bench_tpu.json"], None, timeout=120)
    checked, wrong = _unchecked_doc_rows(
        proc.stdout, {"step (ms)", "TFLOP/s", "MFU", "XLA peak (GB)", "offloaded (GB)"}
    )
    assert checked >= 40 and not wrong, (checked, wrong)


# Where the docs, the README and the profile quote the planner's counts against the chip (`--render
# --replan` prints them: bench/tpu.py's planner_counts), and the profile's fitted figures.
COUNTS_QUOTED = [
    ("README.md", "its step estimate is within 15% of the chip's for {step15} of {runs} runs"),
    ("conf/hardware/tpu_v5e.yaml", "Within 15% of the chip's step for {step15} of {runs} runs, {step10} within 10%"),
    ("docs/offload.md", "the estimate is within 15% of {step15} of the {runs} runs there"),
    ("docs/offload.md", "within 10% of XLA's compiled peak for {hbm10} of {runs} runs"),
    ("docs/benchmarks.md", "as a ratio to the measurement, {runs} runs:"),
    ("docs/benchmarks.md", "**Step time: {step15} of {runs} within 15%, {step10} within 10%**; all {dense} dense runs"),
    ("docs/benchmarks.md", "and {moe15} of {moe} MoE runs"),
    ("docs/benchmarks.md", "**HBM: {hbm10} of {runs} within 10%, {hbm15} within 15%**"),
    ("docs/benchmarks.md", "plus what XLA rematerialized (the program as written, below), {remat10} of the {runs} are"),
]
PROFILE_QUOTED = [
    ("docs/benchmarks.md", "(`hardware.op_rates`, below) times `step_efficiency` {step_efficiency};"),
    ("docs/benchmarks.md", "{activation_passes} passes (`activation_passes`) over the layers' activations"),
    ("docs/benchmarks.md", "and {recompute_passes} more passes for a policy that checkpoints (`recompute_passes`)"),
    ("docs/benchmarks.md", "a recomputed tag's producer at {recompute_cost} of its own time (`recompute_cost`)"),
    ("docs/offload.md", "On a TPU v5e {activation_passes} and {recompute_passes} passes at"),
    ("docs/offload.md", "it is {recompute_cost} (and `step_efficiency` {step_efficiency})"),
]


def _flat(path: str) -> str:
    """A text's words on one line (a YAML file's comments without their `#`)."""
    lines = (ROOT / path).read_text().splitlines()
    return " ".join(" ".join(line.lstrip("# ") for line in lines).split())


def _planner_counts(text: str) -> dict:
    import re

    flat = " ".join(text.split())
    m = re.search(
        r"the planner against the chip, (?P<runs>\d+) runs: - step: (?P<step15>\d+) of \d+ within 15%, "
        r"(?P<step10>\d+) within 10%; dense (?P<dense15>\d+) of (?P<dense>\d+), MoE (?P<moe15>\d+) of "
        r"(?P<moe>\d+) within 15% - HBM: (?P<hbm10>\d+) of \d+ within 10%, (?P<hbm15>\d+) within 15%; against "
        r"XLA's peak plus what it rematerialized (?P<remat10>\d+) of \d+ within 10%",
        flat,
    )
    assert m, text[-2000:]
    return m.groupdict()


def test_the_docs_quote_the_profiles_fitted_figures():
    """The step model's four figures, where the docs quote them, are conf/hardware/tpu_v5e.yaml's (which
    `bench/tpu.py --fit` rewrites: a refit that moves them fails here until the docs follow)."""
    import yaml

    profile = yaml.safe_load((ROOT / "conf" / "hardware" / "tpu_v5e.yaml").read_text())
    values = {
        k: f"{profile[k]:g}" for k in ("step_efficiency", "recompute_cost", "activation_passes", "recompute_passes")
    }
    for path, phrase in PROFILE_QUOTED:
        assert phrase.format(**values) in _flat(path), (path, phrase.format(**values))
