"""train.py through the real command line: bad input fails fast with one line; a run and a sweep work."""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAST = ["trainer.steps=3", "data.batch_size=8", "data.seq_len=16", "trainer.log_every=1"]


def run(args, tmp_path, timeout=300):
    env = dict(os.environ)  # conftest.py's XLA_FLAGS: 8 simulated CPU devices
    env.pop("ZOO_TRACEBACK", None)
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
    )
    return p, time.perf_counter() - t0


BAD_INPUTS = {
    "unknown_group_option": (["offload=no_such_policy"], "error: offload: unknown option 'no_such_policy'; choose one of "),
    "unknown_key": (["trainer.stepz=3"], "error: trainer.stepz: unknown key; known keys here: steps, "),
    "unknown_value": (["model.moe.impl=dense"], "error: model.moe.impl: got 'dense'; choose one of"),
    "null_section": (["model=llama_tiny_a", "model.moe.impl=capacity"], "error: model.moe.impl: model.moe is null in the chosen model option"),
    "wrong_type": (["trainer.steps=many"], "error: trainer.steps: Value 'many' of type 'str' could not be converted to Integer"),
    "mesh_product": (["mesh=dp", "mesh.data=3"], "error: mesh: data*fsdp*tensor*expert = 3*1*1*1 = 3 does not match the 8 devices"),
    "mesh_fill": (["mesh.tensor=3"], "error: mesh.tensor: 3 (mesh=fsdp) needs a multiple of 3 devices, and 8 are available"),
    "batch": (["data.batch_size=12"], "error: data.batch_size: 12 is not divisible by the data-parallel size 8"),
    "seq": (["data.seq_len=129"], "error: data.seq_len: 129 exceeds model.max_position_embeddings=128"),
    "indivisible_param": (["model=llama_tiny_a", "mesh=fsdp_tp", "mesh.tensor=4", "mesh.fsdp=2"], "error: mesh.tensor: dim 2 of "),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_one_line_nonzero_exit_before_compile(case, tmp_path):
    args, expected = BAD_INPUTS[case]
    p, seconds = run(args, tmp_path)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(expected), lines[0]
    assert ";" in lines[0]  # the fix follows the problem
    assert "compile" not in p.stdout  # it stopped before compiling anything
    assert seconds < 15, f"took {seconds:.1f}s"


def test_train_cli_llama_tensor_parallel_bf16(tmp_path):
    p, _ = run(["model=llama_tiny_a", "mesh=fsdp_tp", "model.compute_dtype=bfloat16", *FAST], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "run"
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_device", "mfu", "device_bytes_in_use", "device_peak_bytes"):
        assert key in records[0], key
    assert records[0]["device_peak_bytes"] is None  # the CPU backend reports no memory stats
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "ok" and s["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}
    assert s["compiled_memory"]["temp_size_in_bytes"] > 0 and s["peak_memory_source"] == "compiled.memory_analysis"
    assert s["config"]["model"]["compute_dtype"] == "bfloat16" and s["config"]["model"]["param_dtype"] == "float32"
    assert s["mfu"] > 0 and s["tokens_per_s"] > 0
    assert "loss" in p.stdout and "summary:" in p.stdout


def test_sweep_reports_failed_job_and_continues_then_report(tmp_path):
    args = ["-m", "offload=none,full", "data.seq_len=16,999", "model=llama_tiny_a", "mesh=single", "trainer.steps=2", "data.batch_size=8"]
    p, _ = run([*args, "trainer.progress=false"], tmp_path)
    assert p.returncode == 1, p.stderr[-3000:]  # the sweep ran to the end, then reports its failures
    sweep = tmp_path / "sweep"
    summaries = {d.name: json.loads((d / "summary.json").read_text()) for d in sorted(sweep.iterdir()) if d.is_dir()}
    assert sorted(summaries) == ["0", "1", "2", "3"]
    assert [summaries[k]["status"] for k in "0123"] == ["ok", "failed", "ok", "failed"]
    assert "data.seq_len=999" in summaries["1"]["overrides"] and summaries["1"]["error"].startswith("data.seq_len: 999 exceeds")
    failed_lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error: job")]
    assert len(failed_lines) == 2 and "data.seq_len=999" in failed_lines[0]

    r = subprocess.run([sys.executable, "-m", "zoo.report", str(sweep)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    table = (sweep / "report.md").read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| offload=")]
    assert len(rows) == 4 and sum("| ok |" in ln for ln in rows) == 2
    assert sum(ln.rstrip().endswith("| yes |") for ln in rows) >= 1  # a Pareto front exists
    assert (sweep / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_xla_flags_merge_with_environment():
    from zoo.train.config import XlaConfig
    from zoo.train.run import merged_xla_flags

    c = XlaConfig(flags=["--xla_gpu_enable_latency_hiding_scheduler=true"], cpu_devices=4)
    env = "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d"
    assert merged_xla_flags(c, env).split() == [
        "--xla_dump_to=/tmp/d",
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_force_host_platform_device_count=4",
    ]
    assert merged_xla_flags(XlaConfig(), None) == ""


NEW_FAMILIES = ("qwen2_tiny_a", "qwen3_tiny_a", "qwen3_moe_tiny_a", "mixtral_tiny_a", "gemma3_tiny_a", "gpt_oss_tiny_a")


@pytest.mark.slow
def test_every_new_family_trains_from_the_command_line(tmp_path):
    # One sweep, one process: `python train.py model=<tiny>` for each family, on learnable data.
    args = ["-m", f"model={','.join(NEW_FAMILIES)}", "mesh=single", "trainer.steps=40", "data.batch_size=16",
            "data.seq_len=32", "trainer.progress=false", "optimizer.lr=1e-2"]
    p, _ = run(args, tmp_path, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    summaries = [json.loads(s.read_text()) for s in sorted((tmp_path / "sweep").glob("*/summary.json"))]
    assert sorted(s["config"]["model"]["family"] for s in summaries) == sorted(f.rsplit("_tiny_a", 1)[0] for f in NEW_FAMILIES)
    for s in summaries:
        assert s["status"] == "ok"
        assert s["last_loss"] < s["first_loss"] - 0.5, (s["config"]["model"]["family"], s["first_loss"], s["last_loss"])
