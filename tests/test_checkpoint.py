"""Checkpoints through train.py's command line: exact resume past damaged steps, a save killed
midway, SIGTERM mid-run and the same command resuming, a second run on a locked directory, an
unwritable directory, a diverging run, a checkpoint that does not fit; restoring onto another mesh
and into pinned host memory; and, in process, the host loop's order of dispatches, reads and saves."""

import gc
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import in_process
import jax
import numpy as np
import pytest

from zoo.train import huge_pages

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


def run(args, run_dir, timeout=900):
    return subprocess.run(
        train_cmd(args, run_dir), cwd=run_dir.parent, env=clean_env(), capture_output=True, text=True, timeout=timeout
    )


# The commands of the tests marked `in_process` run in one pytest process (tests/in_process.py), with JAX
# started as train.py starts it for SMALL's xla.cpu_devices=4; `uninterrupted` there is this process's.
UNINTERRUPTED_ENV = "ZOO_TEST_UNINTERRUPTED"


def in_process_env(request) -> dict:
    return {UNINTERRUPTED_ENV: str(request.getfixturevalue("uninterrupted")), "XLA_FLAGS": in_process.xla_flags(4)}


def run_in_process(args, run_dir, capfd, monkeypatch):
    """`run`'s command in this process (in_process.INNER)."""
    return in_process.run(train_cmd(args, run_dir), run_dir.parent, capfd, monkeypatch)


def metrics(run_dir) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps_in(d: pathlib.Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def fingerprint(d: pathlib.Path) -> dict:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()
    }


def read_state(step_dir: pathlib.Path) -> dict:
    """A checkpoint's arrays as numpy, by leaf path (whatever mesh wrote them)."""
    import orbax.checkpoint as ocp

    ckptr = ocp.PyTreeCheckpointer()
    tree = ckptr.metadata(step_dir / "state").item_metadata.tree
    restored = ckptr.restore(
        step_dir / "state", restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    )
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]}


EVERY = ["checkpoint.every_n_steps=1", "checkpoint.keep_last=5"]
KEYS = ("loss", "grad_norm", "lr", "expert_load_max_over_mean", "moe_dropped_fraction")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """8 steps on fsdp over 4 devices, a checkpoint every step, the last 5 kept: steps 4 to 8."""
    if in_process.INNER:
        return pathlib.Path(os.environ[UNINTERRUPTED_ENV])
    d = tmp_path_factory.mktemp("uninterrupted")
    p = run([*SMALL, *EVERY, f"checkpoint.dir={d / 'ckpt'}"], d / "run")
    assert p.returncode == 0, p.stderr[-3000:]
    assert steps_in(d / "ckpt") == ["4", "5", "6", "7", "8"]  # and no lock left behind
    # train.py started itself again with glibc's huge-page tunable where this machine takes it.
    tunables, on, _ = huge_pages.plan(clean_env())
    assert (
        f"host memory: large buffers {'on transparent huge pages' if on or tunables else 'on 4 KiB pages'} ("
        in p.stdout
    )
    return d


def truncate_an_array_file(step_dir: pathlib.Path) -> None:
    f = max((step_dir / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def delete_the_data_files(step_dir: pathlib.Path) -> None:
    for d in (step_dir / "state").rglob("d"):
        shutil.rmtree(d)


def delete_the_manifest(step_dir: pathlib.Path) -> None:
    (step_dir / "state" / "manifest.ocdbt").unlink()


def test_resume_skips_damaged_steps_and_reproduces_the_losses_exactly(uninterrupted, tmp_path):
    """A run killed after its step-7 checkpoint, whose steps 7, 6 and 5 were then damaged three ways:
    each is skipped with one line, the run resumes from step 4 and recomputes the uninterrupted run's
    losses and final state bit for bit."""
    full = metrics(uninterrupted / "run")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(uninterrupted / "ckpt", ckpt)
    shutil.rmtree(ckpt / "8")
    truncate_an_array_file(ckpt / "7")
    delete_the_data_files(ckpt / "6")
    delete_the_manifest(ckpt / "5")
    p = run([*SMALL, *EVERY, f"checkpoint.dir={ckpt}"], tmp_path / "run")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "Event loop is closed" not in p.stderr, p.stderr[
        -3000:
    ]  # nothing from the failed reads
    notes = [ln for ln in p.stdout.splitlines() if "is unreadable" in ln]
    expected = {
        7: r"an array file is truncated: OUT_OF_RANGE: .*",
        6: r"a file is missing: NOT_FOUND: .*",
        5: r"state/manifest\.ocdbt is missing",
    }
    assert len(notes) == 3, p.stdout
    for line, (step, why) in zip(notes, expected.items()):
        assert re.fullmatch(
            rf"note: checkpoint\.dir: step {step} in {re.escape(str(ckpt))} is unreadable \({why}\); skipped, trying "
            rf"step {step - 1}",
            line,
        ), line
        assert "tensorstore_spec" not in line and len(line) < 500
    assert f"checkpoints: {ckpt}, resuming from step 4 (unreadable steps 7, 6, 5 renamed <step>.unreadable)" in p.stdout
    resumed = metrics(tmp_path / "run")
    assert [r["step"] for r in resumed] == [4, 5, 6, 7]
    for key in KEYS:
        assert [r[key] for r in resumed] == [r[key] for r in full[4:]], key  # bitwise: same floats
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["start_step"] == 4 and s["steps_run"] == 4 and s["checkpoint"]["steps"] == [4, 5, 6, 7, 8]
    assert steps_in(ckpt) == [
        "4",
        "5",
        "5.unreadable",
        "6",
        "6.unreadable",
        "7",
        "7.unreadable",
        "8",
    ]  # kept, not deleted
    # And the step-8 state it wrote is the uninterrupted run's, bit for bit (MoE biases included).
    a, b = read_state(uninterrupted / "ckpt" / "8"), read_state(ckpt / "8")
    assert a.keys() == b.keys() and any("e_score_correction_bias" in k for k in a)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_every_step_unreadable_stops_in_one_line_before_compiling(uninterrupted, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(uninterrupted / "ckpt", ckpt)
    shutil.rmtree(ckpt / "8")
    truncate_an_array_file(ckpt / "7")
    (ckpt / "6" / "meta" / "metadata").unlink()
    delete_the_manifest(ckpt / "5")
    delete_the_data_files(ckpt / "4")
    before = fingerprint(ckpt)
    p = run([*SMALL, *EVERY, f"checkpoint.dir={ckpt}"], tmp_path / "run")
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert re.fullmatch(
        rf"error: checkpoint\.dir: step 4 in {re.escape(str(ckpt))} is unreadable \(a file is missing: NOT_FOUND: "
        rf".*\), as are the newer "
        rf"steps 5, 6, 7: no intact checkpoint is left; move the step directories out of {re.escape(str(ckpt))} to "
        rf"start from step 0, "
        "or give another checkpoint.dir",
        lines[0],
    ), lines[0]
    assert "step 6 in" in p.stdout and "meta/metadata is missing" in p.stdout
    assert "s, compile " not in p.stdout
    assert fingerprint(ckpt) == before  # nothing renamed, nothing deleted


def test_sigterm_mid_run_then_the_same_command_resumes_bit_for_bit(uninterrupted, tmp_path):
    """SIGTERM mid-run: the step in flight finishes, its state is saved, one line, exit 75. While the
    run held the directory, a second run on it was refused in one line before any step. The same
    command then resumes into the same output directory: metrics.jsonl is appended to, and every
    step's loss is the uninterrupted run's, bit for bit."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    args = [*SMALL, "checkpoint.every_n_steps=100", f"checkpoint.dir={ckpt}"]
    log = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen(
        train_cmd(args, out), cwd=tmp_path, env=clean_env(), stdout=log, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        records = out / "metrics.jsonl"  # created empty before step 1
        while proc.poll() is None and time.monotonic() < deadline and not (records.exists() and records.stat().st_size):
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGSTOP)  # frozen within a step of the first metrics line
        lock = json.loads((ckpt / "zoo.lock").read_text())
        assert lock["pid"] == proc.pid and lock["host"] == socket.gethostname()

        second = run(args, tmp_path / "second")
        lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
        assert lines[0].startswith(
            f"error: checkpoint.dir: {ckpt} is in use by another run (pid {proc.pid} on {socket.gethostname()}, "
            "started "
        )
        assert "s, compile " not in second.stdout and not (tmp_path / "second" / "metrics.jsonl").exists()

        os.kill(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The run was frozen (SIGSTOP) for as long as the second run took, perhaps inside a collective: XLA:CPU's
    # rendezvous then logs that its threads arrived late (rendezvous.cc), which is XLA's, not the run's, output.
    lines = [ln for ln in err.splitlines() if ln.strip() and "rendezvous.cc:" not in ln]
    assert proc.returncode == 75, err[-3000:]
    assert len(lines) == 1, err
    m = re.fullmatch(
        rf"stopped by SIGTERM after step (\d+): checkpoint step (\d+) in {re.escape(str(ckpt))}; run the same command "
        rf"to resume \(exit code 75\)",
        lines[0],
    )
    assert m and m.group(1) == m.group(2), lines[0]
    stopped = int(m.group(1))
    assert 1 <= stopped < 8 and steps_in(ckpt) == [str(stopped)]  # saved, complete, and the lock released
    assert [r["step"] for r in metrics(out)] == list(range(stopped))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["last_step"] == stopped and summary["exit_code"] == 75

    p = run(args, out)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resuming from step {stopped}" in p.stdout
    full, resumed = metrics(uninterrupted / "run"), metrics(out)
    assert [r["step"] for r in resumed] == list(range(8))  # appended to the first run's records
    for key in KEYS:
        assert [r[key] for r in resumed] == [r[key] for r in full], key


def unwritable_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """An existing directory this process cannot write in: read-only permissions, or (as root, whom
    permissions do not stop) sysfs, which takes no new files from anyone."""
    d = tmp_path / "read_only"
    d.mkdir()
    d.chmod(0o555)
    try:
        (d / "x").write_text("x")
    except OSError:
        return d
    (d / "x").unlink()
    if not pathlib.Path("/sys/kernel").is_dir():
        pytest.skip("running as root without sysfs: no directory here refuses writes")
    return pathlib.Path("/sys/kernel")


@in_process.MARK
def test_unwritable_checkpoint_dir_is_refused_before_any_step(tmp_path, request, capfd, monkeypatch):
    if not in_process.INNER:
        return in_process.outcome(request, in_process_env)
    d = unwritable_dir(tmp_path)
    p = run_in_process([*SMALL, f"checkpoint.dir={d}"], tmp_path / "run", capfd, monkeypatch)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert re.fullmatch(
        rf"error: checkpoint\.dir: cannot write in {re.escape(str(d))} "
        r"\((Permission denied|Read-only file system)\); "
        "choose a writable directory or fix its permissions",
        lines[0],
    ), lines[0]
    assert "s, compile " not in p.stdout and "step 1" not in p.stdout


def test_restore_onto_another_mesh_and_into_pinned_host(uninterrupted, capsys):
    """A checkpoint written on fsdp=4 restores onto fsdp x tensor over 8 devices, with parameters and
    optimizer state in pinned host memory: same values, this run's shardings and memory kinds."""
    from hydra import compose, initialize_config_dir

    from zoo.sharding import memory_kinds
    from zoo.train.checkpoint import Checkpoints
    from zoo.train.run import prepare
    from zoo.train.step import Trainer

    overrides = [
        *SMALL[:3],
        "mesh=fsdp_tp",
        "offload.params=pinned_host",
        "offload.opt_state=pinned_host",
        f"checkpoint.dir={uninterrupted / 'ckpt'}",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=overrides)
    c, plan, devices, _ = prepare(cfg)
    trainer = Trainer(c, plan, devices)
    ckpt = Checkpoints(c, plan, trainer)
    before = fingerprint(uninterrupted / "ckpt")
    assert ckpt.check() == 8
    assert (
        "restored onto mesh {'data': 1, 'fsdp': 4, 'tensor': 2, 'expert': 1} by 1 (resharded)"
        in capsys.readouterr().out
    )
    state = ckpt.restore(8)
    ckpt.close()
    assert memory_kinds(state["params"]) == {"pinned_host"} and memory_kinds(state["opt_state"]) == {"pinned_host"}
    assert int(state["step"]) == 8
    saved = read_state(uninterrupted / "ckpt" / "8")
    params = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(state["params"])[0]}
    wq = next(v for k, v in params.items() if k.endswith(".wq_b"))
    assert wq.sharding.mesh.shape["tensor"] == 2 and wq.sharding.spec != jax.sharding.PartitionSpec()
    np.testing.assert_array_equal(
        np.asarray(wq), next(v for k, v in saved.items() if k.startswith("['params']") and "wq_b" in k)
    )
    restored_leaves = [np.asarray(x) for x in jax.tree.leaves(state)]
    assert len(restored_leaves) == len(saved)
    assert sorted(float(np.abs(x).sum()) for x in restored_leaves) == sorted(
        float(np.abs(x).sum()) for x in saved.values()
    )
    assert fingerprint(uninterrupted / "ckpt") == before  # reading touched nothing


MISFITS = {
    "other_family": (
        ["model=llama_tiny_a"],
        r"meta/metadata is from another model \(model\.family=deepseek_v3 there, llama here",
    ),
    "other_size": (
        ["model.num_layers=4"],
        r"meta/metadata is from another model \(model\.num_layers=3 there, 4 here\)",
    ),
    "other_optimizer_state": (
        ["optimizer.grad_clip=0"],
        r"meta/metadata holds a state leaf .* \(optimizer\.grad_clip=1\.0 there, 0\.0 here\)",
    ),
    "fewer_steps": (
        ["trainer.steps=4"],
        r"^error: trainer\.steps: 4, but checkpoint\.dir .* already holds step 8; set trainer\.steps above 8",
    ),
    "resume_off": (
        ["checkpoint.resume=false"],
        r"already holds checkpoints \(latest step 8\); set checkpoint\.resume=true",
    ),
}


@in_process.MARK
@pytest.mark.parametrize("case", sorted(MISFITS))
def test_checkpoint_that_does_not_fit_one_line_exit_2_untouched(
    case, uninterrupted, tmp_path, request, capfd, monkeypatch
):
    if not in_process.INNER:
        return in_process.outcome(request, in_process_env)
    args, expected = MISFITS[case]
    ckpt = uninterrupted / "ckpt"
    before = fingerprint(ckpt)
    t0 = time.perf_counter()
    p = run_in_process([*SMALL, *args, f"checkpoint.dir={ckpt}"], tmp_path / "run", capfd, monkeypatch)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert re.search(expected, lines[0]), lines[0]
    assert ";" in lines[0] and "s, compile " not in p.stdout
    assert fingerprint(ckpt) == before  # nothing saved was touched
    # Refused before compiling is what the stdout check above proves; the wall time is only a loose
    # guard (a 2-core machine shared with other jobs took 30 s for the process start alone).
    assert time.perf_counter() - t0 < 120


@in_process.MARK
def test_checkpoint_dir_that_is_a_file(tmp_path, request, capfd, monkeypatch):
    if not in_process.INNER:
        return in_process.outcome(request, in_process_env)
    f = tmp_path / "not_a_dir"
    f.write_text("x")
    p = run_in_process([*SMALL, f"checkpoint.dir={f}"], tmp_path / "run", capfd, monkeypatch)
    assert (
        p.returncode == 2
        and p.stderr.strip()
        == f"error: checkpoint.dir: {f} is a file; give a directory (or null to disable checkpointing)"
    )
    assert f.read_text() == "x"
    p = run_in_process(  # /proc takes no new directories
        [*SMALL, "checkpoint.dir=/proc/no/such/dir"], tmp_path / "run2", capfd, monkeypatch
    )
    assert p.returncode == 2 and p.stderr.strip() == (
        "error: checkpoint.dir: cannot create /proc/no/such/dir (No such file or directory); choose a "
        "writable directory"
    )


def test_nan_loss_stops_with_one_line_and_keeps_the_last_good_checkpoint(tmp_path):
    """A learning rate of 1e30 really diverges; the run stops at the first non-finite value."""
    ckpt = tmp_path / "ckpt"
    args = [
        "model=llama_tiny_a",
        "mesh=single",
        "xla.cpu_devices=1",
        "trainer.steps=10",
        "data.batch_size=8",
        "data.seq_len=16",
        "trainer.progress=false",
        "optimizer.lr=1e30",
        "optimizer.warmup_steps=0",
        "checkpoint.every_n_steps=1",
        "checkpoint.keep_last=3",
        f"checkpoint.dir={ckpt}",
    ]
    p = run(args, tmp_path / "run")
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1, p.stderr[-3000:]
    assert len(lines) == 1, p.stderr
    m = re.fullmatch(
        r"error: step (\d+): (loss|gradient norm) is (nan|inf|-inf).*: training diverged, and this state was not "
        r"saved; "
        r"lower optimizer\.lr \(now 1e\+30\) or optimizer\.grad_clip \(now 1\.0\); last good checkpoint: step (\d+) "
        r"in (.+)",
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


@pytest.mark.slow  # a run killed while it saves, then two more: ~170 s on the loaded 2-core machine
def test_save_killed_midway_leaves_the_latest_checkpoint_loadable(tmp_path):
    """kill -9 while orbax is writing a step (its temporary directory exists): the previous step stays
    complete, the next run resumes from it and recomputes the killed run's logged loss bit for bit."""
    ckpt = tmp_path / "ckpt"
    big = [
        "model=llama_tiny_a",
        "model.hidden_size=512",
        "model.intermediate_size=2048",
        "model.num_heads=8",
        "model.num_kv_heads=8",
        "model.head_dim=64",
        "model.num_layers=4",
        "mesh=single",
        "xla.cpu_devices=1",
        "data.batch_size=4",
        "data.seq_len=16",
        "optimizer.decay_steps=40",
        "trainer.log_every=1",
        "checkpoint.every_n_steps=1",
        "checkpoint.keep_last=2",
        f"checkpoint.dir={ckpt}",
        # the resumed run is shorter: with `auto` its model FLOPs could pick the other LLVM level, whose
        # float rounding differs, and this test compares losses bit for bit
        "xla.cpu_fast_compile=true",
    ]  # fmt: skip  17M parameters: about 200 MB a checkpoint
    killed_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        train_cmd([*big, "trainer.steps=40"], killed_dir),
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
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
    assert (
        f"note: checkpoint.dir: took over the lock of pid {proc.pid} on {socket.gethostname()}" in p.stdout
    )  # kill -9 left it
    resumed = metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [latest, latest + 1]
    # The restored state's first step is the one the killed run computed from the same state.
    assert resumed[0]["loss"] == logged[latest]["loss"] and resumed[0]["grad_norm"] == logged[latest]["grad_norm"]
    names = steps_in(ckpt)
    assert str(latest + 2) in names and not [
        n for n in names if TMP_SUFFIX in n
    ]  # the stale temporary directory was replaced


def test_save_killed_leaves_a_stale_lock_that_the_next_run_takes_over(tmp_path):
    """(In process.) A lock whose process is gone, or whose pid now belongs to a younger process, is
    stale; a live owner's is not, and names it."""
    from zoo.train.run_lock import DirLock, _process_start
    from zoo.train.run_config import ConfigError

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = socket.gethostname()
        for owner, stale in [
            ({"host": host, "pid": dead.pid, "started": "t0"}, True),
            (
                {"host": host, "pid": live.pid, "pid_start": "0", "started": "t0"},
                _process_start(live.pid) is not None,
            ),  # a reused pid
            ({"host": host, "pid": live.pid, "pid_start": _process_start(live.pid), "started": "t0"}, False),
            ({"host": "some-other-host", "pid": dead.pid, "started": "t0"}, False),  # cannot tell: assume it runs
        ]:
            (tmp_path / "zoo.lock").write_text(json.dumps(owner))
            lock, notes = DirLock(tmp_path), []
            if stale:
                lock.acquire(notes.append)
                assert json.loads((tmp_path / "zoo.lock").read_text())["pid"] == os.getpid()
                assert notes == [
                    f"note: checkpoint.dir: took over the lock of pid {owner['pid']} on {host} (started t0), which no "
                    "longer runs"
                ]
                lock.release()
                assert not (tmp_path / "zoo.lock").exists()
            else:
                with pytest.raises(
                    ConfigError,
                    match=(
                        rf"^checkpoint\.dir: {re.escape(str(tmp_path))} is in use by another run \(pid "
                        rf"{owner['pid']} on {owner['host']}, started t0\); "
                    ),
                ):
                    lock.acquire(notes.append)
                assert json.loads((tmp_path / "zoo.lock").read_text()) == owner  # untouched
        assert sorted(p.name for p in tmp_path.iterdir()) == ["zoo.lock"]
    finally:
        live.kill()
        live.wait()


def test_metrics_jsonl_keeps_the_earlier_steps_of_a_resumed_run(tmp_path):
    from zoo.train.metrics import MetricsWriter

    w = MetricsWriter(tmp_path)
    for step in range(6):
        w.write(step, {"loss": float(step)})
    w.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # cut short by a kill
    w = MetricsWriter(tmp_path, start_step=4)  # resumed from the step-4 checkpoint
    w.write(4, {"loss": 40.0})
    w.close()
    assert [(r["step"], r["loss"]) for r in metrics(tmp_path)] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    MetricsWriter(tmp_path).close()  # a fresh run (step 0) starts the file again
    assert (tmp_path / "metrics.jsonl").read_text() == ""


class _Events:
    """A fake step, batches, log and checkpoints for StepLoop: every call appends to `events`."""

    def __init__(self, diverge_at=None, signal_at=None, swallowed_ctrl_c_at=None):
        self.events, self.diverge_at, self.signal_at = [], diverge_at, signal_at
        self.swallowed_ctrl_c_at = swallowed_ctrl_c_at
        self.completed = 0

    def batch(self, step):
        self.events.append(("batch", step))
        return step

    def shard_tokens(self, batch):
        return batch

    def step(self, state, tokens):
        assert tokens == state  # step k gets batch k
        self.events.append(("dispatch", state))
        if state == self.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        if state == self.swallowed_ctrl_c_at:  # as in JAX's garbage-collector callback: Python drops it

            def collecting(phase, info):
                gc.callbacks.remove(collecting)
                signal.raise_signal(signal.SIGINT)  # its handler runs here, inside the callback

            gc.callbacks.append(collecting)
            gc.collect()
        return state + 1, {"loss": np.float32(state)}

    def read(self, ds):
        from zoo.train.run import Diverged

        for d in ds:
            self.events.append(("read", d.step))
            if d.step == self.diverge_at:
                raise Diverged(d.step, {"loss": float("nan")})
            self.completed = d.step + 1

    def save(self, step, state):
        assert state == step  # the state after `step` steps
        self.events.append(("save", step))

    def check_saves(self):
        pass  # no save fails here

    def at(self, event):
        return self.events.index(event)


def _loop(ev, steps, every, stop):
    from zoo.train.run import Batches, StepLoop

    return StepLoop(ev.step, Batches(ev, ev), ev, ev, stop, steps, every)


def test_step_loop_dispatches_ahead_and_saves_only_checked_states():
    """(In process, a fake step.) Step k+1 is dispatched and batch k+2 built before step k's metrics
    are read; a state is saved only after the step that made it was read, and before the next step
    donates it; a non-finite step stops the loop before its state is saved."""
    from zoo.train.run import Diverged
    from zoo.train.stop import StopSignals

    ev = _Events()
    assert _loop(ev, 10, 4, StopSignals()).run(0, 0) == 10
    for k in range(9):
        if k + 1 not in (4, 8):  # no save after step k: the loop ran ahead
            assert ev.at(("dispatch", k)) < ev.at(("batch", k + 1)) < ev.at(("dispatch", k + 1)) < ev.at(("read", k))
            if k and k not in (4, 8):  # nor after step k - 1: its metrics are read while step k runs
                assert ev.at(("batch", k + 1)) < ev.at(("read", k - 1)) < ev.at(("dispatch", k + 1))
    assert [e for e in ev.events if e[0] == "save"] == [("save", 4), ("save", 8), ("save", 10)]
    for n in (4, 8):
        assert ev.at(("read", n - 1)) < ev.at(("save", n)) < ev.at(("dispatch", n))

    ev = _Events(diverge_at=6)  # step 7 (0-based 6) is not finite
    with pytest.raises(Diverged):
        _loop(ev, 10, 2, StopSignals()).run(0, 0)
    assert [e[1] for e in ev.events if e[0] == "save"] == [2, 4, 6]  # state 7 was never saved
    assert ev.at(("read", 5)) < ev.at(("save", 6))


def test_step_times_stay_honest_when_a_save_drains_two_steps_at_once(tmp_path):
    """XLA:CPU runs a step inside its dispatch call, so at a save the step before is already finished
    when it is read, and the saved step right after it: the two share the time they took, rather than
    the first taking both and the second none (which printed millions of tokens/s at every save)."""
    from zoo.train.run import Batches, StepLog, StepLoop
    from zoo.train.stop import StopSignals

    class Run:  # a step that runs synchronously inside its dispatch, as on CPU
        batch = shard_tokens = staticmethod(lambda x: x)

        def step(self, state, tokens):
            time.sleep(0.05)
            return state + 1, {"loss": np.float32(1.0), "grad_norm": np.float32(1.0)}

    from zoo.tools.kit import compose
    from zoo.train.run_config import load

    c = load(
        compose(
            ["model=llama_tiny_a", "data.batch_size=2", "data.seq_len=8", "trainer.steps=12", "trainer.progress=false"]
        )
    )
    run = Run()
    log = StepLog(c, tmp_path, 0, 1, [], show=False)
    saves = types.SimpleNamespace(save=lambda step, state: None, check_saves=lambda: None)
    StepLoop(run.step, Batches(run, run), log, saves, StopSignals(), 12, 4).run(0, 0)
    log.close()
    assert len(log.times) == 12
    assert all(0.025 < t < 0.5 for t in log.times[1:]), log.times  # each ~0.05 s; none near zero
    assert [r["tokens_per_s"] for r in metrics(tmp_path)][3] < 16 / 0.025


def test_ctrl_c_during_a_save_lets_the_copy_finish_then_interrupts():
    """A Ctrl-C that lands while a checkpoint's arrays are being copied is held back until the copy is
    done (the step is then saved), and raised after it."""
    from zoo.train.checkpoint import Checkpoints

    class Manager:
        def save(self, step, args, force):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # Python runs a handler between bytecodes: well inside the copy
            copied.append(step)

    copied = []
    ckpt = object.__new__(Checkpoints)  # only what save() touches
    ckpt.saved, ckpt.meta, ckpt._manager = [], dict, Manager
    # As in a terminal: Python's own handler (a shell's background job, pytest's included, starts with
    # SIGINT ignored; that case is below)
    outside = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(7, {"params": np.zeros(2)})
        assert copied == [7] and ckpt.saved == [7]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored

        # A process that ignores SIGINT (started in the background) ignores it during a save too
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        ckpt.save(8, {"params": np.zeros(2)})
        assert copied == [7, 8] and ckpt.saved == [7, 8]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, outside)


def test_ctrl_c_deferred_leaves_a_handler_python_cannot_restore_alone(monkeypatch):
    # signal.getsignal gives None for a handler installed from C; signal.signal(SIGINT, None) would
    # raise after the save and leave the deferring handler installed.
    from zoo.train import stop as ck

    monkeypatch.setattr(ck.signal, "getsignal", lambda signum: None)
    calls = []
    monkeypatch.setattr(ck.signal, "signal", lambda *a: calls.append(a))
    ran = []
    with ck.ctrl_c_deferred():
        ran.append(1)
    assert ran == [1] and calls == []


def test_sigusr1_stops_the_loop_after_the_step_in_flight_and_saves_it():
    from zoo.train.stop import StopSignals

    ev = _Events(signal_at=3)  # the signal arrives while step 4 (0-based 3) is being dispatched
    with StopSignals() as stop:
        loop = _loop(ev, 100, 50, stop)
        state = loop.run(0, 0)
    assert stop.received == "SIGUSR1" and loop.stopped
    assert state == ev.completed == 4 and [e for e in ev.events if e[0] in ("save", "dispatch")][-1] == ("save", 4)
    assert ev.at(("read", 3)) < ev.at(("save", 4))
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # restored on exit


def test_a_ctrl_c_python_swallowed_during_a_step_stops_the_loop_before_the_next():
    """(In process, as train.py handles Ctrl-C: zoo.tools.cli.main.) A Ctrl-C raised inside a
    garbage-collector callback, which Python reports as "Exception ignored" and drops, is raised again
    before the next step: the run stops as for any Ctrl-C during the steps. The report is left out."""
    from zoo.train.stop import StopSignals, ctrl_c_noted

    ev = _Events(swallowed_ctrl_c_at=3)
    reported = []
    # As in a terminal: Python's own handler (pytest's, in a shell's background job, ignores SIGINT)
    outside = signal.signal(signal.SIGINT, signal.default_int_handler)
    unraisable, sys.unraisablehook = sys.unraisablehook, reported.append
    try:
        with ctrl_c_noted(), pytest.raises(KeyboardInterrupt):
            _loop(ev, 100, 50, StopSignals()).run(0, 0)
    finally:
        signal.signal(signal.SIGINT, outside)
        sys.unraisablehook = unraisable
    assert ("dispatch", 3) in ev.events and ("dispatch", 4) not in ev.events
    assert reported == []


def test_a_handler_installed_before_runs_after_the_checkpoint():
    """submitit installs its own SIGUSR2 handler (it requeues the job): ours records the signal, and
    the earlier handler runs only when the run calls chain(), after its checkpoint."""
    from zoo.train.stop import StopSignals

    calls = []
    earlier = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))
    try:
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert stop.received == "SIGUSR2" and stop.requested_here() and calls == []
            stop.chain()
            assert calls == [signal.SIGUSR2]
        os.kill(os.getpid(), signal.SIGUSR2)  # ours is gone again
        assert calls == [signal.SIGUSR2, signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, earlier)


def test_slurm_launcher_requeues_and_its_signal_is_one_that_stops_the_run():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    import submitit
    from hydra import compose, initialize_config_dir

    from zoo.train.stop import STOP_SIGNALS

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher.max_num_timeout > 0 and launcher.signal_delay_s >= 60
    # submitit asks SLURM for `--signal=<USR_SIG>@<signal_delay_s>` and requeues from its handler of that signal.
    assert getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG) in STOP_SIGNALS


def test_only_the_failed_restores_leftover_reads_are_silenced():
    # After a skipped step, orbax's abandoned reads surface through sys.unraisablehook; those two
    # kinds (and nothing else) are dropped, so the one-line note stays the only output.
    import types

    from zoo.train.checkpoint_errors import _abandoned_read

    async def _read_array_index_and_device_put():
        return None

    coro = _read_array_index_and_device_put()
    try:
        leftover = types.SimpleNamespace(
            exc_value=Exception("Encountered error while reading array index: (). See ..."), object=coro
        )
        assert _abandoned_read(leftover)
        assert _abandoned_read(types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed"), object=None))
        assert not _abandoned_read(types.SimpleNamespace(exc_value=Exception("something else"), object=coro))
        assert not _abandoned_read(
            types.SimpleNamespace(exc_value=Exception("Encountered error while reading array index: ()"), object=None)
        )
        assert not _abandoned_read(
            types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed twice"), object=None)
        )
    finally:
        coro.close()


def test_a_coroutine_the_failed_restore_left_unawaited_does_not_warn_at_exit():
    # CI once printed "sys:1: RuntimeWarning: coroutine 'Store._get_array_metadatas' was never
    # awaited" after the one error line: orbax had created it for the failed restore.
    script = (
        "import sys\n"
        "from zoo.train.checkpoint_errors import quiet_closed_loop_callbacks\n"
        "class Store:\n"
        "    async def _get_array_metadatas(self): pass\n"
        "if sys.argv[1] == 'quiet':\n"
        "    quiet_closed_loop_callbacks()\n"
        "LEFT = [Store()._get_array_metadatas()]  # finalized as the interpreter exits\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    loud, quiet = (
        subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, env=env)
        for how in ("loud", "quiet")
    )
    assert "was never awaited" in loud.stderr  # the premise: Python warns at exit
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


def test_an_abandoned_read_task_collected_unretrieved_is_not_logged():
    # CI-like runs once printed asyncio's "Task exception was never retrieved" for one of the failed
    # restore's reads after the one-line note; another task's error is still logged.
    script = (
        "import asyncio, gc, logging, sys\n"
        "logging.basicConfig()\n"
        "from zoo.train.checkpoint_errors import quiet_closed_loop_callbacks\n"
        "async def read(msg):\n"
        "    raise Exception(msg)\n"
        "if sys.argv[1] == 'quiet':\n"
        "    quiet_closed_loop_callbacks()\n"
        "loop = asyncio.new_event_loop()\n"
        "task = loop.create_task(read(sys.argv[2]))\n"
        "loop.run_until_complete(asyncio.sleep(0.01))\n"
        "loop.close()\n"
        "del task\n"
        "gc.collect()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    read_error = "Encountered error while reading array index: (slice(0, 2, 1),). See full TensorStore details"

    def stderr(how, msg):
        return subprocess.run(
            [sys.executable, "-c", script, how, msg], capture_output=True, text=True, env=env, timeout=120
        ).stderr

    # A read of a step without its manifest, which CI once printed that way (orbax-checkpoint 0.12.8).
    missing = (
        'NOT_FOUND: Error opening "zarr" driver: Metadata at "params.embed/.zarray" in OCDBT database does not exist'
    )
    assert "Task exception was never retrieved" in stderr("loud", read_error)  # the premise: asyncio logs it
    assert stderr("quiet", read_error) == ""
    assert stderr("quiet", missing) == ""
    assert "something else" in stderr("quiet", "something else")


def test_a_step_without_an_orbax_file_is_refused_before_orbax_reads_it(uninterrupted, tmp_path, monkeypatch):
    # A restore orbax starts and abandons leaves reads behind that can report after the one line.
    import orbax.checkpoint as ocp

    from zoo.train.checkpoint import _restore_params
    from zoo.train.checkpoint_errors import Unreadable

    ckpt = tmp_path / "ckpt"
    shutil.copytree(uninterrupted / "ckpt" / "8", ckpt / "8")
    delete_the_manifest(ckpt / "8")

    def untouchable(*args, **kwargs):
        raise AssertionError("orbax was asked to read a step that lacks its manifest")

    monkeypatch.setattr(ocp, "PyTreeCheckpointer", untouchable)
    with pytest.raises(Unreadable, match=r"^state/manifest\.ocdbt is missing$"):
        _restore_params(ckpt, 8, None)


def test_two_processes_writing_one_summary_do_not_trip_over_each_others_temporary_file(tmp_path):
    # Two commands started in the same second share Hydra's default run directory and both write
    # summary.json there; each must land whole, neither fail on the other's rename.
    code = (
        "import pathlib, sys, time\n"
        "from zoo.train.metrics import write_json\n"
        "p = pathlib.Path(sys.argv[1])\n"
        "(p.parent / sys.argv[2]).touch()\n"  # ready; both start writing together
        "while not all((p.parent / w).exists() for w in 'ab'):\n"
        "    time.sleep(0.001)\n"
        "for i in range(300):\n"
        "    write_json(p, {'writer': sys.argv[2], 'i': i, 'pad': 'x' * 4096})\n"
    )
    path = tmp_path / "summary.json"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), w], stderr=subprocess.PIPE) for w in "ab"]
    errors = [p.communicate(timeout=120)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    assert json.loads(path.read_text())["i"] == 299 and not list(tmp_path.glob("*.tmp"))
