"""Several JAX processes through train.py: two real processes on localhost (2 CPU devices each, gloo
collectives, fsdp over 4) against one process with 4 devices; SLURM's environment; bad settings."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import in_process
import pytest

from zoo.train.run_config import ConfigError, DistributedConfig
from zoo.train.distributed import resolve

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Real text through zoo.data, so each process reads its own rows of every batch.
COMMON = [
    "model=llama_tiny_a",
    "mesh=fsdp",
    "data=text",
    "data.batch_size=8",
    "data.seq_len=32",
    "optimizer.decay_steps=6",
    "trainer.log_every=1",
    "trainer.progress=false",
]
SLURM_VARS = [k for k in os.environ if k.startswith("SLURM_") or k.startswith("JAX_COORDINATOR")]


def env_with(devices: int, **extra) -> dict:
    """This environment with `devices` simulated CPU devices (conftest.py's other XLA flags kept: LLVM's
    optimisations and the fusion emitters off, for the compiles) and neither SLURM's variables nor
    ZOO_TRACEBACK."""
    env = {k: v for k, v in os.environ.items() if k not in SLURM_VARS and k != "ZOO_TRACEBACK"}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count=")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def train(args, run_dir, env, timeout=300):
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finish(procs, timeout=300):
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        outs.append((p.returncode, out, err))
    return outs


def losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def test_two_processes_reproduce_one_process_then_resume_under_slurm(tmp_path):
    # One process, 4 devices: the reference, 6 steps.
    (rc, out, err), = finish([train([*COMMON, "trainer.steps=6"], tmp_path / "one", env_with(4))])  # fmt: skip
    assert rc == 0, err[-3000:]
    ref = losses(tmp_path / "one")

    # Two processes, 2 devices each, an explicit coordinator; checkpoints at steps 2 and 4.
    port = free_port()
    ckpt = tmp_path / "ckpt"
    two = [
        *COMMON,
        "trainer.steps=4",
        "checkpoint.every_n_steps=2",
        f"checkpoint.dir={ckpt}",
        f"distributed.coordinator_address=127.0.0.1:{port}",
        "distributed.num_processes=2",
        "distributed.timeout_s=120",
    ]
    results = finish([train([*two, f"distributed.process_id={i}"], tmp_path / "two", env_with(2)) for i in (0, 1)])
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
    assert "on 4 cpu device(s) in 2 processes" in results[0][1] and "process 0 of 2" in results[0][1]
    assert (
        "summary:" in results[0][1] and "model llama" not in results[1][1] and "summary:" not in results[1][1]
    )  # process 0 alone reports
    got = losses(tmp_path / "two")
    assert [s for s, _ in got] == [0, 1, 2, 3]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, ref[:4])) < 1e-5, (got, ref)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["num_devices"] == 4 and summary["mesh"]["fsdp"] == 4 and summary["checkpoint"]["steps"] == [2, 4]
    meta = json.loads((ckpt / "4" / "meta" / "metadata").read_text())
    assert meta["process_count"] == 2 and meta["step"] == 4

    # The same two processes started as a SLURM job step would start them: nothing set but SLURM's
    # variables (JAX picks the coordinator port from the job id). They resume the checkpoint at step 4.
    job = next(j for j in range(1000, 5096) if port_is_free(61440 + j % 4096))
    slurm = {"SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2"}
    results = finish(
        [
            train(
                [
                    *COMMON,
                    "trainer.steps=6",
                    "checkpoint.every_n_steps=2",
                    f"checkpoint.dir={ckpt}",
                    "distributed.timeout_s=120",
                ],
                tmp_path / "slurm",
                env_with(2, **slurm, SLURM_PROCID=str(i), SLURM_LOCALID=str(i)),
            )
            for i in (0, 1)
        ]
    )
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
    assert "resuming from step 4" in results[0][1] and "in 2 processes" in results[0][1]
    got = losses(tmp_path / "slurm")
    assert [s for s, _ in got] == [4, 5]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, ref[4:])) < 1e-5, (got, ref)
    assert sorted(p.name for p in ckpt.iterdir()) == ["2", "4", "6"]


def run_cli(args, tmp_path, timeout=120):
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env_with(2), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def one_error_line(p) -> str:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr[-3000:]
    assert len(lines) == 1, p.stderr[-3000:]
    assert "s, compile " not in p.stdout
    return lines[0]


def test_unreachable_coordinator_one_line(tmp_path):
    port = free_port()
    line = one_error_line(run_cli([f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
                                   "distributed.process_id=1", "distributed.timeout_s=3"], tmp_path))  # fmt: skip
    assert line == (
        f"error: distributed.coordinator_address=127.0.0.1:{port}: could not reach it within 3s; "
        "check host/port and that process 0 is running"
    )


def test_coordinator_alone_times_out_in_one_line(tmp_path):
    port = free_port()
    line = one_error_line(run_cli([f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
                                   "distributed.process_id=0", "distributed.timeout_s=3"], tmp_path))  # fmt: skip
    assert line.startswith(
        f"error: distributed.num_processes=2: not every process joined the coordinator at 127.0.0.1:{port} within 3s"
    )
    assert line.endswith("start all 2 processes with the same coordinator_address and num_processes")


def test_coordinator_port_in_use_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = one_error_line(
            run_cli(
                [
                    f"distributed.coordinator_address=127.0.0.1:{port}",
                    "distributed.num_processes=2",
                    "distributed.process_id=0",
                    "distributed.timeout_s=3",
                ],
                tmp_path,
            )
        )
    assert line == (
        f"error: distributed.coordinator_address=127.0.0.1:{port}: port {port} is already in use here; "
        "choose a free port"
    )


# The commands of the tests marked `in_process` run in one pytest process through train.py's entry point
# (tests/in_process.py): settings refused before any process joins, and the launcher's config printed.
def in_process_env(request) -> dict:
    return {"XLA_FLAGS": in_process.xla_flags(2)}  # as env_with(2) starts JAX


def run_in_process(args, tmp_path, capfd, monkeypatch):
    """`run_cli`'s command in this process (in_process.INNER), without SLURM's variables."""
    for k in [k for k in os.environ if k.startswith("SLURM_") or k.startswith("JAX_COORDINATOR")]:
        monkeypatch.delenv(k)
    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={tmp_path / 'run'}"]
    return in_process.run(cmd, tmp_path, capfd, monkeypatch)


@in_process.MARK
@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["distributed.num_processes=2"],
            "error: distributed.coordinator_address: not set (distributed.num_processes=2 given, no SLURM job step "
            "found); ",
        ),
        (
            ["distributed.num_processes=2", "distributed.process_id=2"],
            "error: distributed.process_id: 2 is not below distributed.num_processes=2; use 0..1",
        ),
        (
            ["distributed.coordinator_address=localhost"],
            "error: distributed.coordinator_address: 'localhost' is not host:port; ",
        ),
    ],
)
def test_incomplete_settings_one_line(args, expected, tmp_path, request, capfd, monkeypatch):
    if not in_process.INNER:
        return in_process.outcome(request, in_process_env)
    assert one_error_line(run_in_process(args, tmp_path, capfd, monkeypatch)).startswith(expected)


def test_resolve_reads_slurm_like_jax(monkeypatch):
    for k in SLURM_VARS:
        monkeypatch.delenv(k, raising=False)
    assert resolve(DistributedConfig()) is None  # no cluster: one process
    monkeypatch.setenv("SLURM_JOB_ID", "12345")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[017-020],gpu031")
    monkeypatch.setenv("SLURM_NTASKS", "32")
    monkeypatch.setenv("SLURM_PROCID", "9")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    c = resolve(DistributedConfig())
    assert (c.coordinator_address, c.num_processes, c.process_id, c.local_device_ids, c.source) == (
        f"gpu017:{61440 + 12345 % 4096}",
        32,
        9,
        [1],
        "slurm",
    )
    assert resolve(DistributedConfig(auto_detect=False)) is None
    c = resolve(DistributedConfig(coordinator_address="head:7777", local_device_ids=[0, 1, 2, 3]))
    assert (c.coordinator_address, c.process_id, c.local_device_ids) == ("head:7777", 9, [0, 1, 2, 3])
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert resolve(DistributedConfig()) is None  # a one-task job step
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    with pytest.raises(ConfigError, match=r"^distributed.process_id: 3 is not in 0..1 \(num_processes=2\); "):
        resolve(DistributedConfig(num_processes=2))


def test_a_slurm_number_that_is_not_one_is_one_line_for_every_caller(monkeypatch, capsys):
    """train.py checks SLURM's numbers before Hydra reads them (zoo.train.command_line.line); its run-directory
    rule (zoo.tools.cli, reached without train.py's check through cli.main), zoo.train.distributed.resolve and
    the tools (through it) read them with the same checked parse: one line naming the variable, never int()'s
    traceback."""
    from zoo.tools import cli, inspect_step

    line = (
        "SLURM_NTASKS: 'four' in the environment is not a number (SLURM sets it to a count or an index); unset it, "
        "or run under srun"
    )
    for k in SLURM_VARS + ["SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"]:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "four")
    with pytest.raises(ConfigError) as e:
        cli._several_processes([])
    assert str(e.value) == line
    monkeypatch.setattr(sys, "argv", ["train.py", "model=llama_tiny_a"])
    assert cli.main(lambda: pytest.fail("Hydra ran"), ROOT / "conf") == 2
    assert capsys.readouterr().err == f"error: {line}\n"
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "localhost", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        resolve(DistributedConfig())
    assert str(e.value) == line
    assert inspect_step.main(["model=llama_tiny_a", "mesh=single", "data.batch_size=2", "data.seq_len=16"]) == 2
    assert capsys.readouterr().err == f"error: {line}\n"


def test_only_a_joined_process_other_than_0_is_not_main(monkeypatch):
    # train.py asks this after a failure to decide who writes summary.json: from the join zoo made,
    # not from JAX (this process's JAX is one process 0 throughout).
    from zoo.train import distributed

    assert distributed.is_main_process()  # not joined: the only process
    for pid, main in ((0, True), (1, False), (3, False)):
        monkeypatch.setattr(distributed, "_JOINED", distributed.Cluster("head:7777", 4, pid, None, "config"))
        assert distributed.is_main_process() is main


@in_process.MARK
def test_slurm_launcher_config_composes(tmp_path, request, capfd, monkeypatch):
    if not in_process.INNER:
        return in_process.outcome(request, in_process_env)
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    args = ["hydra/launcher=slurm", "hydra.launcher.nodes=4", "--cfg", "hydra"]
    p = in_process.run([sys.executable, str(ROOT / "train.py"), *args], tmp_path, capfd, monkeypatch)
    assert p.returncode == 0, p.stderr
    assert "_target_: hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher" in p.stdout
    assert "nodes: 4" in p.stdout and "tasks_per_node: 8" in p.stdout and "gpus_per_node: 8" in p.stdout
