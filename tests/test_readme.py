"""The commands of README.md and docs/*.md, run as documented on a default CPU (one device, no
XLA_FLAGS), so the docs cannot drift from the code; and their Python snippets, each run as a script
(on one device, with conftest.py's compile flags: nothing they print is compared).

Every command in a fenced block (`$ cmd` lines, also in indented blocks, and the lines of ```bash
blocks) is run here or is on `NOT_RUN` (or `RUN_ELSEWHERE`, by page) with the reason; a command
that is neither fails `test_every_doc_command_is_run_or_skipped_for_a_reason`, so pages and sections
added later are picked up. A README command that a page of docs/ shows too (the README's tour) runs
once, with the page's copy, and is held to the lines both show.

- A `$ cmd` line whose shown output holds a bad-input `error: ...` line (and that no group below
  runs) is run by `test_bad_input_commands_print_the_shown_error_line`: it must print that one line
  (up to a `...` where the docs elide) and exit 2.
- Every other command belongs to one of `GROUPS`; a group's commands run in page order in one
  directory that looks like the repository's root (train then resume, sweep then report), two groups
  at a time, one test per group. Each must exit 0 (2 where its output shows a bad-input `error:`
  line; what `EXIT` or a signal says otherwise), print no traceback, end any training run with a
  lower loss than it started with (its `loss A -> B` line), and print the *figures* the docs show
  under it: the shown lines that `FIGURE` matches (losses, step lines, error and note lines, the
  planner's estimates and choices, the inspector's placements and totals, the scale report, the
  sampled text), in the shown order, other lines allowed in between. Other shown lines (banners,
  timings, paths) are illustration: editing them, or the prose around, changes no check.
  Numbers followed by a unit of time or speed (`s`, `ms`, `tok/s`, `TFLOP/s`, `%`, `GB/s`) are not
  compared; other floats must agree within `RTOL` (losses are deterministic on one machine; other
  CPUs round differently), integers exactly; a path is compared by its last component, digits
  aside (dates, temporary directories).
- A shown `^C` means Ctrl-C: SIGINT goes to the command once it printed the shown line before the
  `^C`; a shown `stopped by SIGTERM` line, likewise SIGTERM. From that line on, numbers are not
  compared (where a signal lands varies).

What the test changes in a command: `python` and `python3` are this interpreter, its virtual environment
included (tests/this_python.py); absolute `/tmp/` paths are taken
inside the group's directory; the two-process example gets a free port instead of 12355; the report
of a sweep is given the directory the sweep wrote in place of `multirun/<date>/<time>`.
"""

import concurrent.futures
import functools
import json
import math
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import this_python

ROOT = pathlib.Path(__file__).resolve().parents[1]
RTOL = 5e-3
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

# Commands not run here, by a pattern they match, with why. Keep reasons specific.
NOT_RUN = {
    r"^pip install": (
        "installs packages (CI installs the project; the quickstart's `python train.py` runs as the `$ python "
        "train.py` block)"
    ),
    r"python -m pytest": "the test suite itself",
    r"^srun |scontrol requeue": "needs a SLURM cluster",
    r"hydra/launcher=slurm": "needs a SLURM cluster (tests/test_distributed.py composes the launcher config)",
    r"hydra/launcher=joblib": "needs the hydra-joblib-launcher plugin, which the project does not install",
    r"data\.path=(books\.jsonl|corpus/|pairs\.jsonl)": (
        "placeholder paths for the user's own text (the `$HOME/notes/` line runs, on a copy of the shipped text)"
    ),
    r"<train\.py overrides>": "a placeholder, not a command",
    r"^python bench/tpu\.py --(setups|out)": (
        "needs a TPU (tests/test_bench.py runs its --toy form in the slow tier and renders the recorded "
        "docs/bench_tpu.json)"
    ),
    r"^python bench/tpu\.py --render docs/bench_tpu\.json --replan": (
        "re-plans all 27 recorded runs (minutes); tests/test_bench.py renders the record, tests/test_plan.py "
        "plans a TPU profile off the chip"
    ),
    r"^ruff check": ".ci/run runs it before the tests",
    r"hardware=tpu_v5e .*plan\.measure=\d": (
        "compiles nine policies for a TPU v5e and times those that fit on the chip (tests/test_plan_check.py "
        "runs plan.compile and plan.measure at tiny size on CPU)"
    ),
    r"offload=minimal_context_offloaded xla=tpu_host_offload": (
        "sized for a TPU v5e (3 x 8192 on llama_1b's layers); the preset runs on every tiny family in "
        "tests/test_offload.py"
    ),
    (
        r"^python -m zoo\.tools\.inspect_step model=llama_1b hardware=h100_pcie data\.batch_size=2 "
        r"data\.seq_len=4096 'hydra\.searchpath=\[file:///<plan dir>\]' offload=planned$"
    ): (
        "a recorded run of an earlier plan (`<plan dir>` is a placeholder), and a llama_1b step at 2 x 4096 compiles "
        "for "
        "many minutes on CPU; tests/test_plan.py runs plan -> YAML -> inspector at tiny size"
    ),
    r"bench/gpu\.py(?! --plan-only)|bench/gpu_wheels\.sh": (
        "the GPU benchmark: needs a GPU (tests/test_bench.py runs `--toy` on CPU, slow tier)"
    ),
    r"^XLA_FLAGS= python bench/cpu\.py|bench/cpu\.py --models": (
        "the CPU benchmark at full size (7 min; tests/test_bench.py runs --quick, slow tier)"
    ),
    r"bench/peer\.py|^python3 -m venv /tmp/torchpeer": (
        "the PyTorch comparison: needs torch in another Python and 14 min (tests/test_peer.py checks its parts)"
    ),
    r"bench/peer_maxtext\.py|bench/(tpu|maxtext)_(wheels|setup)\.sh": (
        "Zoo beside MaxText: needs a TPU, MaxText and its wheels (tests/test_peer_maxtext.py renders the record, "
        "checks the docs' tables and figures against it, and the script's bad input)"
    ),
    r"bench/sampling\.py": (
        "Zoo's sampling against transformers' generate: needs torch and transformers and about 9 min "
        "(tests/test_bench.py runs --small, slow tier)"
    ),
    r"bench/moe_metrics\.py": (
        "a timing A/B of the MoE metrics, 40 rounds of step pairs (tests/test_moe_metrics.py checks the "
        "metrics and the switch it times)"
    ),
    r"tests/make_fixtures\.py": (
        "writes transformers fixtures: needs torch and transformers, the hf extra (tests/test_hf_families.py "
        "checks the fixtures it wrote)"
    ),
    (
        r"model=hf model\.path=tests/data/llama_tiny_a data=text"
        r"|^python -m zoo\.tools\.(export |generate checkpoint\.dir=)outputs/finetune"
    ): "the fine-tuning walk-through: tests/test_hf_train.py runs its bash block as written and checks what it wrote",
}

# Whole pages whose commands another test runs as written.
RUN_ELSEWHERE = {
    "docs/scale.md": (
        "the 128-device scale reports and planner runs: tests/test_scale_doc.py runs them as written and "
        "checks the quoted figures (slow tier)"
    ),
}

# Python snippets another test runs (by page), with the test; every other ```python block runs here.
PYTHON_ELSEWHERE = {
    "docs/sampling.md": "tests/test_generate.py::test_the_readme_python_example_runs (checks what it printed)",
}

# Commands run here: group -> patterns of its commands; a group's commands run in page order in one directory.
GROUPS = {
    "quickstart": [r"^python train\.py$"],
    "offload_composition": [
        r"^python train\.py (model=llama_tiny_a )?'?offload=\[?(llama_qkv_offload|full,params_host)"
    ],
    "custom_policy": [r"^python train\.py model=dsv3_tiny_a offload=custom offload\.tags\.query_proj=offload"],
    "offload_ranges": [
        r"^python train\.py model=llama_tiny_a mesh=single trainer\.steps=10 offload=full '\+offload\.ranges="
    ],
    "xla_sweep_loop": [r"^for x in default latency_hiding", r"^python -m zoo\.tools\.report multirun/xla$"],
    "sweep_and_report": [
        r"^python train\.py -m model=llama_tiny_a trainer\.steps=20 offload=none,full",
        r"^python -m zoo\.tools\.report multirun/<date>/<time>",
    ],
    "checkpoint_ctrl_c_and_resume": [r"checkpoint\.dir=ckpt/run1"],
    "scale_report_671b": [r"model=deepseek_v3_671b xla\.cpu_devices=128"],
    "sampling": [r"^python -m zoo\.tools\.generate model\.path=tests/data/llama_tiny_a tokenizer=bytes prompt=\"To be"],
    "inspector": [r"^python -m zoo\.tools\.inspect_step model=(dsv3|llama)_tiny_a mesh=single"],
    "two_processes": [r"distributed\.coordinator_address=127\.0\.0\.1:12355"],
    "own_text_home": [r"^python train\.py data=text data\.path=\$HOME/notes/"],
    "gpu_plan_only": [r"bench/gpu\.py --plan-only"],
    "text_with_eval": [
        r"^python train\.py data=text model=llama_tiny_a mesh=single trainer\.steps=20 data\.eval_fraction"
    ],
    "preemption": [r"checkpoint\.dir=/tmp/loop/ck4", r"^echo \$\?$"],
    "planner": [
        r"^python -m zoo\.tools\.plan model=llama_1b",
        r"^python -m zoo\.tools\.plan model=gemma3_tiny_a .*plan\.split=true",
        r"^python -m zoo\.tools\.plan model=llama_tiny_a .*plan\.measure=2$",
    ],
    "measure_hardware": [r"^python -m zoo\.tools\.measure_hardware"],
    "divergence": [r"optimizer\.lr=1e30"],
    "lora_peft": [
        r"^python train\.py data=text lora=default model=hf .*hydra\.run\.dir=outputs/lora$",
        r"^python -m zoo\.tools\.export outputs/lora/",
        r"^python -c \"import torch; from peft import",
        r"^python -m zoo\.tools\.generate checkpoint\.dir=outputs/lora/checkpoints checkpoint\.lora=attached",
    ],
    "lora_finetune": [
        r"^python train\.py data=text lora=default lora\.base_on_host=true model=hf",
        r"^python -m zoo\.tools\.plan model=llama3\.1_70b .*lora=default",
    ],
    "moe_routing": [
        r"trainer\.moe_imbalance_warn=1\.5 hydra\.run\.dir=outputs/moe$",
        r"^python -m zoo\.tools\.report outputs/moe$",
    ],
    # The recorded ~100M runs (docs/models.md), 26-37 s each on the quiet 2-core machine: two per group, so they spread.
    "recorded_100m_qwen": [r"^python train\.py model=(qwen2|qwen3)_100m mesh=single"],
    "recorded_100m_gemma3_qwen3_moe": [r"^python train\.py model=(gemma3|qwen3_moe)_100m mesh=single"],
    "recorded_100m_mixtral_gpt_oss": [r"^python train\.py model=(mixtral|gpt_oss)_100m mesh=single"],
}

EXIT = {r"optimizer\.lr=1e30": 1}  # a diverged run: one error line, exit code 1 (bad input is 2)

# The shown lines a command is held to: the figures that say it did what the docs claim. Everything
# else shown under a command is illustration and may differ (or be edited) freely.
FIGURE = re.compile(
    r"^(error: |note: checkpoint|lora: rank |loss \S+ -> |step \d+/\d+ loss |checkpoints: |stopped by |estimated "
    r"|counted: |compiled by XLA |"
    r"scale: |per device: |tags on host |update: |policy |model \w+ \(|wrote |exported |peft: |cpu: matmul |split: |"
    r"[a-z][a-z0-9_]*\s+(dense_layers|moe_layers|layers)(\[\d+-\d+\])?\s|[a-z][a-z0-9_]*\s+[\d.]+ [kMG]?B\s|\| \w+ "
    r"\(\w+\) \||"
    r"  layers \d+-\d+ \()"
)


# --- the docs' commands and what they show under them ---------------------------------------------------


def doc_commands() -> list[tuple[str, str, list[str]]]:
    """(page, command, the output lines shown under it) for every fenced command of every page; a
    README command that a docs page shows too is left to the page, which gets the README's lines."""
    found = [(page, cmd, shown) for page in DOCS for cmd, shown in _page_commands(ROOT / page)]
    in_docs = {}
    for page, cmd, shown in found:
        if page != "README.md":
            in_docs.setdefault(cmd, shown)
    out = []
    for page, cmd, shown in found:
        if page == "README.md" and cmd in in_docs:
            in_docs[cmd].extend(ln for ln in shown if is_figure(cmd, ln) and ln not in in_docs[cmd])
            continue
        out.append((page, cmd, shown))
    return out


def _page_commands(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    found, lang, block, indent, last_bash = [], None, None, 0, None
    for line in path.read_text().splitlines():
        fence = re.match(r"^(\s*)```(\w*)", line)
        if fence:
            if block is None:
                lang, block, indent = fence.group(2), [], len(fence.group(1))
            else:
                if lang == "" and last_bash is not None and not any(ln.startswith("$ ") for ln in block):
                    last_bash[1][:] = block  # the plain block right after a bash block: what it printed
                    last_bash = None
                else:
                    cmds = _commands(lang, block)
                    found.extend(cmds)
                    last_bash = cmds[-1] if lang in ("bash", "sh") and cmds else None
                block = None
            continue
        if block is not None:
            block.append(line[indent:] if line[:indent].isspace() else line)
        elif line.strip():
            last_bash = None
    return found


def python_snippets() -> list[tuple[str, str]]:
    """(page, code) of every ```python block."""
    return [
        (page, code)
        for page in DOCS
        for code in re.findall(r"^```python\n(.*?)^```", (ROOT / page).read_text(), re.S | re.M)
    ]


def _commands(lang: str, lines: list[str]) -> list[tuple[str, list[str]]]:
    if lang in ("bash", "sh"):
        text = re.sub(r"\\\n\s*", " ", "\n".join(lines))
        text = re.sub(r"(&?)\n(\s*done)", lambda m: (" " if m.group(1) else "; ").join([m.group(1), m.group(2)]), text)
        text = re.sub(r"\bdo\n", "do ", text)  # one loop, one command
        return [(ln.strip(), []) for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    out = []
    for ln in lines:
        if ln.startswith("$ "):
            out.append((ln[2:].strip(), []))
        elif out and ln.strip():
            out[-1][1].append(ln)
    return out


def _reason(page: str, cmd: str):
    return RUN_ELSEWHERE.get(page) or next((why for pattern, why in NOT_RUN.items() if re.search(pattern, cmd)), None)


def _group(page: str, cmd: str):
    if page in RUN_ELSEWHERE:
        return None
    return next((name for name, patterns in GROUPS.items() if any(re.search(p, cmd) for p in patterns)), None)


def _bad_input(page: str, cmd: str, shown: list[str]):
    """The shown bad-input error line of a command no group runs, else None."""
    err = next((ln for ln in shown if ln.startswith("error: ")), None)
    return err if err and _group(page, cmd) is None and _reason(page, cmd) is None else None


# --- comparing output with what the README shows ----------------------------------------------------------

HOST_MEMORY = "host memory: "  # zoo.train.huge_pages.describe's line: the machine's, like a timing
_NUM = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")
_UNIT = re.compile(r"^(tok/s|TFLOP/s|ms\b|GB/s|MB/s)")


def _pathlike(tok: str) -> bool:
    return (
        "/" in tok
        and not _UNIT.match(tok)
        and not re.fullmatch(r"[\d/]+,?", tok)
        and not re.search(r"\d(tok|TFLOP|GB)/s", tok)
    )


def _tokens_match(shown: str, actual: str, tok_next: str, loose: bool) -> bool:
    if _pathlike(shown):
        base = lambda t: re.sub(r"\d+", "0", t.rstrip("/").rsplit("/", 1)[-1])  # noqa: E731
        return _pathlike(actual) and base(shown) == base(actual)
    s_parts, a_parts = _NUM.split(shown), _NUM.split(actual)
    s_nums, a_nums = _NUM.findall(shown), _NUM.findall(actual)
    if s_parts != a_parts or len(s_nums) != len(a_nums):
        return False
    for i, (s, a) in enumerate(zip(s_nums, a_nums)):
        after = s_parts[i + 1]
        timing = re.match(r"^(s\b|s$|%)", after) or (after == "" and _UNIT.match(tok_next))
        if loose or timing:
            continue
        if re.fullmatch(r"\d+", s) and re.fullmatch(r"\d+", a):
            if s != a:
                return False
        elif not math.isclose(float(s), float(a), rel_tol=RTOL, abs_tol=1e-12):
            return False
    return True


def match_line(shown: str, actual: str, loose: bool = False) -> bool:
    """Whether an output line is the shown one: text equal, numbers as the module docstring says."""
    if shown.startswith(HOST_MEMORY):
        return actual.startswith(HOST_MEMORY)
    s, a = shown.split(), actual.split()

    @functools.lru_cache(maxsize=None)
    def m(i: int, j: int) -> bool:
        if i == len(s):
            return j == len(a)
        if s[i] == "...":
            return any(m(i + 1, k) for k in range(j, len(a) + 1))
        nxt = s[i + 1] if i + 1 < len(s) else ""
        return j < len(a) and _tokens_match(s[i], a[j], nxt, loose) and m(i + 1, j + 1)

    return m(0, 0)


def match_block(shown: list[str], out: list[str], loose_from: int | None = None) -> str | None:
    """None if the shown lines are consecutive output lines (`...` lines: any number of lines), else the
    first shown line not found in order. Lines from index `loose_from` on are compared loosely."""
    shown = [ln for ln in shown if ln.strip() != "^C"]
    loose = lambda i: loose_from is not None and i >= loose_from  # noqa: E731

    @functools.lru_cache(maxsize=None)
    def m(i: int, j: int) -> bool:
        if i == len(shown):
            return True
        if shown[i].strip() == "...":
            return any(m(i + 1, k) for k in range(j, len(out) + 1))
        return j < len(out) and match_line(shown[i], out[j], loose(i)) and m(i + 1, j + 1)

    if any(m(0, j) for j in range(len(out) + 1)):
        return None
    j, gap = 0, True
    for i, line in enumerate(shown):  # greedy, for the message
        if line.strip() == "...":
            gap = True
            continue
        k = next((k for k in range(j, len(out)) if match_line(line, out[k], loose(i))), None)
        if k is None:
            return line
        if not gap and k > j:
            return f"{line} (printed, but after a line the README neither shows nor elides with ...: {out[j]})"
        j, gap = k + 1, False
    return "(every line is there, but not as consecutive lines)"


def is_figure(cmd: str, line: str) -> bool:
    """Whether a shown line is one the command is held to: a `FIGURE`, or the text sampled from a prompt."""
    prompt = re.search(r'prompt="([^"$]+)"', cmd)
    return bool(FIGURE.match(line)) or bool(prompt and line.startswith(prompt.group(1)))


def figures_found(
    shown: list[str], out: list[str], loose_from: int | None = None, cmd: str = "", streams: list[str] | None = None
) -> str | None:
    """None if every figure line of `shown` is an output line, in the shown order (other lines may
    come between), else the first one missing. Shown lines from index `loose_from` on compare loosely.
    With `streams` (each output line's stream), the order is held within each stream only: a reader
    of two pipes sees lines written to both within an instant in either order."""
    streams = streams or ["out"] * len(out)
    after = dict.fromkeys(streams, 0)  # per stream: the first output line a later figure may match
    for i, line in enumerate(shown):
        if not is_figure(cmd, line):
            continue
        loose = loose_from is not None and i >= loose_from
        k = next((k for k in range(len(out)) if k >= after[streams[k]] and match_line(line, out[k], loose)), None)
        if k is None:
            return line
        after[streams[k]] = k + 1
    return None


def _loss_rose(out: list[str]) -> str | None:
    for ln in out:
        m = re.match(r"^loss (\S+) -> (\S+?)[ ,;(]", ln)
        if m and not float(m.group(2)) < float(m.group(1)):
            return ln
    return None


def test_the_output_comparison_can_fail():
    shown = [
        "step 1/100 loss 6.0619 gnorm 1.829 lr 0.00e+00 2329 tok/s 0.002 TFLOP/s/dev MFU 1.85%",
        "init 7.0s, compile 14.4s",
        "...",
        "wrote outputs/x/2026-12-01_22-59-20/inspect.json",
    ]
    ok = [
        "junk",
        "step 1/100 loss 6.0620 gnorm 1.829 lr 0.00e+00 999 tok/s 0.009 TFLOP/s/dev MFU 9.99%",
        "a",
        "wrote outputs/x/2027-01-02_03-04-05/inspect.json",
    ]
    assert figures_found(shown, ok) is None  # the init line is illustration, the others are found in order
    assert figures_found(shown, [ok[1].replace("6.0620", "6.2"), ok[3]]) is not None  # loss off by 2%
    assert figures_found(shown, [ok[1].replace("1/100", "2/100"), ok[3]]) is not None
    assert figures_found(shown, [ok[1], ok[3].replace("inspect.json", "plan.json")]) is not None
    assert figures_found(shown, [ok[3], ok[1]]) is not None  # out of order
    assert figures_found(shown, [ok[3], ok[1]], streams=["stdout", "stdout"]) is not None  # out of order in one stream
    assert figures_found(shown, [ok[3], ok[1]], streams=["stderr", "stdout"]) is None  # two pipes: read in either order
    assert (
        figures_found(
            ["error: offload: unknown option 'fastest'; choose one of custom, ..."],
            ["error: offload: unknown option 'fast'; choose one of custom"],
        )
        is not None
    )
    plan = "mlpwi_1              2.147 GB     11.635 ms  67.429 ms     remat"
    assert (
        FIGURE.match(plan) and figures_found([plan], [plan.replace("remat", "offload")]) is not None
    )  # the planner's verdict
    row = "moe_mlpwi_0          moe_layers    8x10x32      float32  10.24 kB     2       20.48 kB  offload     host"
    assert (
        FIGURE.match(row) and figures_found([row], [row.replace("host", "recomputed")]) is not None
    )  # the inspector's
    assert match_line("choose one of custom, ...", "choose one of custom, full, none")
    assert match_line("init 7.0s, compile 14.4s", "init 2.0s, compile 3.0s")
    assert not match_line("(0.21M params, 0.13M active)", "(0.25M params, 0.13M active)")
    assert _loss_rose(["loss 6.0619 -> 2.1504 (floor 1.074); step 24.4 ms"]) is None
    assert _loss_rose(["loss 6.0619 -> 6.1504 (floor 1.074); step 24.4 ms"]) is not None
    sample = 'python -m zoo.tools.generate model.path=x prompt="To be" max_new_tokens=3'
    assert figures_found(["To be, or"], ["To be, or not"], cmd=sample) is not None  # the sampled text
    assert figures_found(["To be, or"], ["To be, or"], cmd=sample) is None


# --- running a group ---------------------------------------------------------------------------------------


def _env(workdir: pathlib.Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "ZOO_TRACEBACK")}  # a default CPU
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr interleaved as a terminal shows them
    # conftest.py's compilation cache, shared by every command (and the rest of the suite)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(workdir.parent / "jax_cache"))
    return this_python.on_path(env, workdir / ".bin")  # `python` and `python3`: this interpreter, venv and all


def test_doc_commands_run_on_the_tests_interpreter(tmp_path):
    """`python` and `python3` in a documented command are the interpreter running the tests, in a virtual
    environment too (where a link to it would start the base interpreter, without the environment's packages):
    from a fresh environment's interpreter, the commands' sys.prefix is the environment's."""
    venv = tmp_path / "venv"
    # --system-site-packages: the environment sees pytest, which importing this file needs; its prefix is its own
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    probe = "; ".join(f'{name} -c "import sys; print(sys.prefix)"' for name in ("python", "python3"))
    child = (
        "import os, pathlib, subprocess, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "import test_readme\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "d.mkdir()\n"
        f"print(subprocess.run(['bash', '-c', {probe!r}], env=test_readme._env(d), capture_output=True, text=True,"
        " check=True).stdout, end='')\n"
    )
    cases = [(sys.executable, sys.prefix), (str(venv / "bin" / "python"), str(venv))]
    for i, (python, prefix) in enumerate(cases):
        p = subprocess.run([python, "-c", child, str(tmp_path / f"d{i}")], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        assert [os.path.realpath(x) for x in p.stdout.split()] == [os.path.realpath(prefix)] * 2, (python, p.stdout)


def workdir(base: pathlib.Path) -> pathlib.Path:
    """A directory that looks like the repository's root to the README's commands."""
    d = base / "repo"
    d.mkdir(parents=True)
    for name in ("train.py", "conf", "zoo", "tests", "bench"):
        (d / name).symlink_to(ROOT / name)
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_shell(line: str, cwd: pathlib.Path, env: dict, *, signal_after=None, timeout: float = 600):
    """(exit code, output lines, seconds): stdout and stderr interleaved as they came, each line tagged
    with its stream; `signal_after=(shown line, signal)` sends the signal to the command's process
    group once an output line matches that line."""
    line = re.sub(r"(?<![\w/.])/tmp/", f"{cwd}/tmp/", line)
    p = subprocess.Popen(
        ["bash", "-c", line],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    watchdog = threading.Timer(timeout, lambda: os.killpg(p.pid, signal.SIGKILL))
    watchdog.start()
    t0, lines, lock = time.perf_counter(), [], threading.Lock()
    pending = [signal_after]

    def pump(stream, name):
        for out in stream:
            with lock:
                lines.append((name, out.rstrip("\n")))
                if pending[0] and match_line(pending[0][0], lines[-1][1]):
                    os.killpg(p.pid, pending[0][1])
                    pending[0] = None

    readers = [threading.Thread(target=pump, args=(s, n)) for s, n in ((p.stdout, "stdout"), (p.stderr, "stderr"))]
    try:
        for r in readers:
            r.start()
        for r in readers:
            r.join()
        rc = p.wait()
    finally:
        watchdog.cancel()
    return rc, lines, time.perf_counter() - t0


def _signal_for(shown: list[str]):
    """(index of the line after which the README's run was stopped, signal, exit code) or None."""
    for i, ln in enumerate(shown):
        if ln.strip() == "^C":
            return i - 1, signal.SIGINT, 130  # a Ctrl-C, wherever it lands: exit code 130
        stop = re.match(r"stopped by (SIG\w+) .*\(exit code (\d+)\)", ln)
        if stop:
            return i - 1, getattr(signal, stop.group(1)), int(stop.group(2))
    return None


def run_group(name: str, base: pathlib.Path) -> tuple[list[str], float]:
    """Runs the group's commands in page order; returns (failures, seconds)."""
    d = workdir(base)
    env = _env(d)
    if name == "own_text_home":  # the user's notes: the shipped plays, in a home directory of the test's own
        env["HOME"] = str(d / "home")
        shutil.copytree(ROOT / "zoo" / "data" / "corpus" / "shakespeare", d / "home" / "notes")
    failures, t0, last_rc = [], time.perf_counter(), None
    cmds = [(c, s) for p, c, s in doc_commands() if _group(p, c) == name]
    if not cmds:
        return [f"no command of the docs belongs to group {name}"], 0.0
    for cmd, shown in cmds:
        line = cmd
        if cmd == "echo $?":
            if shown != [str(last_rc)]:
                failures.append(f"$ {cmd}: the docs show {shown}, the command before exited {last_rc}")
            continue
        if "multirun/<date>/<time>" in cmd:
            runs = sorted(p for p in (d / "multirun").glob("*/*") if p.name != "xla")
            assert len(runs) == 1, runs
            line = cmd.replace("multirun/<date>/<time>", str(runs[0].relative_to(d)))
        line = line.replace("127.0.0.1:12355", f"127.0.0.1:{_free_port()}")
        stop = _signal_for(shown)
        err = any(ln.startswith("error: ") for ln in shown)
        want = stop[2] if stop else next((c for p, c in EXIT.items() if re.search(p, cmd)), 2 if err else 0)
        rc, out, secs = run_shell(line, d, env, signal_after=(shown[stop[0]], stop[1]) if stop else None)
        streams = [name for name, ln in out if ln.strip()]
        out = [ln for _, ln in out if ln.strip()]
        last_rc = rc
        text = "\n".join(out[-40:])
        if rc != want:
            failures.append(f"$ {cmd}\n  exit {rc}, the docs imply {want}; output ends:\n{text}")
            continue
        if any(ln.startswith("Traceback") for ln in out) or (not err and any(ln.startswith("error:") for ln in out)):
            failures.append(f"$ {cmd}\n  printed an error:\n{text}")
        rose = _loss_rose(out)
        if rose:
            failures.append(f"$ {cmd}\n  the loss did not fall: {rose}")
        missing = figures_found(
            [ln for ln in shown if ln.strip() != "^C"], out, stop[0] if stop else None, cmd, streams
        )
        if missing is not None:
            failures.append(
                f"$ {cmd}\n  a figure the docs show was not printed (in order): {missing}\n  output ends:\n{text}"
            )
        _after(name, cmd, out, d, env, failures)
    return failures, time.perf_counter() - t0


def _losses(out: list[str]) -> list[str]:
    return re.findall(r"^step \d+/\d+ loss (\S+) gnorm (\S+)", "\n".join(out), re.M)


_SEEN: dict = {}


def _after(name: str, cmd: str, out: list[str], d: pathlib.Path, env: dict, failures: list[str]) -> None:
    """What a group checks beyond the shown figures: the docs' claims about these runs."""
    readme = (ROOT / "docs" / "training.md").read_text()
    if name == "offload_composition":
        # "Hydra merges the two ... the same config": the two spellings train identically.
        if not _losses(out):
            failures.append(f"$ {cmd}\n  printed no training step")
        elif "llama_qkv_offload" in cmd:
            seen = _SEEN.setdefault(d, [])
            if seen and seen[0] != _losses(out):
                failures.append(
                    f"$ {cmd}\n  is documented as the same config as the line above it, but its losses differ"
                )
            seen.append(_losses(out))
    if name == "preemption" and "ck4" in cmd:
        # "The same command run again resumed from step N and ended at the uninterrupted run's loss, X at step S"
        claim = re.search(
            r"same command run again resumed from step \d+ and ended at the uninterrupted run's loss, ([\d.]+)\s+at "
            r"step (\d+)",
            readme,
        )
        if claim is None:
            failures.append("docs/training.md no longer states where the resumed run ends; update this test")
            return
        rc, again, _ = run_shell(cmd, d, env)
        again = [ln for _, ln in again]
        last = next((ln for ln in again if ln.startswith(f"step {claim.group(2)}/")), "")
        if rc != 0 or not match_line(f"step {claim.group(2)}/{claim.group(2)} loss {claim.group(1)} ...", last):
            failures.append(
                f"$ {cmd} (again)\n  exit {rc}, expected to resume and end at loss {claim.group(1)}:\n"
                + "\n".join(again[-10:])
            )
    if name == "two_processes":
        summary = json.loads((d / "outputs" / "two" / "summary.json").read_text())
        if (summary["status"], summary["num_devices"], summary["config"]["distributed"]["num_processes"]) != (
            "ok",
            4,
            2,
        ):
            failures.append(f"$ {cmd}\n  summary.json: status {summary['status']}, {summary['num_devices']} devices")
    if name == "sweep_and_report" and cmd.startswith("python train.py -m"):
        jobs = sorted((d / "multirun").glob("*/*/*/summary.json"))
        statuses = [json.loads(p.read_text())["status"] for p in jobs]
        if statuses != ["ok"] * 3:
            failures.append(f"$ {cmd}\n  job statuses {statuses}, expected three ok")
    if (
        name == "moe_routing"
        and "zoo.tools.report" in cmd
        and not (d / "outputs" / "moe" / "expert_load.png").is_file()
    ):
        failures.append(f"$ {cmd}\n  wrote no outputs/moe/expert_load.png")
    if (
        "zoo.tools.report" in cmd and "multirun" in cmd
    ):  # a sweep's report (a run directory gets expert_load.png, above)
        table = next(d.glob("multirun/**/report.md"), None)
        rows = [ln for ln in table.read_text().splitlines() if ln.startswith("| ")] if table else []
        if len(rows) < 2 + 3:
            failures.append(f"$ {cmd}\n  report.md holds {len(rows) - 2} job rows, expected 3")
    if name == "scale_report_671b" and not any(ln.startswith("scale: 128 devices (fsdp 16 x expert 8)") for ln in out):
        failures.append(f"$ {cmd}\n  printed no 128-device scale report")


# --- the tests -----------------------------------------------------------------------------------------------


def test_every_doc_command_is_run_or_skipped_for_a_reason():
    commands = doc_commands()
    unclassified = [
        (p, c) for p, c, s in commands if _group(p, c) is None and _reason(p, c) is None and not _bad_input(p, c, s)
    ]
    assert not unclassified, f"commands of the docs neither run by this test nor on NOT_RUN: {unclassified}"
    both = [(p, c) for p, c, _ in commands if _group(p, c) and _reason(p, c)]
    assert not both, f"commands both run and on NOT_RUN: {both}"
    for name, patterns in GROUPS.items():  # a group whose commands left the docs is stale
        for pat in patterns:
            assert any(re.search(pat, c) for p, c, _ in commands if p not in RUN_ELSEWHERE), (
                f"group {name}: no command matches {pat}"
            )
    assert len([c for p, c, s in commands if _bad_input(p, c, s)]) >= 5
    # every group's command shows a figure, or `_after` or the falling loss checks it
    # (none is held to its exit code alone)
    checked_after = {
        "offload_composition",
        "xla_sweep_loop",
        "sweep_and_report",
        "two_processes",
        "custom_policy",
        "scale_report_671b",
        "own_text_home",
    }
    bare = [
        c
        for p, c, s in commands
        if _group(p, c)
        and _group(p, c) not in checked_after
        and c != "echo $?"
        and not any(is_figure(c, ln) for ln in s)
    ]
    assert not bare, f"commands whose shown output holds no figure this test checks: {bare}"


def test_readme_tour_commands_are_checked_with_the_manuals_copy():
    readme = [c for c, _ in _page_commands(ROOT / "README.md")]
    kept = {c for p, c, _ in doc_commands() if p == "README.md"}
    folded = [c for c in readme if c not in kept]
    assert len(folded) >= 4, folded  # the tour's commands, run once with their docs/ page
    for c in folded:
        assert any(c == d for p, d, _ in doc_commands() if p != "README.md")


@pytest.mark.slow  # ~35 s of processes; each case (one line, exit 2, no file changed): tests/test_bad_input.py
def test_bad_input_commands_print_the_shown_error_line(tmp_path):
    d = workdir(tmp_path)
    env = _env(d)
    to_run = [(c, _bad_input(p, c, s)) for p, c, s in doc_commands() if _bad_input(p, c, s)]

    def check(item):
        cmd, shown_error = item
        line = re.sub(r"(?<![\w/.])/tmp/", f"{d}/tmp/", cmd)
        p = subprocess.run(["bash", "-c", line], cwd=d, env=env, capture_output=True, text=True, timeout=300)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        expected = shown_error.split("...")[0].rstrip()
        ok = p.returncode == 2 and len(lines) == 1 and lines[0].startswith(expected)
        return None if ok else f"$ {cmd}\n  shown: {shown_error}\n  got (exit {p.returncode}): {p.stderr[-500:]}"

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(check, to_run) if f]
    assert not failures, "\n".join(failures)


def _snippet_env(d: pathlib.Path) -> dict:
    """`_env`'s, with conftest.py's compile flags (LLVM's optimisations and XLA:CPU's fusion emitters off) on
    one device: a snippet prints nothing this file compares, so the flags change no check, and its programs
    compile in a third of the CPU time (the four snippets: 75 -> 30 s of CPU)."""
    env = _env(d)
    flags = os.environ.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if not f.startswith("--xla_force_host_platform_device_count="))
    return env


def test_every_python_snippet_runs_as_a_script(tmp_path):
    """Each ```python block of the docs runs on its own (nothing defined elsewhere), from a directory
    that looks like the repository's root, on one device with the suite's compile flags, and exits 0."""
    snippets = [(p, code) for p, code in python_snippets() if p not in PYTHON_ELSEWHERE]
    assert len(snippets) >= 4, snippets
    assert all(any(p == q for q, _ in python_snippets()) for p in PYTHON_ELSEWHERE)
    d = workdir(tmp_path)
    env = _snippet_env(d)

    def check(item):
        i, (page, code) = item
        script = d / f"snippet_{i}.py"
        script.write_text(code)
        p = subprocess.run([sys.executable, script.name], cwd=d, env=env, capture_output=True, text=True, timeout=600)
        return (
            None
            if p.returncode == 0
            else f"{page}, snippet starting {code.splitlines()[0]!r}: exit {p.returncode}\n{p.stderr[-2000:]}"
        )

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(check, enumerate(snippets)) if f]
    assert not failures, "\n\n".join(failures)


@pytest.fixture(scope="module")
def group_runs(request, tmp_path_factory):
    """Starts the selected groups, two at a time, the slow ones (the longest) first, so the short ones
    fill in beside them; each test waits for its own."""
    selected = [
        it.callspec.params["group"]
        for it in request.session.items
        if getattr(it, "originalname", "") == "test_doc_group_runs_and_prints_its_figures" and hasattr(it, "callspec")
    ]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    order = sorted((g for g in GROUPS if g in selected), key=lambda g: g not in SLOW_GROUPS)
    futures = {g: pool.submit(run_group, g, tmp_path_factory.mktemp(g)) for g in order}
    yield futures
    pool.shutdown(wait=True)


# Groups in the slow tier (`python -m pytest -m slow`), each with the default-tier test that checks
# the same behaviour as directly.
SLOW_GROUPS = {
    "recorded_100m_qwen": (
        "tests/test_hf_families.py (every family's tiny size against transformers) and "
        "tests/test_train_sharding.py (the Trainer, the same for every family)"
    ),
    "recorded_100m_gemma3_qwen3_moe": "as recorded_100m_qwen",
    "recorded_100m_mixtral_gpt_oss": "as recorded_100m_qwen",
    "two_processes": "tests/test_distributed.py (two real processes, the one-process losses within 1e-5)",
    "preemption": "tests/test_checkpoint.py::test_sigterm_mid_run_then_the_same_command_resumes_bit_for_bit",
    "scale_report_671b": (
        "tests/test_train_sharding.py (the scale report at small size); at real size tests/test_scale_doc.py (slow)"
    ),
    "lora_peft": (
        "tests/test_lora_peft.py (the PEFT layout against the merged weights, peft over the base in "
        "transformers; slow: train.py -> export -> peft -> generate attached)"
    ),
    "xla_sweep_loop": (
        "tests/test_train_cli.py (the xla group's flags); a sweep's report: "
        "tests/test_train_cli.py::test_sweep_reports_failed_job_and_continues_then_report"
    ),
    "sweep_and_report": (
        "tests/test_train_cli.py::test_sweep_reports_failed_job_and_continues_then_report (a sweep that goes "
        "on past a failed job, then zoo.tools.report's table, Pareto front and plot)"
    ),
    "offload_composition": (
        "tests/test_offload.py::test_hydra_composes_a_policy_plus_optimizer_on_host_in_one_command_line (the "
        "composed preset list) and the quickstart group (train.py end to end)"
    ),
    "own_text_home": (
        "the text_with_eval group (train.py on data=text from a folder) and tests/test_data.py (folder reading "
        "order, packing)"
    ),
    "inspector": (
        "tests/test_inspect.py (the CLI's table and inspect.json, the placements under the presets, the "
        "holders) and tests/test_offload_ranges.py (placement per range)"
    ),
    "planner": (
        "tests/test_plan.py (the CLI in its own process, plan.json, the printed training command) and "
        "tests/test_plan_split.py (the split search and its lines)"
    ),
    "checkpoint_ctrl_c_and_resume": (
        "tests/test_checkpoint.py::test_sigterm_mid_run_then_the_same_command_resumes_bit_for_bit and "
        "tests/test_bad_input.py (Ctrl-C before the first step, a second Ctrl-C during the save)"
    ),
    "offload_ranges": (
        "tests/test_offload_ranges.py::test_train_py_trains_with_ranges_and_records_them (train.py with "
        "ranges, recorded in summary.json)"
    ),
    "measure_hardware": (
        "tests/test_plan.py::test_measure_hardware_writes_a_profile_train_py_accepts (the command, its "
        "profile loaded by train.py) and tests/test_op_rates.py (its op-rate grid)"
    ),
    "divergence": "tests/test_checkpoint.py::test_nan_loss_stops_with_one_line_and_keeps_the_last_good_checkpoint",
    "custom_policy": (
        "tests/test_offload.py::test_hydra_custom_from_the_command_line (this command line's overrides composed as "
        "train.py composes them, the policy resolved), tests/test_offload.py's every preset on dsv3_tiny_a (training "
        "under a policy) and the quickstart group (train.py end to end)"
    ),
    "gpu_plan_only": (
        "tests/test_plan.py (the planner's estimates and its CLI; bench/gpu.py --plan-only is a loop over "
        "zoo.tools.plan's estimate) and tests/test_bench.py::test_gpu_bench_renders_the_recorded_h200_session"
    ),
}


@pytest.mark.parametrize("group", [pytest.param(g, marks=pytest.mark.slow) if g in SLOW_GROUPS else g for g in GROUPS])
def test_doc_group_runs_and_prints_its_figures(group, group_runs):
    failures, secs = group_runs[group].result()
    print(f"{group}: {secs:.1f} s")
    assert not failures, "\n\n".join(failures)
