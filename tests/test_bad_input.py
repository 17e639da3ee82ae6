"""A new user's bad inputs, through the real commands: each ends with one line naming the key or file
and the fix (exit code 2 before anything compiles; 130 for Ctrl-C; 0 with one `note:` line where the
tool goes on), no traceback, and no file an earlier run wrote changes.

One small run is trained once for the module (llama_tiny_a on one device, 3 steps, a checkpoint each
step) and exported once as a Hugging Face directory; every case works on copies of them.
"""

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

import in_process
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["mesh=single", "xla.cpu_devices=1", "data.batch_size=4", "data.seq_len=16", "xla.cpu_fast_compile=true",
        "trainer.progress=false"]  # fmt: skip
EVERY = ["checkpoint.every_n_steps=1", "checkpoint.keep_last=3"]
LLAMA = "model=llama_tiny_a"


def env(**extra) -> dict:
    e = dict(os.environ)
    e.pop("ZOO_TRACEBACK", None)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([e["PYTHONPATH"]] if e.get("PYTHONPATH") else [])])
    e["PYTHONUNBUFFERED"] = "1"  # the Ctrl-C cases wait for a line of the run's output
    e.update(extra)
    return e


def train_cmd(*args) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *args]


def tool_cmd(tool: str, *args) -> list[str]:
    return [sys.executable, "-m", f"zoo.tools.{tool}", *args]


def fingerprint(*paths: pathlib.Path) -> dict:
    out = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        out.update({str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files})
    return out


def _train_base(ckpt, run, cwd):
    """The base run's command: 3 steps of the tiny Llama with every group set, state on host."""
    return subprocess.run(
        train_cmd(
            LLAMA,
            *TINY,
            *EVERY,
            "offload=[llama_qkv_offload,optimizer_host]",
            "trainer.steps=3",
            f"checkpoint.dir={ckpt}",
            f"hydra.run.dir={run}",
        ),
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One finished run (its run directory and checkpoints of steps 1-3) and its step 3 exported."""
    if in_process.INNER:
        return pathlib.Path(os.environ[BASE_ENV]), None
    d = tmp_path_factory.mktemp("base")
    p = _train_base(d / "ckpt", d / "run", cwd=d)
    assert p.returncode == 0, p.stderr[-3000:]
    from zoo.train.hf_export import hf_export

    hf_export(d / "ckpt", d / "hf")
    return d, p.stdout


def test_the_same_command_over_a_finished_run_changes_none_of_its_files(base, tmp_path):
    """Its checkpoint is at trainer.steps: nothing left to train, and the finished run's summary.json,
    metrics.jsonl and .hydra/ stay as they were (no "ran no steps" summary over them)."""
    d, _ = base
    run, ckpt = _copy_run(tmp_path, d)
    before = fingerprint(run, ckpt)
    p = _train_base(ckpt, run, cwd=tmp_path)
    assert p.returncode == 0 and "nothing left to train" in p.stdout, p.stderr[-3000:]
    assert fingerprint(run, ckpt) == before


def test_a_resumed_run_continues_the_record_of_its_run_directory(base, tmp_path):
    """Resumed into its run directory with more steps: metrics.jsonl keeps steps 1-3 and appends 4-5,
    and .hydra/ stays the record of the command that began the run."""
    d, _ = base
    run, ckpt = _copy_run(tmp_path, d)
    first = (run / "metrics.jsonl").read_text()
    hydra = fingerprint(run / ".hydra")
    p = subprocess.run(
        train_cmd(LLAMA, *TINY, *EVERY, "trainer.steps=5", f"checkpoint.dir={ckpt}", f"hydra.run.dir={run}"),
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0 and "resuming from step 3" in p.stdout, p.stderr[-3000:]
    metrics = (run / "metrics.jsonl").read_text()
    assert metrics.startswith(first) and [json.loads(ln)["step"] for ln in metrics.splitlines()] == [0, 1, 2, 3, 4]
    assert fingerprint(run / ".hydra") == hydra and json.loads((run / "summary.json").read_text())["start_step"] == 3


def test_a_run_names_every_offload_preset_and_leaves_no_empty_log(base):
    d, stdout = base
    assert stdout.splitlines()[0].split(", offload ")[1].startswith("llama_qkv_offload+optimizer_host, "), (
        stdout.splitlines()[0]
    )
    assert not (d / "run" / "train.log").exists()  # Hydra's file log was always empty
    assert sorted(p.name for p in (d / "run").iterdir()) == [".hydra", "metrics.jsonl", "summary.json"]


# --- the cases -----------------------------------------------------------------------------------
# Each setup gets (tmp_path, base dir) and returns (command, working directory, paths that must not
# change); then (exit code, the regex stderr's one line matches), and for Ctrl-C what to do to the process.


def _copy_run(tmp, d):
    shutil.copytree(d / "run", tmp / "run")
    shutil.copytree(d / "ckpt", tmp / "ckpt")
    return tmp / "run", tmp / "ckpt"


def _unwritable_dir(tmp) -> pathlib.Path:
    """A directory this process cannot create files in (root ignores permissions: then /sys, read-only)."""
    ro = tmp / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        (ro / "probe").touch()
    except OSError:
        return ro
    (ro / "probe").unlink()
    if pathlib.Path("/sys/kernel").is_dir():
        return pathlib.Path("/sys/kernel")
    pytest.skip("no directory here is unwritable to this user")


def _books(tmp):
    (tmp / "books.jsonl").write_text('{"text": "a book"}\n')
    return tmp / "books.jsonl"


def _truncate_newest(ckpt):
    # Every data file, not only the largest: a reader of the parameters alone (zoo.tools.export) need not
    # open the file that holds the optimizer state, and which file is largest varies between runs.
    for f in (ckpt / "3" / "state").rglob("d/*"):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _cut_metrics(run: pathlib.Path) -> pathlib.Path:
    """The run directory, its metrics.jsonl cut to its first 50 bytes (no step record reads)."""
    metrics = run / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes()[:50])
    return run


def _live_lock(d: pathlib.Path, name: str):
    """A lock file as a live run writes it, owned by a live process other than the command's: this test
    process, or, where the command runs in this process (in_process.INNER), the test process that started
    this one."""
    from zoo.train.run_lock import _process_start

    owner = os.getppid() if in_process.INNER else os.getpid()
    (d / name).write_text(
        json.dumps(
            {
                "host": socket.gethostname(),
                "pid": owner,
                "pid_start": _process_start(owner),
                "started": "now",
                "command": "python train.py (the live run)",
            }
        )
    )


def _hf_with(tmp, d, weights: bytes = None, nan_tensor: str = None):
    hf = tmp / "hf"
    shutil.copytree(d / "hf", hf)
    if weights is not None:
        (hf / "model.safetensors").write_bytes(weights)
    if nan_tensor is not None:
        from safetensors.numpy import load_file, save_file

        tensors = load_file(hf / "model.safetensors")
        tensors[nan_tensor][0, 0] = np.nan
        save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    return hf


def _random_bytes() -> bytes:
    b = bytearray(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    b[8] = ord("x")  # a safetensors header would start with `{` here
    return bytes(b)


def _sweep_of_one(tmp, d, summary: bytes):
    """A sweep of one job, whose summary.json holds `summary`."""
    shutil.copytree(d / "run", tmp / "sweep" / "0")
    (tmp / "sweep" / "0" / "summary.json").write_bytes(summary)
    return tmp / "sweep"


def _sweep(tmp, d):
    """A sweep of two jobs: one trained, one resumed from a checkpoint already at trainer.steps."""
    sweep = tmp / "sweep"
    shutil.copytree(d / "run", sweep / "0")
    (sweep / "1").mkdir()
    (sweep / "1" / "summary.json").write_text(
        json.dumps(
            {
                "status": "ok",
                "overrides": ["trainer.steps=3"],
                "steps": 3,
                "start_step": 3,
                "steps_run": 0,
                "checkpoint": {"dir": "ckpt", "steps": [3]},
            }
        )
    )
    return sweep


def _hooked(tmp, module: str, patch: str) -> dict:
    """The environment for a command whose process runs `patch` (the source of a function `_patch(m)`)
    on the module `module` once it is imported: a sitecustomize, as the real command starts. The
    patches below slow or break the real code at one point, so the case meets it there."""
    hook = tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import builtins, errno, gc, os, pathlib, time\n" + patch + "_import = builtins.__import__\n"
        "def _hook(name, *a, **k):\n"
        "    m = _import(name, *a, **k)\n"
        f"    if name == {module!r} and not getattr(builtins, '_zoo_patched', False):\n"
        "        builtins._zoo_patched = True\n"
        f"        _patch(__import__({module!r}, fromlist=['_']))\n"
        "    return m\n"
        "builtins.__import__ = _hook\n"
    )
    return {"ZOO_TEST_WAITING": str(tmp / "waiting"), "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])}


# The wait for a save in flight takes 10 s and says when it starts, so a second Ctrl-C can be sent
# during it (a tiny model's save is otherwise over at once; the test sends it 0.5 s after the start).
SLOW_SAVE = """
def _patch(run):
    from zoo.train import checkpoint
    wait = checkpoint.Checkpoints.wait
    def slow(self):
        pathlib.Path(os.environ['ZOO_TEST_WAITING']).touch()
        time.sleep(10)
        wait(self)
    checkpoint.Checkpoints.wait = slow
"""


def _stalled_gc(module: str, function: str) -> str:
    """A patch: before `module.function` runs, a garbage collection whose callback takes 30 s (JAX
    registers such a callback): a Ctrl-C there is raised inside the callback, where Python reports it as
    "Exception ignored" and goes on."""
    return f"""
def _patch({module}):
    original = {module}.{function}
    def stalled(*a, **k):
        def collecting(phase, info):
            gc.callbacks.remove(collecting)
            pathlib.Path(os.environ['ZOO_TEST_WAITING']).touch()
            time.sleep(30)
        gc.callbacks.append(collecting)
        gc.collect()
        return original(*a, **k)
    {module}.{function} = stalled
"""


# Before the export reads the checkpoint.
STALLED_EXPORT = _stalled_gc("hf_export", "restore_model")
# In the planner's body, as it composes the config: the Ctrl-C Python swallows there ended nothing (the plan was
# written, exit 0); a tool's is raised again as soon as the callback has returned.
STALLED_PLAN = _stalled_gc("kit", "compose")
# A tool's imports (JAX's, Hydra's) take seconds; stalled here, as zoo.tools.cli is imported.
STALLED_IMPORTS = """
def _patch(cli):
    pathlib.Path(os.environ['ZOO_TEST_WAITING']).touch()
    time.sleep(30)
"""
# An atexit callback that takes 30 s (JAX's and orbax's run there), registered as zoo.tools.cli is imported: after
# train.py's own, so before it in the shutdown.
STALLED_EXIT = """
def _patch(cli):
    import atexit
    def stalled():
        pathlib.Path(os.environ['ZOO_TEST_WAITING']).touch()
        time.sleep(30)
    atexit.register(stalled)
"""
# As the parameters are initialised, before train.py's first step: the Ctrl-C Python swallows there still
# ends the run, at the next phase (compiling).
STALLED_INIT = _stalled_gc("run", "initial_state")
# The disk fills up while step 4's checkpoint is written: orbax's background thread fails writing its
# metadata file (the arrays before it were written).
DISK_FULL = """
def _patch(run):
    from zoo._compat import orbax_json_checkpoint_handler
    handler = orbax_json_checkpoint_handler()
    save = handler._save_fn
    async def full(self, item, directory):
        if isinstance(item, dict) and item.get('step') == 4:
            raise OSError(errno.ENOSPC, 'No space left on device', str(directory / 'metadata'))
        return await save(self, item, directory)
    handler._save_fn = full
"""

# XLA runs out of device memory (as a TPU's compiler says it; XLA:CPU never does): the compile raises it.
OUT_OF_MEMORY = """
def _patch(run):
    def compile(self, *a, **k):
        raise RuntimeError('RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. '
                           'Ran out of memory in memory space hbm. '
                           'Used 16.11G of 15.75G hbm. Exceeded hbm capacity by 368.49M.')
    run.Trainer.compile = compile
"""


def _wait_for(pred, proc, seconds=300):
    t0 = time.time()
    while not pred():
        assert proc.poll() is None, f"the run ended early: {proc.stderr.read() if proc.stderr else ''}"
        assert time.time() - t0 < seconds, "timed out"
        time.sleep(0.05)


def _ctrl_c_before_first_step(proc, tmp):
    line = proc.stdout.readline()  # the first line: the model is described, nothing has compiled yet
    assert line.startswith("model "), line
    proc.send_signal(signal.SIGINT)


def _ctrl_c_while_sampling_compiles(proc, tmp):
    for line in proc.stderr:  # the tool's progress goes to stderr; its last line before compiling:
        if line.startswith("generating up to "):
            break
    proc.send_signal(signal.SIGINT)


def _ctrl_c_when_waiting(proc, tmp):
    _wait_for(lambda: (tmp / "waiting").exists(), proc)
    proc.send_signal(signal.SIGINT)


def _ctrl_c_twice(proc, tmp):
    metrics = tmp / "run2" / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, proc)
    proc.send_signal(signal.SIGINT)
    _wait_for(lambda: (tmp / "waiting").exists(), proc)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)


HF_Q = "model.layers.1.self_attn.q_proj.weight"
CASES = {
    # Keys of another data source: refused with "set data=text", never accepted (with + they trained on markov).
    "data.path with markov data": (
        lambda t, d: (train_cmd(LLAMA, *TINY, f"data.path={_books(t)}", f"hydra.run.dir={t / 'run'}"), t, [_books(t)]),
        (
            2,
            r"data\.path: only data=text reads it, .*; set `data=text` \(python train\.py data=text "
            r"data\.path=.*books\.jsonl\)",
        ),
    ),
    "+data.path with markov data": (
        lambda t, d: (train_cmd(LLAMA, *TINY, f"+data.path={_books(t)}", f"hydra.run.dir={t / 'run'}"), t, [_books(t)]),
        (2, r"data\.path: only data=text reads it, and data=markov is synthetic tokens; set `data=text` .*"),
    ),
    "data.eval_fraction with markov data": (
        lambda t, d: (train_cmd(LLAMA, *TINY, "data.eval_fraction=0.1", f"hydra.run.dir={t / 'run'}"), t, []),
        (2, r"data\.eval_fraction: only data=text has a held-out split, .*; set `data=text` .*"),
    ),
    "data.branching with data=uniform": (
        lambda t, d: (train_cmd(LLAMA, *TINY, "data=uniform", "data.branching=3", f"hydra.run.dir={t / 'run'}"), t, []),
        (2, r"data\.branching: only data=markov reads it \(.*\); drop it, or set `data=markov`"),
    ),
    "empty data.path with data=text": (  # it trained on the shipped corpus
        lambda t, d: (train_cmd(LLAMA, *TINY, "data=text", "data.path=", f"hydra.run.dir={t / 'run'}"), t, []),
        (
            2,
            r"data\.path: empty \(an unset shell variable\?\); give a path, or leave data\.path out \(null: the "
            r"shipped corpus\)",
        ),
    ),
    "trainer.eval_every with synthetic data": (
        lambda t, d: (train_cmd(LLAMA, *TINY, "trainer.eval_every=5", f"hydra.run.dir={t / 'run'}"), t, []),
        (
            2,
            r"trainer\.eval_every: evaluates the held-out split, and data=markov has none \(its synthetic tokens are "
            r"endless\); drop it, "
            r"or train on text with a split \(data=text data\.eval_fraction=0\.05\)",
        ),  # fmt: skip
    ),
    # Keys that turn nothing on: full fine-tuning under lora=default, an MLA tag on a model without MLA.
    "lora.rank=0 with lora=default": (
        lambda t, d: (train_cmd(LLAMA, *TINY, "lora=default", "lora.rank=0", f"hydra.run.dir={t / 'run'}"), t, []),
        (
            2,
            r"lora\.rank: 0 turns LoRA off, so lora\.alpha, .* would be ignored and every parameter would train; give "
            r"a positive rank "
            r"\(e\.g\. lora\.rank=8\), or choose lora=none for full fine-tuning",
        ),  # fmt: skip
    ),
    "+offload.block_tags.mla on Llama": (  # where the hint for offload.block_tags.mla.mla_q=offload leads
        lambda t, d: (
            train_cmd(
                LLAMA, *TINY, "offload=full", "+offload.block_tags.mla.mla_q=offload", f"hydra.run.dir={t / 'run'}"
            ),
            t,
            [],
        ),
        (
            2,
            r"offload\.block_tags\.mla: the llama model has no mla blocks \(its optional blocks: mlp\), so this would "
            r"be ignored; drop it",
        ),
    ),
    "missing data.eval_path": (
        lambda t, d: (
            train_cmd(LLAMA, *TINY, "data=text", "data.eval_path=no_such.txt", f"hydra.run.dir={t / 'run'}"),
            t,
            [],
        ),
        (2, r"data\.eval_path: no_such\.txt does not exist; point data\.eval_path at a \.txt or \.jsonl file .*"),
    ),
    # The run directory.
    "hydra.run.dir is a file": (
        lambda t, d: (train_cmd(LLAMA, *TINY, f"hydra.run.dir={_books(t)}"), t, [_books(t)]),
        (2, r"hydra\.run\.dir: .*books\.jsonl is a file, not a directory; choose a writable directory .*"),
    ),
    "hydra.run.dir cannot be created": (
        lambda t, d: (train_cmd(LLAMA, *TINY, "hydra.run.dir=/proc/no_such_dir/run"), t, []),
        (2, r"hydra\.run\.dir: cannot create /proc/no_such_dir/run in /proc \(.*\); choose a writable directory .*"),
    ),
    "hydra.run.dir unwritable": (
        lambda t, d: (train_cmd(LLAMA, *TINY, f"hydra.run.dir={_unwritable_dir(t)}"), t, []),
        (2, r"hydra\.run\.dir: cannot write in \S+ \(.*\); choose a writable directory .*"),
    ),
    "read-only working directory": (
        lambda t, d: (train_cmd(LLAMA, *TINY), _unwritable_dir(t), []),
        (
            2,
            r"hydra\.run\.dir: cannot create \S+/outputs in \S+ \(.*\) \(the working directory: .*\); run from a "
            r"writable directory "
            r"or set hydra\.run\.dir=.*",
        ),  # fmt: skip
    ),
    "empty hydra.run.dir": (  # an unset shell variable: Hydra would write into the working directory
        lambda t, d: (train_cmd(LLAMA, *TINY, "hydra.run.dir="), t, [t]),
        (
            2,
            r"hydra\.run\.dir: empty \(an unset shell variable\?\); give a directory, e\.g\. hydra\.run\.dir=runs/1, "
            r"or leave it out "
            r"for Hydra's default \(outputs/<date>/<time>\)",
        ),  # fmt: skip
    ),
    # Another run from step 0 into a finished run's directory: refused before it writes, .hydra/ included.
    "hydra.run.dir of a finished run": (
        lambda t, d: (
            train_cmd(LLAMA, *TINY, "trainer.steps=2", f"hydra.run.dir={_copy_run(t, d)[0]}"),
            t,
            [t / "run"],
        ),
        (
            2,
            r"hydra\.run\.dir: (\S+/run) holds the metrics\.jsonl and summary\.json of a finished run, which this run "
            r"would replace "
            r"\(it starts from step 0\); give this run another hydra\.run\.dir, or move \1 away \(a run that resumes "
            r"a checkpoint continues "
            r"the record there\)",
        ),  # fmt: skip
    ),
    "hydra.run.dir of a finished run whose metrics.jsonl is cut short": (  # damaged: still that run's record
        lambda t, d: (
            train_cmd(LLAMA, *TINY, "trainer.steps=2", f"hydra.run.dir={_cut_metrics(_copy_run(t, d)[0])}"),
            t,
            [t / "run"],
        ),
        (
            2,
            r"hydra\.run\.dir: (\S+/run) holds the metrics\.jsonl and summary\.json of a finished run, which this run "
            r"would replace \(it starts from step 0\); give this run another hydra\.run\.dir, or move \1 away .*",
        ),
    ),
    # The run's record among a checkpoint's steps, a checkpoint's steps among a Hugging Face model's files.
    "hydra.run.dir in a checkpoint.dir": (
        lambda t, d: (train_cmd(LLAMA, *TINY, f"hydra.run.dir={_copy_run(t, d)[1]}"), t, [t / "ckpt"]),
        (
            2,
            r"hydra\.run\.dir: \S+/ckpt is a train\.py checkpoint\.dir, which this would change; choose a writable "
            r"directory .*",
        ),
    ),
    "checkpoint.dir holding a Hugging Face model": (
        lambda t, d: (
            train_cmd(LLAMA, *TINY, f"checkpoint.dir={_hf_with(t, d)}", f"hydra.run.dir={t / 'run'}"),
            t,
            [t / "hf"],
        ),
        (
            2,
            r"checkpoint\.dir: (\S+/hf) holds a Hugging Face model \(config\.json, \*\.safetensors\), not train\.py's "
            r"checkpoints; to start from it, model=hf model\.path=\1; give checkpoint\.dir a directory of its own",
        ),
    ),
    # A second run into the directories of a live one: refused before Hydra writes into its run directory.
    "same run dir and checkpoint as a live run": (
        lambda t, d: (
            (
                lambda run, ckpt: (
                    (_live_lock(run, "zoo.run.lock"), _live_lock(ckpt, "zoo.lock"))
                    and train_cmd(
                        LLAMA, *TINY, *EVERY, "trainer.steps=6", f"checkpoint.dir={ckpt}", f"hydra.run.dir={run}"
                    )
                )
            )(*_copy_run(t, d)),
            t,
            [t / "run", t / "ckpt"],
        ),  # fmt: skip
        (
            2,
            r"hydra\.run\.dir: \S+/run is in use by another run \(pid \d+ on .*\); wait for it to end or give this "
            r"run another hydra\.run\.dir .*",
        ),
    ),
    # A tool's output over a file it did not write: refused before anything is measured or compiled.
    "zoo.tools.measure_hardware over the shipped cpu profile": (
        lambda t, d: (tool_cmd("measure_hardware", "name=cpu"), t, [ROOT / "conf" / "hardware" / "cpu.yaml"]),
        (
            2,
            r"name: \S+/conf/hardware/cpu\.yaml is a file shipped with Zoo \(conf/hardware/cpu\.yaml\), which this "
            r"would replace; give another name, or add overwrite=true to replace it",
        ),
    ),
    # A tool's output inside a checkpoint.dir: a new file in a step changed what orbax saved there.
    "zoo.tools.plan plan.out inside a checkpoint's step": (
        lambda t, d: (
            tool_cmd("plan", LLAMA, "mesh=single", f"plan.out={_copy_run(t, d)[1] / '3' / 'plan.yaml'}"),
            t,
            [t / "ckpt"],
        ),
        (2, r"plan\.out: (\S+/ckpt)/3/plan\.yaml is inside the train\.py checkpoint \1, which this would change; .*"),
    ),
    "zoo.tools.export into a checkpoint's step": (
        lambda t, d: (tool_cmd("export", str(_copy_run(t, d)[1]), str(t / "ckpt" / "3" / "hf")), t, [t / "ckpt"]),
        (2, r"(\S+/ckpt)/3/hf: inside the train\.py checkpoint \1, which this would change; choose a directory .*"),
    ),
    "zoo.tools.report over a report.md of the user's in the sweep": (  # it was replaced
        lambda t, d: (
            (lambda sweep: (sweep / "report.md").write_text("my notes\n") and tool_cmd("report", str(sweep)))(
                _sweep(t, d)
            ),
            t,
            [t / "sweep"],
        ),
        (
            2,
            r"dir: \S+/sweep/report\.md exists and was not written by python -m zoo\.tools\.report, which this would "
            r"replace; give another dir, or add --overwrite to replace it",
        ),
    ),
    "zoo.tools.inspect_step inspect.out over a run's metrics.jsonl": (
        lambda t, d: (
            tool_cmd("inspect_step", LLAMA, *TINY, f"inspect.out={_copy_run(t, d)[0] / 'metrics.jsonl'}"),
            t,
            [t / "run"],
        ),
        (
            2,
            r"inspect\.out: \S+/run/metrics\.jsonl is a file of the train\.py run in \S+/run, which this would "
            r"replace; give another inspect\.out, or add inspect\.overwrite=true to replace it",
        ),
    ),
    # Ctrl-C.
    "Ctrl-C before the first step": (
        lambda t, d: (train_cmd(LLAMA, *TINY, "trainer.steps=3", f"hydra.run.dir={t / 'run'}"), t, []),
        (130, r"interrupted \(Ctrl-C\) while .*; .*run the (same )?command again"),
        _ctrl_c_before_first_step,
    ),
    "a second Ctrl-C during the save": (
        lambda t, d: (
            train_cmd(
                LLAMA,
                *TINY,
                *EVERY,
                "trainer.steps=500",
                f"checkpoint.dir={t / 'ckpt2'}",
                f"hydra.run.dir={t / 'run2'}",
            ),
            t,
            [],
        ),
        (
            130,
            r"interrupted \(Ctrl-C\) while waiting for the checkpoint save in flight, after a first Ctrl-C; the steps "
            r"saved before it are "
            r"intact \(last: \d+ in .*\);.* run the same command to resume",
        ),  # fmt: skip
        _ctrl_c_twice,
        ("zoo.train.run", SLOW_SAVE),
    ),
    "Ctrl-C while zoo.tools.generate compiles": (
        lambda t, d: (
            tool_cmd("generate", f"model.path={_hf_with(t, d)}", "tokenizer=bytes", "prompt=hi", "max_new_tokens=4"),
            t,
            [t / "hf"],
        ),
        (130, r"interrupted \(Ctrl-C\) while compiling the sampler; nothing was generated; run the command again"),
        _ctrl_c_while_sampling_compiles,
    ),
    "Ctrl-C swallowed by a garbage-collector callback in zoo.tools.export": (
        lambda t, d: (tool_cmd("export", str(_copy_run(t, d)[1]), str(t / "out")), t, [t / "ckpt"]),
        (
            130,
            r"interrupted \(Ctrl-C\) while reading the checkpoint \S+/ckpt; nothing was written to \S+/out; run the "
            r"same command again",
        ),
        _ctrl_c_when_waiting,
        ("zoo.train.hf_export", STALLED_EXPORT),
    ),
    "Ctrl-C swallowed by a garbage-collector callback in zoo.tools.plan": (
        lambda t, d: (
            tool_cmd("plan", LLAMA, "mesh=single", "data.batch_size=2", "data.seq_len=16", "hardware=h100_pcie"),
            t,
            [],
        ),
        (130, r"interrupted \(Ctrl-C\) while starting; nothing was done; run the command again"),
        _ctrl_c_when_waiting,
        ("zoo.tools.kit", STALLED_PLAN),
    ),
    "Ctrl-C during a tool's imports": (
        lambda t, d: (tool_cmd("report", str(_sweep(t, d))), t, [t / "sweep"]),
        (130, r"interrupted \(Ctrl-C\) while starting; nothing was done; run the command again"),
        _ctrl_c_when_waiting,
        ("zoo.tools.cli", STALLED_IMPORTS),
    ),
    "Ctrl-C during train.py's imports": (
        lambda t, d: (train_cmd(LLAMA, *TINY, "trainer.steps=3", f"hydra.run.dir={t / 'run'}"), t, []),
        (130, r"interrupted \(Ctrl-C\) while starting; nothing was done; run the command again"),
        _ctrl_c_when_waiting,
        ("zoo.tools.cli", STALLED_IMPORTS),
    ),
    "Ctrl-C while train.py exits": (
        lambda t, d: (train_cmd(LLAMA, "--cfg", "job"), t, []),
        (130, r"interrupted \(Ctrl-C\) while exiting, after the command had ended \(exit code 0\)"),
        _ctrl_c_when_waiting,
        ("zoo.tools.cli", STALLED_EXIT),
    ),
    "Ctrl-C swallowed by a garbage-collector callback before train.py's first step": (
        lambda t, d: (train_cmd(LLAMA, *TINY, "trainer.steps=3", f"hydra.run.dir={t / 'run'}"), t, []),
        (
            130,
            r"interrupted \(Ctrl-C\) while initialising the parameters, before any step ran; nothing was trained or "
            r"saved; run the same command again",
        ),
        _ctrl_c_when_waiting,
        ("zoo.train.run", STALLED_INIT),
    ),
    # The disk fills up during a save: the run stops at once, naming the step and the last good checkpoint.
    "disk full during a checkpoint save": (
        lambda t, d: (
            train_cmd(
                LLAMA,
                *TINY,
                "trainer.steps=50",
                "checkpoint.every_n_steps=2",
                f"checkpoint.dir={t / 'ckpt'}",
                f"hydra.run.dir={t / 'run'}",
            ),
            t,
            [],
        ),  # fmt: skip
        (
            1,
            r"step 4: saving its checkpoint failed \(No space left on device\), so the run stopped; last good "
            r"checkpoint: step 2 in (\S+/ckpt); "
            r"free space in \1 \(or give another checkpoint\.dir\) and run the same command to resume",
        ),  # fmt: skip
        None,
        ("zoo.train.run", DISK_FULL),
    ),
    # Out of device memory: XLA's figures, who holds it by the planner's count, the change that frees the most.
    "out of device memory": (
        lambda t, d: (
            train_cmd(LLAMA, *TINY, "hardware=cpu", "hardware.hbm_bytes=1000000", f"hydra.run.dir={t / 'run'}"),
            t,
            [],
        ),
        (
            2,
            r"out of device memory \(XLA: 16\.11G needed, 15\.75G available\): the planner puts this step at [\d.]+ "
            r"MB per device, "
            r"the largest holders optimizer state [\d.]+ kB, parameters .*; the change that frees the most: .*; the "
            r"whole table: "
            r"python -m zoo\.tools\.plan .*hardware\.hbm_bytes=1000000 plan\.holders=true$",
        ),  # fmt: skip
        None,
        ("zoo.train.run", OUT_OF_MEMORY),
    ),
    # Checkpoints read by the tools.
    "zoo.tools.export, newest step damaged": (
        lambda t, d: (
            (_copy_run(t, d), _truncate_newest(t / "ckpt")) and tool_cmd("export", str(t / "ckpt"), str(t / "out")),
            t,
            [t / "ckpt"],
        ),
        (0, r"note: \S+/ckpt: using step 2, the newest step that reads; skipped step 3: .*"),
    ),
    "zoo.tools.export --adapters-only of a run without LoRA": (
        lambda t, d: (tool_cmd("export", str(_copy_run(t, d)[1]), str(t / "out"), "--adapters-only"), t, [t / "ckpt"]),
        (
            2,
            r"\S+/ckpt: not a LoRA run \(its checkpoint holds the whole model, no adapters\); export it without "
            r"--adapters-only",
        ),
    ),
    "zoo.tools.generate, every step without its manifest": (
        lambda t, d: (
            (_copy_run(t, d), [m.unlink() for m in (t / "ckpt").glob("*/state/manifest.ocdbt")])
            and tool_cmd("generate", f"checkpoint.dir={t / 'ckpt'}", "prompt=hi", "tokenizer=bytes"),
            t,
            [t / "ckpt"],
        ),
        (
            2,
            r"\S+/ckpt: step 1 is unreadable \(state/manifest\.ocdbt is missing\), as are steps 2, 3: no intact "
            r"checkpoint is left; .*",
        ),
    ),
    "zoo.tools.report, a job ran no steps": (
        lambda t, d: (tool_cmd("report", str(_sweep(t, d))), t, [t / "sweep" / "0", t / "sweep" / "1"]),
        (0, r"note: job\(s\) 1 ran no steps, so they have no timing; marked in report\.md"),
    ),
    "zoo.tools.report, a binary summary.json in a sweep": (
        lambda t, d: (tool_cmd("report", str(_sweep_of_one(t, d, b"\x80\xff binary"))), t, [t / "sweep" / "0"]),
        (
            0,
            r"note: \S+/sweep/0/summary\.json is unreadable \(not UTF-8 text: byte 0x80 at offset 0\); marked failed "
            r"in report\.md",
        ),
    ),
    "zoo.tools.report, a summary.json of the wrong types": (  # a number where train.py writes a list: a traceback
        lambda t, d: (
            tool_cmd("report", str(_sweep_of_one(t, d, json.dumps({"status": "ok", "overrides": 5}).encode()))),
            t,
            [t / "sweep" / "0"],
        ),
        (0, r"note: \S+/sweep/0/summary\.json is unreadable \(its overrides is 5, not a list\); marked failed in .*"),
    ),
    "zoo.tools.report, a binary metrics.jsonl": (
        lambda t, d: (
            (_copy_run(t, d), (t / "run" / "metrics.jsonl").write_bytes(b"\x80\xff binary"))
            and tool_cmd("report", str(t / "run")),
            t,
            [t / "run"],
        ),  # fmt: skip
        (
            2,
            r"dir: \S+/run/metrics\.jsonl holds no step record \(not UTF-8 text: byte 0x80 at offset 0\): damaged, or "
            r"not train\.py's; "
            r"give the directory of a train\.py run",
        ),  # fmt: skip
    ),
    # Hugging Face weights.
    "random bytes as model.safetensors": (
        lambda t, d: (
            train_cmd(
                *TINY, "model=hf", f"model.path={_hf_with(t, d, weights=_random_bytes())}", f"hydra.run.dir={t / 'run'}"
            ),
            t,
            [t / "hf"],
        ),  # fmt: skip
        (
            2,
            r"model\.path: \S+/model\.safetensors: not a safetensors file \(it does not start with a header length "
            r"and a JSON header\); .*",
        ),
    ),
    "a folder named model.safetensors": (  # open() raised IsADirectoryError: a traceback
        lambda t, d: (
            (
                lambda hf: (
                    [(hf / "model.safetensors").unlink(), (hf / "model.safetensors").mkdir()]
                    and train_cmd(*TINY, "model=hf", f"model.path={hf}", f"hydra.run.dir={t / 'run'}")
                )
            )(_hf_with(t, d)),
            t,
            [t / "hf"],
        ),
        (2, r"model\.path: \S+/hf/model\.safetensors: not a file; a \.safetensors name belongs to .*"),
    ),
    "NaN weights in zoo.tools.generate's model.path": (  # refused as train.py refuses them, not loaded
        lambda t, d: (
            tool_cmd("generate", f"model.path={_hf_with(t, d, nan_tensor=HF_Q)}", "tokenizer=bytes", "prompt=hi"),
            t,
            [t / "hf"],
        ),
        (2, rf"\S+/hf: tensor {re.escape(HF_Q)} holds non-finite values \(NaN or inf\); .*"),
    ),
    # A config.json that does not read: the file named (it was Python's UnicodeDecodeError alone), or an
    # eos_token_id of the wrong type (int()'s ValueError alone).
    "binary config.json in zoo.tools.generate's model.path": (
        lambda t, d: (
            (
                lambda hf: (
                    (hf / "config.json").write_bytes(b'{"x": "\x80\xff"}')
                    and tool_cmd("generate", f"model.path={hf}", "tokenizer=bytes", "prompt=hi")
                )
            )(_hf_with(t, d)),
            t,
            [t / "hf"],
        ),  # fmt: skip
        (2, r"\S+/hf/config\.json: not UTF-8 text \(byte 0x80 at offset 7\); download or copy it again"),
    ),
    "eos_token_id of the wrong type in zoo.tools.generate's model.path": (
        lambda t, d: (
            (
                lambda hf: (
                    (hf / "generation_config.json").write_text('{"eos_token_id": "</s>"}')
                    and tool_cmd("generate", f"model.path={hf}", "tokenizer=bytes", "prompt=hi")
                )
            )(_hf_with(t, d)),
            t,
            [t / "hf"],
        ),  # fmt: skip
        (
            2,
            r"\S+/hf/generation_config\.json: eos_token_id is \"</s>\", not a token id or a list of them; fix it, or "
            r"give stop_tokens=\[<ids>\]",
        ),
    ),
    "NaN weights in model.path": (
        lambda t, d: (
            train_cmd(
                *TINY,
                "model=hf",
                f"model.path={_hf_with(t, d, nan_tensor=HF_Q)}",
                "trainer.steps=2",
                f"hydra.run.dir={t / 'run'}",
            ),
            t,
            [t / "hf"],
        ),  # fmt: skip
        (2, rf"model\.path: \S+/hf: tensor {re.escape(HF_Q)} holds non-finite values \(NaN or inf\); .*"),
    ),
}


# Cases that need a process of their own: a signal sent to it (Ctrl-C), a module patched as it starts
# (`_hooked`), or a checkpoint read that fails (what orbax left reading may speak as the process
# exits). Every other case runs in one pytest process through the command's entry point
# (tests/in_process.py): the same checks, without a Python start and Hydra's imports per case.
OWN_PROCESS = {case for case, spec in CASES.items() if len(spec) > 2} | {"zoo.tools.export, newest step damaged"}
BASE_ENV = "ZOO_TEST_BAD_INPUT_BASE"  # the in-process run's base: this module's


@pytest.mark.parametrize("case", [c if c in OWN_PROCESS else pytest.param(c, marks=in_process.MARK) for c in CASES])
def test_bad_input_ends_in_one_line_and_changes_no_file(case, base, tmp_path, request, capfd, monkeypatch):
    if case not in OWN_PROCESS and not in_process.INNER:
        # JAX started as train.py starts it for xla.cpu_devices=1 (TINY)
        return in_process.outcome(request, {BASE_ENV: str(base[0]), "XLA_FLAGS": in_process.xla_flags(1)})
    setup, (code, line), interact, hook = (*CASES[case], None, None)[:4]
    cmd, cwd, guarded = setup(tmp_path, base[0])
    before = fingerprint(*guarded)
    if in_process.INNER:
        p = in_process.run(cmd, cwd, capfd, monkeypatch)
        returncode, out, err = p.returncode, p.stdout, p.stderr
    else:
        extra = _hooked(tmp_path, *hook) if hook else {}
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env(**extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            if interact:
                interact(proc, tmp_path)
            out, err = proc.communicate(timeout=600)
        finally:
            proc.kill()
        returncode = proc.returncode
    _check(case, tmp_path, code, line, returncode, out, err, guarded, before)


def _check(case, tmp_path, code, line, returncode, out, err, guarded, before):
    """What every case is held to, and what some are held to besides."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    prefix = "error: " if code else ""
    assert len(lines) == 1 and re.fullmatch(prefix + line, lines[0]), err[-3000:]
    if code == 2:
        assert "s, compile " not in out  # it stopped before compiling anything
    assert fingerprint(*guarded) == before  # nothing a run had written changed
    if case == "a second Ctrl-C during the save":
        from zoo.train.checkpoint import restore_model

        last = int(re.search(r"\(last: (\d+) in ", lines[0]).group(1))
        assert restore_model(tmp_path / "ckpt2", last)[1]["step"] == last  # the checkpoint it names reads
    if case == "zoo.tools.report, a job ran no steps":
        table = (tmp_path / "sweep" / "report.md").read_text()
        assert (
            "| ran no steps (its checkpoint was already at step 3 of trainer.steps=3) |" in table and "| ok |" in table
        )
    if case == "zoo.tools.export, newest step damaged":
        assert "exported step 2 of " in out
    if case == "Ctrl-C swallowed by a garbage-collector callback before train.py's first step":
        assert not (tmp_path / "run" / "metrics.jsonl").exists()  # it stopped before any step
    if case == "Ctrl-C swallowed by a garbage-collector callback in zoo.tools.export":
        assert (
            not (tmp_path / "out").exists() and not (tmp_path / "out.export-tmp").exists()
        )  # nothing looks like an export
    if case == "Ctrl-C swallowed by a garbage-collector callback in zoo.tools.plan":
        assert not list(tmp_path.rglob("*.yaml"))  # it stopped there: no plan written
    if case == "disk full during a checkpoint save":
        from zoo.train.checkpoint import restore_model

        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name[0].isdigit()) == [
            "2",
            "4.orbax-checkpoint-tmp",
        ]
        assert restore_model(tmp_path / "ckpt", 2)[1]["step"] == 2  # the last good step reads
        assert (
            len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) <= 6
        )  # it stopped at once, not at the next save
