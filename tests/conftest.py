import os

# Eight simulated CPU devices for the sharding tests; must be set before jax is imported.
# LLVM's optimisations off (`--xla_backend_optimization_level=0`, what `xla.cpu_fast_compile=true`
# does): the tests check values, shapes, placement, collectives and memory, which XLA's HLO passes
# decide the same at any LLVM level, and compiling is most of their time.
# XLA:CPU's fusion emitters off (`--xla_cpu_use_fusion_emitters=false`): each fusion of the same HLO
# is compiled by XLA's elemental IR emitter instead of the MLIR fusion emitters, about 3x faster (a
# dsv3_tiny_a train step on fsdp: 7.3 -> 2.6 s of CPU) for the same computation (six of the heaviest
# test files: 662 -> 405 s of CPU). Only where the installed jaxlib knows the flag (XLA aborts on one it does not).
# The train.py / tool processes the CLI tests start inherit the flags, so a program the persistent
# cache below holds was compiled with the flags of every process that can load it. The README's
# commands run without XLA_FLAGS (tests/test_readme.py): the defaults users get.
from zoo.train.xla_flags import known_flag  # reads jaxlib's library; imports neither JAX nor a model

_FLAGS = ["--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"]
if known_flag("--xla_cpu_use_fusion_emitters"):
    _FLAGS.append("--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("XLA_FLAGS", " ".join(_FLAGS))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run, shared by this process and the train.py / tool
# processes the CLI tests start (they inherit the environment): a program compiled once is loaded, not
# compiled, the next time any of them needs it. A fresh directory per run unless the variable is set.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="zoo-tests-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

# Ctrl-C as in a terminal: a shell's background job (`pytest ... &`, nohup) starts with SIGINT ignored,
# and what a process ignores its children ignore too, so the README's shown ^C would not interrupt the
# commands tests/test_readme.py runs. Python's own handler here makes them start with the default.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Start JAX's backend now, with the flags above, so that every in-process test of a worker computes
# with the same XLA options. Left to the first caller, a test running a command's entry point in-process
# (zoo.tools.inspect_step.main, zoo.tools.plan.main) would start it with train.py's CPU defaults (xla.cpu_ynn_fusions),
# and the later tests of that worker would compute with YNNPACK's fused dots: in bfloat16 their results
# then depend on the program, so an exact comparison passed or failed by test order. The commands the
# tests start as processes still run with train.py's defaults.
import jax  # noqa: E402

jax.devices()

# The Hydra options Python defines (every named model size, model=hf, mesh/_defaults) are registered when
# zoo.train.run_config is imported, as every Zoo command does before composing; tests that compose conf/ with
# Hydra's API directly get them from here.
import zoo.train.run_config  # noqa: E402, F401

# Python's cyclic garbage collector at its defaults (a young collection every 700 net allocations, a
# full one every ~100 of those) spent ~4% of a test worker's CPU: tracing allocates millions of
# short-lived objects, and each full collection walked every imported module's objects again
# (tests/test_hf_families.py in one process: 6.0 s of 143 s in collections). Rarer young collections,
# and the objects alive once tests are collected frozen out of the full ones: 2.3 s.
import gc  # noqa: E402

gc.set_threshold(100_000, 50, 100)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


# The files that take longest, first (by their CPU time in the default tier): xdist hands a worker whole
# files (`--dist loadfile`), in the order collected (`--no-loadscope-reorder`: xdist's own order, most
# tests first, ran test_distributed.py's few long tests last), to whichever worker is free; long files
# collected late (alphabetically) kept one worker busy while the other had nothing left to take.
# test_train_cli.py, whose bad-input processes must end within 15 s, comes after the README's commands
# (tests/test_readme.py runs two at a time), not beside them.
LONGEST_FIRST = (
    "test_readme.py",
    "test_train_sharding.py",
    "test_checkpoint.py",
    "test_offload.py",
    "test_bad_input.py",
    "test_hf_families.py",
    "test_inspect.py",
    "test_train_cli.py",
    "test_distributed.py",
    "test_moe_dispatch.py",
    "test_hf_train.py",
    "test_offload_ranges.py",
    "test_forward_mode.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept


import pathlib  # noqa: E402

import pytest  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture
def ref_dir():
    def get(name: str) -> pathlib.Path:
        return DATA / name

    return get


@pytest.fixture
def fresh_compiles():
    """For tests that time compilation: nothing they compile goes into the persistent cache, so a repeated
    measurement compiles again instead of loading the first one's result."""
    import jax

    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
