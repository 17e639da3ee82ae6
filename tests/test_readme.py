"""The README's commands, run as documented on a default CPU (one device, no XLA_FLAGS), so the
README cannot drift from the code.

Every command in a fenced block (`$ cmd` lines, and the lines of ```bash blocks) is either run here
or on `NOT_RUN` with the reason; a command that is neither fails the test, so sections added later
are picked up. A `$ cmd` line followed by an `error: ...` line is run and must print that line (up
to a `...` where the README elides) and exit 2.
"""

import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Commands not run here, by a pattern they match, with why. Keep reasons specific.
NOT_RUN = {
    r"^pip install": "installs packages (CI installs the project itself)",
    r"python -m pytest": "the test suite itself",
    r"^srun ": "needs a SLURM cluster",
    r"hydra/launcher=(slurm|joblib)": "needs a SLURM cluster or the joblib launcher plugin",
    r"distributed\.coordinator_address=127\.0\.0\.1": "two processes with gloo: tests/test_distributed.py runs this setup",
    r"model=llama_1b|hardware=(h100_pcie|gh200|h200_pcie)": "a 1.2B model or a GPU profile: minutes of tracing on CPU (tests/test_plan.py covers the planner)",
    r"data\.path=(~/notes/|books\.jsonl|corpus/)": "placeholder paths for the user's own text",
    r"multirun/<date>|<train\.py overrides>": "a placeholder, not a command",
    r"bench/gpu\.py": "needs a GPU",
    r"checkpoint\.dir=ckpt/": "trains 300 steps with a Ctrl-C in between (tests/test_checkpoint.py runs resume)",
    # Not yet run at tiny size (issue 13 asks for it; the commands below train or trace for minutes as written):
    r"^python train\.py\s*(#|$)": "trains 100 steps as documented (62 s wall on the development machine): not run here yet",
    r"^python train\.py (data=text|model=llama_tiny_a 'offload|model=llama_tiny_a offload=|'offload=|-m offload=|model=dsv3_tiny_a offload=custom)": "trains 100 steps as documented: not run here yet",
    r"^for x in default|^python -m zoo\.report multirun/xla": "three training runs: not run here yet",
    r"^python -m zoo\.inspect model=dsv3_tiny_a": "compiles a step: covered by tests/test_inspect.py, not run here yet",
    r"^python -m zoo\.measure_hardware": "times 256 MB copies: covered by tests/test_plan.py",
    r"^python bench/cpu\.py|bench/cpu": "the CPU benchmark (7 min; tests/test_bench.py runs --quick)",
    r"model=(qwen2|qwen3|gemma3|qwen3_moe|mixtral|gpt_oss)_100m": "a recorded ~100M run (minutes each); tests/test_train_cli.py trains every family's tiny size",
    r"model=(deepseek_v3_671b|llama3\.1_405b) xla\.cpu_devices=128": "compiles a real-size step on 128 simulated devices (minutes); tests/test_train_sharding.py covers the scale report",
    r"^echo \$\?|scontrol requeue": "part of a shell script around a stopped run (tests/test_checkpoint.py checks exit code 75)",
    r"checkpoint\.dir=/tmp/loop/": "a run stopped by SIGTERM from another shell: tests/test_checkpoint.py runs that",
    r"model=hf model\.path=tests/data/llama_tiny_a data=text|^python -m zoo\.export checkpoints/finetune": "the fine-tuning walk-through: tests/test_hf_train.py runs its bash block as written",
    r"^python -m zoo\.generate model\.path=tests/data/llama_tiny_a": "tests/test_generate.py runs it as the README shows",
    r"^python -m zoo\.inspect model=llama_tiny_a mesh=single data\.batch_size=2 data\.seq_len=16 'offload=\[full,params_host": "compiles a step: the inspector's update lines are covered by tests/test_offload.py, not run here yet",
}


def readme_commands() -> list[tuple[str, list[str]]]:
    """(command, the output lines the README shows under it) for every fenced command."""
    found, lang, block = [], None, None
    for line in (ROOT / "README.md").read_text().splitlines():
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            if block is None:
                lang, block = fence.group(1), []
            else:
                found.extend(_commands(lang, block))
                block = None
            continue
        if block is not None:
            block.append(line)
    return found


def _commands(lang: str, lines: list[str]) -> list[tuple[str, list[str]]]:
    if lang in ("bash", "sh"):
        text = re.sub(r"\\\n\s*", " ", "\n".join(lines))
        text = re.sub(r"\bdo\n", "do ", re.sub(r"\n(\s*done)", r"; \1", text))  # one loop, one command
        return [(ln.strip(), []) for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    out = []
    for ln in lines:
        if ln.startswith("$ "):
            out.append((ln[2:].strip(), []))
        elif out and ln.strip():
            out[-1][1].append(ln)
    return out


def _reason(cmd: str):
    return next((why for pattern, why in NOT_RUN.items() if re.search(pattern, cmd)), None)


def _run(cmd: str, cwd: pathlib.Path, env: dict) -> subprocess.CompletedProcess:
    line = re.sub(r"^python train\.py", f"{sys.executable} {ROOT / 'train.py'}", cmd)
    line = re.sub(r"^python ", f"{sys.executable} ", line)
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_every_readme_command_runs_or_is_skipped_for_a_reason(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "ZOO_TRACEBACK")}  # a default CPU
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "jax_cache")  # shared by the commands
    to_run, unclassified = [], []
    for cmd, shown in readme_commands():
        shown_error = next((ln for ln in shown if ln.startswith("error: ")), None)
        if shown_error and not re.search(r"checkpoint\.dir|distributed\.|plan\.hbm_budget_gb", cmd):
            to_run.append((cmd, shown_error))
        elif _reason(cmd) is None:
            unclassified.append(cmd)
    assert not unclassified, f"README commands neither run by this test nor on NOT_RUN: {unclassified}"
    assert len(to_run) >= 5

    def check(item):
        cmd, shown_error = item
        p = _run(cmd, tmp_path, env)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        expected = shown_error.split("...")[0].rstrip()
        ok = p.returncode == 2 and len(lines) == 1 and lines[0].startswith(expected)
        return None if ok else f"$ {cmd}\n  README: {shown_error}\n  got (exit {p.returncode}): {p.stderr[-500:]}"

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(check, to_run) if f]
    assert not failures, "\n".join(failures)
