"""What a run needs of the machine, judged before anything is initialised (zoo.train.machine_fit);
train.py's command line and environment before Hydra reads them (zoo.train.command_line); options
that would change nothing (a note). The same through the real command: tests/test_train_cli.py's table."""

import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

from zoo import families
from zoo.errors import ConfigError
from zoo.train import command_line, machine_fit
from zoo.train.run_config import XlaConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_model_larger_than_the_machine_is_refused_in_one_line(monkeypatch):
    """Against the host memory (and the accelerators'), from the parameter count alone."""
    from types import SimpleNamespace

    from zoo.lora import LoraConfig
    from zoo.train import machine_fit
    from zoo.train.run_config import DataConfig

    c = SimpleNamespace(model=families.get_size("llama_1b"), lora=LoraConfig(), data=DataConfig(seq_len=2048))
    cpu = [SimpleNamespace(platform="cpu")] * 8
    monkeypatch.setattr(machine_fit, "host_memory_bytes", lambda: 32 * 10**9)
    machine_fit.check_fits(c, 1_000_000_000, 8, cpu)  # 16 GB of state and 1 GB of layer inputs fit 32 GB
    need = r"^model: training 3\.00B parameters needs at least 49\.1 GB \(weights 12\.0 GB, gradients and AdamW"
    with pytest.raises(ConfigError, match=need):
        machine_fit.check_fits(c, 3_000_000_000, 8, cpu)
    machine_fit.check_fits(c, 3_000_000_000, 8, cpu, processes=2)  # two hosts' memory
    lora = SimpleNamespace(model=c.model, lora=LoraConfig(rank=8), data=c.data)
    machine_fit.check_fits(lora, 3_000_000_000, 8, cpu)  # a frozen base: no gradients, no moments


def test_flags_of_another_platforms_compiler_are_a_note():
    gpu = XlaConfig(name="gpu_overlap", flags=["--xla_gpu_enable_latency_hiding_scheduler=true"])
    tpu = XlaConfig(name="tpu_host_offload", tpu_flags=["--xla_tpu_host_transfer_overlap_limit=24"])
    assert machine_fit.other_platform_flags_note(gpu, "cpu").startswith("xla=gpu_overlap: its flags (--xla_gpu_")
    assert "go to a TPU's compiler (libtpu)" in machine_fit.other_platform_flags_note(tpu, "cpu")
    note = machine_fit.other_platform_flags_note
    assert note(gpu, "gpu") is None and note(tpu, "tpu") is None


def test_options_that_do_nothing_on_this_backend_are_a_note():
    """XLA:CPU's keys on an accelerator; pinned host memory on a CPU, where it is the device's own RAM."""
    from zoo.offload import load_preset
    from zoo.train.run import host_memory_note

    fast = XlaConfig(cpu_fast_compile=True, cpu_devices=4)
    assert machine_fit.cpu_keys_note(fast, "tpu") == (
        "xla.cpu_devices=4, xla.cpu_fast_compile=True: XLA:CPU's options, and this run's devices are tpus, so they "
        "change nothing here; drop them"
    )
    assert machine_fit.cpu_keys_note(fast, "cpu") is None and machine_fit.cpu_keys_note(XlaConfig(), "gpu") is None
    host = load_preset("none", "params_host")
    assert host_memory_note(host, "cpu").startswith("offload none + params on pinned_host: a CPU's pinned host memory")
    assert host_memory_note(host, "gpu") is None and host_memory_note(load_preset("full"), "cpu") is None


def test_local_device_ids_of_a_single_process_run_are_refused():
    c = SimpleNamespace(distributed=SimpleNamespace(local_device_ids=[7]))
    with pytest.raises(ConfigError, match=r"^distributed\.local_device_ids: \[7\] picks the devices of one process"):
        machine_fit.check_local_device_ids(c, [])


@pytest.mark.parametrize(
    "args,environ,line",
    [
        (["=3"], {}, "command line: '=3' has no key before its '='; write <key>=3"),
        (["m\u00f6del.x=3"], {}, "m\u00f6del.x: '\u00f6' cannot be in a key"),
        (["hydra.run.dir=$HOME/x"], {}, "hydra.run.dir: '$HOME/x' holds $HOME, which the shell did not expand"),
        (["hydra/launcher=slurm"], {}, "hydra/launcher: slurm launches the jobs of a sweep, and without -m"),
        ([], {"SLURM_NTASKS": "abc"}, "SLURM_NTASKS: 'abc' in the environment is not a number"),
        (["-m", "hydra/launcher=slurm", "hydra.run.dir=${now:%H}"], {"SLURM_NTASKS": "4"}, None),
        # what JAX's runtime and XLA would refuse as they start: a traceback, or XLA's fatal log and flag table
        ([], {"SLURM_NTASKS": "99999999999999999999"}, "SLURM_NTASKS: 99999999999999999999 in the environment is "),
        ([], {"XLA_FLAGS": "--xla_made_up=1"}, "XLA_FLAGS: --xla_made_up in the environment is not a flag this"),
        ([], {"XLA_FLAGS": "-xla_dump_to=/tmp/x"}, "XLA_FLAGS: '-xla_dump_to=/tmp/x' in the environment is not a "),
        ([], {"XLA_FLAGS": "xla_dump_to=/tmp/x"}, "XLA_FLAGS: 'xla_dump_to=/tmp/x' in the environment is neither a "),
        (
            [],
            {"XLA_FLAGS": "--xla_force_host_platform_device_count=abc"},
            "XLA_FLAGS: --xla_force_host_platform_device_count=abc in the environment must be a count in [1, 1024]",
        ),
        ([], {"XLA_FLAGS": "--xla_force_host_platform_device_count=100000"}, "XLA_FLAGS: --xla_force_host_platform_"),
        ([], {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"}, None),
        # a sweep Hydra would list for minutes before its first job, then run for ever
        (["-m", "trainer.seed=range(0,100000000)"], {}, "-m: the sweep has 100000000 jobs (trainer.seed=range(0,1"),
        (["-m", "trainer.seed=range(0,100)", "data.seed=1,2,3"], {}, None),
        (["hydra/launcher=basic"], {}, None),
    ],
)
def test_the_command_line_before_hydra(args, environ, line):
    found = command_line.line(args, environ, ROOT / "conf")
    assert (found is None) if line is None else found.startswith(line), found


def test_a_tool_refuses_an_xla_flags_xla_would_abort_on(tmp_path, monkeypatch, capsys):
    """The tools check the environment's XLA_FLAGS as train.py does, before their body starts JAX's backend."""
    from zoo.tools import report

    monkeypatch.setenv("XLA_FLAGS", "--xla_made_up=1")
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: XLA_FLAGS: --xla_made_up in the environment is not a flag") and "\n" not in err


def test_a_jax_variable_jax_refuses_as_it_is_imported_is_one_line(tmp_path, monkeypatch):
    """A ValueError from inside `import jax`, before any command's body runs (a process of its own: JAX is
    imported once; it ends there, in about a second): train.py's, and a tool's as zoo.tools is imported."""
    env = {k: v for k, v in os.environ.items() if k != "ZOO_TRACEBACK"}
    for cmd, variable, value, line in [
        ([str(ROOT / "train.py"), "model=llama_tiny_a"], "JAX_ENABLE_X64", "maybe", "'maybe' in the environment is "
         "refused by JAX (invalid truth value 'maybe' for environment 'JAX_ENABLE_X64'); give true or false"),
        (["-m", "zoo.tools.sizes"], "JAX_DEFAULT_MATMUL_PRECISION", "bogus", "'bogus' in the environment is refused by "
         "JAX (Invalid value \"bogus\" for JAX flag jax_default_matmul_precision); give one of the values JAX "),
    ]:  # fmt: skip
        env[variable] = value
        p = subprocess.run([sys.executable, *cmd], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        env.pop(variable)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr[-3000:]
        assert p.stderr.startswith(f"error: {variable}: {line}"), p.stderr
    # JAX takes a count of simulated devices that would take minutes to start
    import zoo.tools

    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "100000")
    assert zoo.tools.jax_environment_line().startswith("JAX_NUM_CPU_DEVICES: 100000 in the environment is beyond 1024")


def test_a_binary_option_file_on_the_search_path_is_named(tmp_path):
    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "bad.yaml").write_bytes(b"\x80\xff binary")
    found = command_line.line([f"hydra.searchpath=[file://{tmp_path}]", "hardware=bad"], {}, ROOT / "conf")
    where = f"{tmp_path}/hardware/bad.yaml"
    assert found.startswith(f"hardware: option 'bad' is {where}, which is not UTF-8 text (byte 0x80"), found


def test_a_tools_binary_option_file_on_the_search_path_is_named(tmp_path):
    """The tools compose train.py's config themselves (zoo.tools.kit.compose): the same line as train.py's."""
    from zoo.tools.kit import compose

    (tmp_path / "offload").mkdir()
    (tmp_path / "offload" / "bad.yaml").write_bytes(b"\x80\xff binary")
    with pytest.raises(ConfigError, match=r"^offload: option 'bad' is \S+/offload/bad\.yaml, which is not UTF-8 text"):
        compose([f"hydra.searchpath=[file://{tmp_path}]", "offload=bad"])


def test_multirun_after_the_overrides_goes_first():
    assert command_line.ordered(["a=1", "-m", "b=2"]) == ["-m", "a=1", "b=2"]


def test_a_backend_this_machine_cannot_start_is_one_line(tmp_path):
    """JAX_PLATFORMS=tpu without libtpu: JAX's RuntimeError as one line (a process of its own: JAX starts once)."""
    pytest.importorskip("jax")
    from zoo.backend import libtpu_installed

    if libtpu_installed():
        pytest.skip("libtpu is installed here")
    env = {**os.environ, "JAX_PLATFORMS": "tpu"}
    env.pop("ZOO_TRACEBACK", None)
    p = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "model=llama_tiny_a", f"hydra.run.dir={tmp_path / 'run'}"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("error: JAX_PLATFORMS: 'tpu' in the environment names a backend this machine cannot")


def test_top_k_with_greedy_decoding_is_a_note():
    from zoo.tools.generate import GenerateOptions, greedy_note

    assert greedy_note(GenerateOptions(top_k=5)).startswith("top_k=5 shape sampling, and temperature=0 is greedy")
    assert greedy_note(GenerateOptions(top_k=5, temperature=0.8)) is None and greedy_note(GenerateOptions()) is None


def test_a_full_disk_is_one_line(tmp_path):
    """Before Hydra writes its record (the filesystem's free space), and while the run writes its own."""
    from zoo.train.run_config import TrainingStopped

    full = lambda path: SimpleNamespace(f_bavail=0, f_frsize=4096, f_blocks=1 << 20)  # noqa: E731
    line = command_line._full_disk_line([], [f"hydra.run.dir={tmp_path}/run"], statvfs=full)
    assert line.startswith(f"hydra.run.dir: no space left on the filesystem of {tmp_path} (0 bytes free)"), line
    # /proc and /sys report no blocks at all: not a full disk (the run directory's checks name them)
    assert command_line._full_disk_line([], ["hydra.run.dir=/proc/no_such_dir/run"]) is None
    assert command_line._full_disk_line([], [f"hydra.run.dir={tmp_path}/run"]) is None  # this disk has room
    with pytest.raises(TrainingStopped, match=r"^hydra\.run\.dir: no space left writing \S+metrics\.jsonl \(No space"):
        with machine_fit.disk_full_stops(tmp_path):
            raise OSError(28, "No space left on device", str(tmp_path / "metrics.jsonl"))
