"""train.py's memory settings through the real command line: trainer.loss_chunk_size is a key of the
trainer group, and an attention implementation this backend cannot run or a bad chunk size stops
with one line before compiling."""

import json
import pathlib
import sys

import in_process
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = [
    "model=llama_tiny_a",
    "mesh=single",
    "data.batch_size=2",
    "data.seq_len=16",
    "trainer.steps=1",
    "trainer.progress=false",
]


def _train(args, tmp_path, capfd, monkeypatch):
    """train.py's command in the module's in-process run (tests/in_process.py), JAX started with conftest.py's
    flags, as the command starts it."""
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, *args, f"hydra.run.dir={tmp_path / 'run'}"]
    return in_process.run(cmd, tmp_path, capfd, monkeypatch)


@in_process.MARK
@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["model.attention_impl=cudnn"],
            "error: model.attention_impl: cudnn needs a GPU (backend is cpu); valid choices: auto, xla, blockwise, "
            "cudnn, splash",
        ),
        (
            ["trainer.loss_chunk_size=-3"],
            "error: trainer.loss_chunk_size: must be >= 0 (sequence positions per chunk, any size, or 0 for the whole",
        ),
    ],
)
def test_bad_kernel_settings_are_one_line_before_compiling(args, message, tmp_path, request, capfd, monkeypatch):
    if not in_process.INNER:
        return in_process.outcome(request)
    p = _train(args, tmp_path, capfd, monkeypatch)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith(message) and ";" in lines[0], lines[0]
    assert "compil" not in p.stdout


@in_process.MARK
def test_loss_chunk_size_from_the_command_line(tmp_path, request, capfd, monkeypatch):
    if not in_process.INNER:
        return in_process.outcome(request)
    p = _train(["trainer.loss_chunk_size=8"], tmp_path, capfd, monkeypatch)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "loss over chunks of 8 positions" in p.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["kernels"]["loss_chunk_size"] == 8


def test_inspect_unwritable_output_is_one_line_before_compiling(capsys):
    from zoo.tools.inspect_step import main

    assert main(["model=llama_tiny_a", "mesh=single", "inspect.out=/proc/zoo/inspect.json"]) == 2
    captured = capsys.readouterr()
    assert (
        captured.err.strip().startswith("error: inspect.out: cannot write /proc/zoo")
        and len(captured.err.strip().splitlines()) == 1
    )
    assert "compiled" not in captured.out


def test_inspect_writes_under_outputs_by_default(tmp_path, monkeypatch, capsys):
    from zoo.tools.inspect_step import main

    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                "model=llama_tiny_a",
                "mesh=single",
                "data.batch_size=2",
                "data.seq_len=16",
                "offload=[full,optimizer_host]",
            ]
        )
        == 0
    )
    written = list(tmp_path.glob("outputs/inspect/*/inspect.json"))
    assert len(written) == 1 and f"wrote {written[0].relative_to(tmp_path)}" in capsys.readouterr().out
    rep = json.loads(written[0].read_text())
    assert (
        rep["kernels"]["loss_chunk_size"] == 512 and rep["update"]["streamed"] and rep["update"]["layer_loops"] == 3
    )  # moments only: the stack, and the embedding and head in runs of rows (each larger than a layer slice)
    assert not (tmp_path / "inspect.json").exists()
