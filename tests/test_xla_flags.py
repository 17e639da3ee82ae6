"""XLA flag groups: every flag a group or train.py sends exists in the installed jaxlib (XLA aborts the
process on one it does not know), the lookup that says so agrees with XLA itself, and runs that keep
anything on host get XLA:GPU's host-offloading switch."""

import os
import pathlib
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from zoo.train.run_config import ConfigError, XlaConfig, load_group
from zoo.train.run import merged_xla_flags, uses_host_memory
from zoo.train.xla_flags import GPU_HOST_OFFLOAD_FLAG, GPU_HOST_OFFLOAD_FLAGS, flag_name, known_flag, unknown_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
XLA_GROUPS = sorted((ROOT / "conf" / "xla").glob("*.yaml"))
OFFLOAD_PRESETS = sorted((ROOT / "conf" / "offload").glob("*.yaml"))
MADE_UP = "--xla_gpu_enable_made_up_overlap=true"


def _start_xla(flags: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, text=True, timeout=120
    )


def _group_flags() -> list[str]:
    flags = [GPU_HOST_OFFLOAD_FLAG + "=true"]
    for path in XLA_GROUPS:
        flags += [f for f in OmegaConf.load(path).flags if f not in flags]
    return flags


def test_every_group_flag_starts_xla():
    """One XLA start with the flags of every conf/xla group and the host-offloading switch: exit 0. A name
    XLA does not register would abort it (the next test shows that it does)."""
    flags = _group_flags()
    assert len(flags) >= 7, flags  # the gpu_overlap groups' collective pipelining is there
    assert unknown_flags(flags) == []
    p = _start_xla(flags)
    assert p.returncode == 0, p.stderr[-2000:]


def test_lookup_agrees_with_xla_on_a_made_up_flag():
    assert known_flag(flag_name(MADE_UP)) is False
    assert known_flag("--xla_gpu_enable_pipelined_all_gather") is True
    assert known_flag("--xla_gpu_enable") is False  # a prefix of real names is not a name
    p = _start_xla([MADE_UP])
    assert p.returncode != 0 and "Unknown flag" in p.stderr


def test_unknown_flag_is_one_line_before_jax_starts():
    with pytest.raises(
        ConfigError, match=r"^xla.flags: --xla_gpu_enable_made_up_overlap is not a flag this jaxlib \(.*\) knows"
    ):
        XlaConfig(flags=[MADE_UP])


@pytest.mark.parametrize("preset", OFFLOAD_PRESETS, ids=lambda p: p.stem)
def test_host_offloading_switch_follows_the_placement(preset):
    """On exactly when parameters, optimizer state or an offloaded tag live in pinned host memory: the
    host-offloading switch and the latency hiding scheduler that overlaps the copies."""
    offload = load_group("offload", OmegaConf.load(preset))
    on_host = "pinned_host" in (offload.params, offload.opt_state) or "offload" in offload.actions().values()
    assert uses_host_memory(offload) == on_host
    flags = merged_xla_flags(XlaConfig(cpu_ynn_fusions=None), "", host_offload=uses_host_memory(offload)).split()
    assert all((f"{flag}=true" in flags) == on_host for flag in GPU_HOST_OFFLOAD_FLAGS)
    # The environment's or xla.flags' own setting wins.
    mine = f"{GPU_HOST_OFFLOAD_FLAG}=false"
    scheduler = "--xla_gpu_enable_latency_hiding_scheduler=false"
    assert merged_xla_flags(
        XlaConfig(cpu_ynn_fusions=None, flags=[mine, scheduler]), "", host_offload=True
    ).split() == [mine, scheduler]
    assert merged_xla_flags(XlaConfig(cpu_ynn_fusions=None), f"{mine} {scheduler}", host_offload=True).split() == [
        mine,
        scheduler,
    ]
    assert merged_xla_flags(XlaConfig(cpu_ynn_fusions=None), mine, host_offload=True).split() == [
        mine,
        scheduler.replace("false", "true"),
    ]
    # scheduler=False: the switch alone (bench/gpu.py's groups, whose default is the no-scheduler baseline).
    assert merged_xla_flags(XlaConfig(cpu_ynn_fusions=None), "", host_offload=True, scheduler=False).split() == [
        mine.replace("false", "true")
    ]
    assert merged_xla_flags(
        XlaConfig(cpu_ynn_fusions=None, flags=[scheduler]), "", host_offload=True, scheduler=False
    ).split() == [scheduler, mine.replace("false", "true")]


def test_some_preset_uses_the_host_and_some_does_not():
    """The parametrized test above sees both cases."""
    kinds = {uses_host_memory(load_group("offload", OmegaConf.load(p))) for p in OFFLOAD_PRESETS}
    assert kinds == {True, False}


HARDWARE = sorted((ROOT / "conf" / "hardware").glob("*.yaml"))


@pytest.mark.parametrize("profile", HARDWARE, ids=lambda p: p.stem)
def test_gpu_host_pool_is_the_profiles_node_budget_when_anything_is_on_host(profile):
    """XLA:GPU caps its pinned-host pool at 64 GiB unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB says more: a run
    with host-resident state or offloaded tags gets the node's host budget from its hardware profile."""
    from zoo.offload import OffloadConfig
    from zoo.train.run import gpu_host_pool_gib

    hw = load_group("hardware", OmegaConf.load(profile))
    expected = hw.host_bytes_per_device * hw.devices_per_node // 2**30 if hw.host_bytes_per_device else None
    assert gpu_host_pool_gib(OffloadConfig(opt_state="pinned_host"), hw) == expected
    assert gpu_host_pool_gib(OffloadConfig(), hw) is None  # nothing on host: XLA's default
    if profile.stem == "gb200":
        assert expected == 894  # 4 x 240 GB, in GiB: well over XLA's 64


def test_gpu_host_pool_set_before_jax_starts(tmp_path):
    """train.py's startup sets the cap before JAX reads it and records it in summary.json. (A GPU's
    profile would be refused on this CPU: the CPU's, given gb200's host memory.)"""
    import json

    argv = [
        sys.executable,
        str(ROOT / "train.py"),
        "model=llama_tiny_a",
        "mesh=single",
        "xla.cpu_devices=1",
        "data.batch_size=2",
        "data.seq_len=16",
        "trainer.steps=1",
        "trainer.progress=false",
        "xla.cpu_fast_compile=true",
        "offload=optimizer_host",
        "hardware=cpu",
        "hardware.host_bytes_per_device=240000000000",
        "hardware.devices_per_node=4",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"}
    p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["gpu_host_pool_gib"] == "894"


def test_gpu_host_pool_the_environment_wins():
    """A cap the environment already holds is left alone, and nothing is set once JAX has started."""
    from zoo.train.run import GPU_HOST_POOL_ENV, set_gpu_host_pool

    assert set_gpu_host_pool(894, environ := {GPU_HOST_POOL_ENV: "100"}, started=False) == "100" and environ == {
        GPU_HOST_POOL_ENV: "100"
    }
    assert set_gpu_host_pool(894, environ := {}, started=False) == "894" and environ == {GPU_HOST_POOL_ENV: "894"}
    assert set_gpu_host_pool(894, environ := {}, started=True) is None and environ == {}
    assert set_gpu_host_pool(None, environ := {}, started=False) is None and environ == {}


@pytest.mark.parametrize("libtpu", [True, False])
def test_the_tpu_flags_are_set_before_jax_starts_where_libtpu_can_compile(libtpu):
    """libtpu reads LIBTPU_INIT_ARGS once, when JAX's backends start, also on a machine without a chip
    where it compiles for one ahead of time; there the group's TPU flags are set before JAX starts
    (before, plan.compile's programs compiled without them). Without libtpu nothing is set."""
    script = (
        "import os, zoo.backend as b\n"
        f"b.libtpu_installed = lambda: {libtpu}\n"
        "from zoo.train.run import apply_xla_flags\n"
        "from zoo.train.run_config import XlaConfig\n"
        "shown = apply_xla_flags(XlaConfig(tpu_flags=['--xla_tpu_host_transfer_overlap_limit=24']))\n"
        "import jax\n"
        "print(repr(os.environ.get('LIBTPU_INIT_ARGS')), 'LIBTPU' in shown, jax.default_backend())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"} | {"JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    want = "'--xla_tpu_host_transfer_overlap_limit=24'" if libtpu else "None"
    assert p.stdout.split() == [want, "False", "cpu"]  # the CPU run's own flags do not name them
