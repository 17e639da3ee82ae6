"""Checkpoints through train.py's command line: exact resume, a save killed midway, a diverging run,
a checkpoint that does not fit; and restoring onto another mesh and into pinned host memory."""

import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# dsv3_tiny_a (the default model): its state includes the MoE correction biases.
SMALL = ["trainer.steps=8", "data.batch_size=8", "data.seq_len=16", "trainer.progress=false", "xla.cpu_devices=4"]
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def train_cmd(args, run_dir):
    merged = {a.split("=", 1)[0]: a for a in args}  # a later key=value replaces an earlier one
    return [sys.executable, str(ROOT / "train.py"), *merged.values(), f"hydra.run.dir={run_dir}"]


def clean_env():
    env = dict(os.environ)
    env.pop("ZOO_TRACEBACK", None)
    return env


def run(args, run_dir, timeout=300):
    return subprocess.run(train_cmd(args, run_dir), cwd=run_dir.parent, env=clean_env(), capture_output=True, text=True, timeout=timeout)


def metrics(run_dir) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps_in(d: pathlib.Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def fingerprint(d: pathlib.Path) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def read_state(step_dir: pathlib.Path) -> dict:
    """A checkpoint's arrays as numpy, by leaf path (whatever mesh wrote them)."""
    import orbax.checkpoint as ocp

    ckptr = ocp.PyTreeCheckpointer()
    tree = ckptr.metadata(step_dir / "state").item_metadata.tree
    restored = ckptr.restore(step_dir / "state", restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """8 steps on fsdp over 4 devices, a checkpoint every 4: steps 4 and 8."""
    d = tmp_path_factory.mktemp("uninterrupted")
    p = run([*SMALL, "checkpoint.every_n_steps=4", f"checkpoint.dir={d / 'ckpt'}"], d / "run")
    assert p.returncode == 0, p.stderr[-3000:]
    assert steps_in(d / "ckpt") == ["4", "8"]
    return d


def test_resume_from_step_k_reproduces_the_losses_exactly(uninterrupted, tmp_path):
    full = metrics(uninterrupted / "run")
    # The directory a run killed after its step-4 checkpoint leaves behind.
    shutil.copytree(uninterrupted / "ckpt", tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "ckpt" / "8")
    p = run([*SMALL, "checkpoint.every_n_steps=4", f"checkpoint.dir={tmp_path / 'ckpt'}"], tmp_path / "run")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming from step 4" in p.stdout and "restore " in p.stdout
    resumed = metrics(tmp_path / "run")
    assert [r["step"] for r in resumed] == [4, 5, 6, 7]
    for key in ("loss", "grad_norm", "lr", "expert_load_max_over_mean", "moe_dropped_fraction"):
        assert [r[key] for r in resumed] == [r[key] for r in full[4:]], key  # bitwise: same floats
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["start_step"] == 4 and s["steps_run"] == 4 and s["checkpoint"]["steps"] == [4, 8]
    # And the step-8 state it wrote is the uninterrupted run's, bit for bit (MoE biases included).
    a, b = read_state(uninterrupted / "ckpt" / "8"), read_state(tmp_path / "ckpt" / "8")
    assert a.keys() == b.keys() and any("e_score_correction_bias" in k for k in a)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_restore_onto_another_mesh_and_into_pinned_host(uninterrupted, capsys):
    """A checkpoint written on fsdp=4 restores onto fsdp x tensor over 8 devices, with parameters and
    optimizer state in pinned host memory: same values, this run's shardings and memory kinds."""
    from hydra import compose, initialize_config_dir

    from zoo.sharding import memory_kinds
    from zoo.train.checkpoint import Checkpoints
    from zoo.train.run import prepare
    from zoo.train.step import Trainer

    overrides = [*SMALL[:3], "mesh=fsdp_tp", "offload.params=pinned_host", "offload.opt_state=pinned_host", f"checkpoint.dir={uninterrupted / 'ckpt'}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=overrides)
    c, plan, devices, _ = prepare(cfg)
    trainer = Trainer(c, plan, devices)
    ckpt = Checkpoints(c, plan, trainer)
    before = fingerprint(uninterrupted / "ckpt")
    assert ckpt.check() == 8
    assert "restored onto mesh {'data': 1, 'fsdp': 4, 'tensor': 2, 'expert': 1} by 1 (resharded)" in capsys.readouterr().out
    state = ckpt.restore(8)
    ckpt.close()
    assert memory_kinds(state["params"]) == {"pinned_host"} and memory_kinds(state["opt_state"]) == {"pinned_host"}
    assert int(state["step"]) == 8
    saved = read_state(uninterrupted / "ckpt" / "8")
    params = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(state["params"])[0]}
    wq = next(v for k, v in params.items() if k.endswith(".wq_b"))
    assert wq.sharding.mesh.shape["tensor"] == 2 and wq.sharding.spec != jax.sharding.PartitionSpec()
    np.testing.assert_array_equal(np.asarray(wq), next(v for k, v in saved.items() if k.startswith("['params']") and "wq_b" in k))
    restored_leaves = [np.asarray(x) for x in jax.tree.leaves(state)]
    assert len(restored_leaves) == len(saved)
    assert sorted(float(np.abs(x).sum()) for x in restored_leaves) == sorted(float(np.abs(x).sum()) for x in saved.values())
    assert fingerprint(uninterrupted / "ckpt") == before  # reading touched nothing


MISFITS = {
    "other_family": (["model=llama_tiny_a"], r"meta/metadata is from another model \(model\.family=deepseek_v3 there, llama here"),
    "other_size": (["model.num_layers=4"], r"meta/metadata is from another model \(model\.num_layers=3 there, 4 here\)"),
    "other_optimizer_state": (["optimizer.grad_clip=0"], r"meta/metadata holds a state leaf .* \(optimizer\.grad_clip=1\.0 there, 0\.0 here\)"),
    "fewer_steps": (["trainer.steps=4"], r"^error: trainer\.steps: 4, but checkpoint\.dir .* already holds step 8; set trainer\.steps above 8"),
    "resume_off": (["checkpoint.resume=false"], r"already holds checkpoints \(latest step 8\); set checkpoint\.resume=true"),
}


@pytest.mark.parametrize("case", sorted(MISFITS))
def test_checkpoint_that_does_not_fit_one_line_exit_2_untouched(case, uninterrupted, tmp_path):
    args, expected = MISFITS[case]
    ckpt = uninterrupted / "ckpt"
    before = fingerprint(ckpt)
    t0 = time.perf_counter()
    p = run([*SMALL, *args, f"checkpoint.dir={ckpt}"], tmp_path / "run")
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert re.search(expected, lines[0]), lines[0]
    assert ";" in lines[0] and "compile" not in p.stdout
    assert fingerprint(ckpt) == before  # nothing saved was touched
    assert time.perf_counter() - t0 < 30


def test_checkpoint_dir_that_is_a_file(tmp_path):
    f = tmp_path / "not_a_dir"
    f.write_text("x")
    p = run([*SMALL, f"checkpoint.dir={f}"], tmp_path / "run")
    assert p.returncode == 2 and p.stderr.strip() == f"error: checkpoint.dir: {f} is a file; give a directory (or null to disable checkpointing)"
    assert f.read_text() == "x"
    p = run([*SMALL, "checkpoint.dir=/proc/no/such/dir"], tmp_path / "run2")  # /proc takes no new directories
    assert p.returncode == 2 and p.stderr.strip() == "error: checkpoint.dir: cannot create /proc/no/such/dir (No such file or directory); choose a writable directory"


def test_nan_loss_stops_with_one_line_and_keeps_the_last_good_checkpoint(tmp_path):
    """A learning rate of 1e30 really diverges; the run stops at the first non-finite value."""
    ckpt = tmp_path / "ckpt"
    args = ["model=llama_tiny_a", "mesh=single", "xla.cpu_devices=1", "trainer.steps=10", "data.batch_size=8", "data.seq_len=16",
            "trainer.progress=false", "optimizer.lr=1e30", "optimizer.warmup_steps=0", "checkpoint.every_n_steps=1",
            "checkpoint.keep_last=3", f"checkpoint.dir={ckpt}"]  # fmt: skip
    p = run(args, tmp_path / "run")
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1, p.stderr[-3000:]
    assert len(lines) == 1, p.stderr
    m = re.fullmatch(
        r"error: step (\d+): (loss|gradient norm) is (nan|inf|-inf).*: training diverged, and this state was not saved; "
        r"lower optimizer\.lr \(now 1e\+30\) or optimizer\.grad_clip \(now 1\.0\); last good checkpoint: step (\d+) in (.+)",
        lines[0],
    )
    assert m, lines[0]
    bad, good = int(m.group(1)), int(m.group(4))
    assert good == bad - 1 and pathlib.Path(m.group(5)) == ckpt
    assert steps_in(ckpt)[-1] == str(good) and str(bad) not in steps_in(ckpt)
    assert not [n for n in steps_in(ckpt) if TMP_SUFFIX in n]  # the last save completed before exiting
    records = metrics(tmp_path / "run")
    assert len(records) == bad and None in (records[-1]["loss"], records[-1]["grad_norm"])  # NaN is written as null
    state = read_state(ckpt / str(good))
    assert int(state["['step']"]) == good and all(np.isfinite(x).all() for x in state.values())
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_save_killed_midway_leaves_the_latest_checkpoint_loadable(tmp_path):
    """kill -9 while orbax is writing a step (its temporary directory exists): the previous step stays
    complete, the next run resumes from it and recomputes the killed run's logged loss bit for bit."""
    ckpt = tmp_path / "ckpt"
    big = ["model=llama_tiny_a", "model.hidden_size=512", "model.intermediate_size=2048", "model.num_heads=8", "model.num_kv_heads=8",
           "model.head_dim=64", "model.num_layers=4", "mesh=single", "xla.cpu_devices=1", "data.batch_size=4", "data.seq_len=16",
           "optimizer.decay_steps=40", "trainer.log_every=1", "checkpoint.every_n_steps=1", "checkpoint.keep_last=2",
           f"checkpoint.dir={ckpt}"]  # fmt: skip  17M parameters: about 200 MB a checkpoint
    killed_dir = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd([*big, "trainer.steps=40"], killed_dir), cwd=tmp_path, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    in_flight = None
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            names = steps_in(ckpt) if ckpt.exists() else []
            done = [n for n in names if n.isdigit()]
            tmp = [n for n in names if TMP_SUFFIX in n]
            if done and tmp:
                os.kill(proc.pid, signal.SIGKILL)
                in_flight = tmp[0]
                break
            time.sleep(0.005)
    finally:
        if proc.poll() is None and in_flight is None:
            proc.kill()
        proc.wait()
    assert in_flight is not None, "never saw a save in progress"
    assert proc.returncode == -signal.SIGKILL
    names = steps_in(ckpt)
    assert in_flight in names, names  # killed mid-save: the temporary directory was never renamed
    latest = max(int(n) for n in names if n.isdigit())
    assert int(in_flight.split(".")[0]) == latest + 1
    logged = metrics(killed_dir)
    assert len(logged) >= latest + 1  # it logged line `latest` (which made state latest + 1) before saving that state

    p = run([*big, f"trainer.steps={latest + 2}"], tmp_path / "resumed")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resuming from step {latest}" in p.stdout
    resumed = metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [latest, latest + 1]
    # The restored state's first step is the one the killed run computed from the same state.
    assert resumed[0]["loss"] == logged[latest]["loss"] and resumed[0]["grad_norm"] == logged[latest]["grad_norm"]
    names = steps_in(ckpt)
    assert str(latest + 2) in names and not [n for n in names if TMP_SUFFIX in n]  # the stale temporary directory was replaced
