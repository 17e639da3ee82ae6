"""zoo.data: tokenizers, packing, shuffling, process split, resume, bad input, and learning on the shipped text."""

import json
import pathlib
import re
import sys
import time

import in_process
import numpy as np
import pytest

from zoo.data import BATCH_FIELDS, SHIPPED_CORPUS, ByteTokenizer, DataError, HFTokenizer, check_vocab, load_text
from zoo.data import load_tokenizer, read_corpus, unigram_entropy
from zoo.data.pipeline import num_windows


def numbered_text(n: int, start: int = 0) -> str:
    """Text whose every 8-byte stretch occurs once: windows of >= 8 bytes are unique."""
    return "".join(f"{i:06d}, " for i in range(start, start + n))


def rows(batch: np.ndarray) -> list[bytes]:
    return [r.tobytes() for r in np.asarray(batch)]


def write_hf_tokenizer(path: pathlib.Path, texts, vocab_size=120, eos="<|endoftext|>") -> pathlib.Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]"] + ([eos] if eos else [])
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    )
    tok.save(str(path))
    return path


# --- tokenizers ------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_vocab():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.eos_id == 0
    s = "To be, or not to be — ça va? 🙂"
    ids = tok.encode(s)
    assert ids.dtype == np.int32 and ids.max() < 256 and ids.min() >= 0
    assert list(ids) == list(s.encode("utf-8"))
    assert tok.decode(ids) == s
    check_vocab(tok, 256)
    with pytest.raises(DataError, match=r"^data\.tokenizer: .*model\.vocab_size=128"):
        check_vocab(tok, 128)


def test_hf_tokenizer_matches_tokenizers_library(tmp_path):
    from tokenizers import Tokenizer

    texts = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog"] * 20
    path = write_hf_tokenizer(tmp_path / "tokenizer.json", texts)
    ref = Tokenizer.from_file(str(path))
    for p in (path, tmp_path):  # the file, or the folder that holds it
        tok = load_tokenizer(p)
        assert isinstance(tok, HFTokenizer)
        assert tok.eos_token == "<|endoftext|>" and tok.eos_id == ref.token_to_id("<|endoftext|>")
        assert tok.vocab_size == max(ref.get_vocab().values()) + 1
        got = tok.encode_batch(["the cat sat", "a dog on the log"])
        assert [list(g) for g in got] == [ref.encode("the cat sat").ids, ref.encode("a dog on the log").ids]
        assert tok.decode(got[0]).replace(" ", "") == "thecatsat"
    check_vocab(tok, tok.vocab_size)
    with pytest.raises(
        DataError,
        match=rf"^data\.tokenizer: .*tokenizer\.json has {tok.vocab_size} token ids but model\.vocab_size=10;",
    ):
        check_vocab(tok, 10)


def test_hf_tokenizer_packs_documents_with_its_eos(tmp_path):
    docs = ["the cat sat on the mat", "the dog sat on the log"]
    tok_path = write_hf_tokenizer(tmp_path / "tok.json", docs * 10)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = load_text(corpus, seq_len=4, batch_size=1, tokenizer=tok_path, shuffle=False, vocab_size=1000)
    tok = data.tokenizer
    want = []
    for d in docs:
        want += list(tok.encode(d)) + [tok.eos_id]
    assert list(data.tokens) == want
    assert data.batch(0)["tokens"].tolist() == [want[:4]]


# --- reading and packing ---------------------------------------------------------------------------


def test_folder_reading_order_and_jsonl_field(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_text("second")
    (tmp_path / "a.jsonl").write_text('{"body": "one", "id": 1}\n\n{"body": "", "id": 2}\n{"body": "two", "id": 3}\n')
    (tmp_path / "c.md").write_text("\ufeffthird")  # a byte-order mark is dropped
    (tmp_path / "ignored.csv").write_text("x,y")
    (tmp_path / ".hidden.txt").write_text("hidden")
    c = read_corpus(tmp_path, text_field="body")
    assert [f.name for f in c.files] == ["a.jsonl", "2.txt", "c.md"]
    assert c.documents == ("one", "two", "second", "third")


def test_packing_is_documents_then_separator_cut_into_overlapping_windows(tmp_path):
    (tmp_path / "1.txt").write_text("abcdefg")
    (tmp_path / "2.txt").write_text("hijklmnopq")
    data = load_text(tmp_path, seq_len=4, batch_size=2, shuffle=False)
    stream = b"abcdefg\x00hijklmnopq\x00"
    assert list(data.tokens) == list(stream)
    n = num_windows(len(stream), 4)
    assert n == (len(stream) - 1) // 3 == 6
    got = [data.windows[i] for i in range(n)]
    assert all(len(w) == 4 for w in got)
    # consecutive windows share one id, so every id after the first is a target exactly once
    assert [list(w) for w in got] == [list(stream[3 * i : 3 * i + 4]) for i in range(n)]
    rebuilt = list(got[0]) + [t for w in got[1:] for t in list(w)[1:]]
    assert rebuilt == list(stream[: len(rebuilt)]) and len(stream) - len(rebuilt) < 3
    # unshuffled: batches walk the windows in order, wrapping to the next epoch
    b = [data.batch(s)["tokens"] for s in range(4)]
    assert all(x.dtype == np.int32 and x.shape == (2, 4) for x in b)
    flat = [r for x in b for r in rows(x)]
    assert flat == rows(np.stack(got + got[:2]).astype(np.int32))


def test_shuffle_is_a_fresh_permutation_each_epoch_and_deterministic(tmp_path):
    (tmp_path / "t.txt").write_text(numbered_text(400))
    kw = dict(seq_len=16, batch_size=1)  # one window a step: step s reads element s of the global stream
    data = load_text(tmp_path, seed=3, **kw)
    n = len(data.windows)
    assert n == 3200 // 15  # 400 numbers of 8 bytes and one separator, stride 15
    ordered = rows(np.stack([data.windows[i] for i in range(n)]).astype(np.int32))
    epochs = [[r for s in range(e * n, (e + 1) * n) for r in rows(data.batch(s)["tokens"])] for e in range(2)]
    for e in epochs:
        assert sorted(e) == sorted(ordered)  # each epoch reads every window once
    assert epochs[0] != ordered and epochs[1] != epochs[0]  # shuffled, and differently per epoch
    again = load_text(tmp_path, seed=3, **kw)
    assert all((again.batch(s)["tokens"] == data.batch(s)["tokens"]).all() for s in range(0, 3 * n, 7))
    other = load_text(tmp_path, seed=4, **kw)
    assert not all((other.batch(s)["tokens"] == data.batch(s)["tokens"]).all() for s in range(3))


# --- data parallelism and resumption ---------------------------------------------------------------


def test_two_processes_see_disjoint_data_that_make_up_the_global_batch(tmp_path):
    (tmp_path / "t.txt").write_text(numbered_text(500))
    kw = dict(seq_len=32, batch_size=8, seed=11)
    whole = load_text(tmp_path, **kw)
    procs = [load_text(tmp_path, process_index=p, process_count=2, **kw) for p in range(2)]
    assert all(p.local_batch_size == 4 for p in procs)
    steps = len(whole.windows) // 8  # one epoch
    seen = [[], []]
    for s in range(steps):
        parts = [p.batch(s)["tokens"] for p in procs]
        assert all(x.shape == (4, 32) for x in parts)
        np.testing.assert_array_equal(np.concatenate(parts), whole.batch(s)["tokens"])
        for p in range(2):
            seen[p] += rows(parts[p])
    assert len(set(seen[0])) == len(seen[0]) and len(set(seen[1])) == len(seen[1])
    assert not set(seen[0]) & set(seen[1])
    assert len(seen[0]) + len(seen[1]) == steps * 8 > len(whole.windows) - 8


@pytest.mark.parametrize("process_index", [0, 1])
def test_restart_at_step_k_yields_the_uninterrupted_batches(tmp_path, process_index):
    (tmp_path / "t.txt").write_text(numbered_text(300))
    kw = dict(seq_len=24, batch_size=6, seed=5, process_index=process_index, process_count=2)
    run = load_text(tmp_path, **kw)
    it = run.batches(0)
    uninterrupted = [next(it)["tokens"] for _ in range(40)]  # crosses at least one epoch boundary
    assert run.steps_per_epoch < 40
    for k in (0, 1, 17, 39):
        restarted = load_text(tmp_path, **kw).batches(start_step=k)  # a fresh loader, as after a restart
        for s in range(k, 40):
            np.testing.assert_array_equal(next(restarted)["tokens"], uninterrupted[s])
    np.testing.assert_array_equal(run.batch(23)["tokens"], uninterrupted[23])
    # and the batches are not all alike, so the equality above says something
    assert len({b.tobytes() for b in uninterrupted}) == 40


# --- bad input: one line naming the key and the file -----------------------------------------------


def one_line_error(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(DataError) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert e.value.__cause__ is None or e.value.__suppress_context__
    assert re.search(match, msg), msg
    assert "; " in msg, msg  # the fix follows
    return msg


def test_bad_inputs_raise_one_clear_line(tmp_path):
    kw = dict(seq_len=8, batch_size=2)
    missing = tmp_path / "nope"
    one_line_error(rf"^data\.path: {missing} does not exist;", load_text, missing, **kw)

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    one_line_error(rf"^data\.path: {empty} is empty;", load_text, empty, **kw)
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\n")
    one_line_error(rf"^data\.path: {blank} is empty;", load_text, blank, **kw)

    latin = tmp_path / "latin.txt"
    latin.write_bytes("line one\ncafé au lait".encode("latin-1"))
    msg = one_line_error(
        rf"^data\.path: {latin} is not UTF-8 text \(byte 0xe9 at offset 12, line 2\);", load_text, latin, **kw
    )
    assert "iconv" in msg

    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "data.csv").write_text("a,b")
    one_line_error(rf"^data\.path: folder {folder} has no \.txt", load_text, folder, **kw)
    (folder / "good.txt").write_text(numbered_text(10))
    (folder / "sub").mkdir()
    (folder / "sub" / "bad.txt").write_bytes(b"\xff\xfe")
    one_line_error(rf"^data\.path: {folder / 'sub' / 'bad.txt'} is not UTF-8", load_text, folder, **kw)

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\n{"text": oops}\n')
    one_line_error(rf"^data\.path: {bad_json} line 2 is not JSON", load_text, bad_json, **kw)
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"content": "x"}\n')
    one_line_error(
        rf"^data\.text_field: {no_field} line 1 has no key 'text' \(it has: content\);", load_text, no_field, **kw
    )
    not_str = tmp_path / "notstr.jsonl"
    not_str.write_text('{"text": 3}\n')
    one_line_error(rf"^data\.text_field: {not_str} line 1: 'text' holds a int", load_text, not_str, **kw)

    short = tmp_path / "short.txt"
    short.write_text("abc")
    one_line_error(rf"^data\.path: {short} gives 4 tokens, fewer than data\.seq_len=8;", load_text, short, **kw)

    text = tmp_path / "ok.txt"
    text.write_text(numbered_text(50))
    no_tok = tmp_path / "missing-tokenizer.json"
    one_line_error(rf"^data\.tokenizer: {no_tok} does not exist;", load_text, text, tokenizer=no_tok, **kw)
    garbage = tmp_path / "tokenizer.json"
    garbage.write_text('{"not": "a tokenizer"}')
    one_line_error(
        rf"^data\.tokenizer: {garbage} does not load as a Hugging Face tokenizer\.json",
        load_text,
        text,
        tokenizer=garbage,
        **kw,
    )
    garbage.write_bytes(b"\x00\x01binary")
    one_line_error(rf"^data\.tokenizer: {garbage} does not load", load_text, text, tokenizer=garbage, **kw)
    one_line_error(
        r"^data\.tokenizer: byte-level tokens .* model\.vocab_size=100;", load_text, text, vocab_size=100, **kw
    )
    one_line_error(
        r"^data\.batch_size: 3 does not split over 2 processes;",
        load_text,
        text,
        seq_len=8,
        batch_size=3,
        process_count=2,
    )


# --- learning on the shipped text ------------------------------------------------------------------


def test_shipped_corpus_is_plain_utf8_text():
    c = read_corpus(SHIPPED_CORPUS)
    assert len(c.files) == 3 and 200_000 < c.num_chars < 1_000_000
    assert all(f.stat().st_size > 50_000 for f in c.files)
    assert not any(ch in d for d in c.documents for ch in "*_#\\\x00")  # no Markdown left, no separator byte


@pytest.mark.slow
def test_tiny_llama_learns_the_shipped_text_below_its_unigram_entropy():
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import zoo

    t0 = time.perf_counter()
    cfg = zoo.get_size("llama_tiny_a")
    assert cfg.vocab_size == 256
    steps, batch, seq = 300, 16, 64
    data = load_text(seq_len=seq, batch_size=batch, vocab_size=cfg.vocab_size, seed=0)  # the shipped text, bytes
    # The entropy of the text's byte frequencies, in nats: what a model ignoring context can reach.
    counts = np.bincount(np.frombuffer("".join(data.corpus.documents).encode("utf-8"), np.uint8), minlength=256)
    p = counts[counts > 0] / counts.sum()
    entropy = float(-(p * np.log(p)).sum())
    assert 2.5 < entropy < 4.5 and abs(entropy - unigram_entropy(data.tokens)) < 0.01

    model = zoo.build(cfg, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 20, steps, 1e-3), weight_decay=0.0)
    opt_state = opt.init(params)

    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: zoo.loss_fn(eqx.combine(p, static), tokens))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # 300 steps: running, not compiling, is this test's time, so LLVM's optimisations are back on
    # (level 3, XLA's default; conftest.py turns them off): 42 s at level 0, 20 s here, in full-suite runs.
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    step = jax.jit(train_step).lower(params, opt_state, tokens).compile({"xla_backend_optimization_level": 3})
    losses = []
    for batch in data.batches(0):
        params, opt_state, loss = step(params, opt_state, jnp.asarray(batch["tokens"]))
        losses.append(float(loss))
        if len(losses) == steps:
            break
    first, final = np.mean(losses[:5]), np.mean(losses[-20:])
    print(f"loss {first:.3f} -> {final:.3f} nats, unigram entropy {entropy:.3f}, {time.perf_counter() - t0:.1f}s")
    assert first > entropy  # it starts above the context-free floor ...
    assert final < 0.8 * entropy, (final, entropy)  # ... and ends well below it: it uses the context


# --- through train.py --------------------------------------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_train(tmp_path, *overrides, timeout=600):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, not conftest's eight
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        f"hydra.run.dir={tmp_path / 'run'}",
        "trainer.progress=false",
        *overrides,
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


@in_process.MARK  # in one pytest process through train.py's entry point (tests/in_process.py), on one device
@pytest.mark.parametrize("case", ["not_utf8", "batch_larger_than_corpus"])
def test_train_py_bad_data_input_exits_2_with_one_line(tmp_path, case, request, capfd, monkeypatch):
    if not in_process.INNER:
        return in_process.outcome(request, {"XLA_FLAGS": in_process.xla_flags(1)})
    if case == "not_utf8":
        latin = tmp_path / "latin.txt"
        latin.write_bytes("caf\xe9".encode("latin-1"))
        args = [f"data.path={latin}"]
        want = (
            f"error: data.path: {latin} is not UTF-8 text (byte 0xe9 at offset 3, line 1); convert it, e.g. "
            "iconv -f latin1 -t utf-8, or remove it from data.path"
        )
    else:
        small = tmp_path / "small.txt"
        small.write_text(numbered_text(40))  # 321 bytes: 5 windows of 64
        args = [f"data.path={small}", "data.batch_size=8"]
        want = (
            f"error: data.batch_size: {small} (321 tokens) gives 5 windows of data.seq_len=64 tokens, fewer than one "
            "batch of "
            "data.batch_size=8; a step would read more than the corpus; lower data.batch_size or data.seq_len, or add "
            "text"
        )
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / 'run'}", "trainer.progress=false"]
    r = in_process.run([*cmd, "data=text", *args], tmp_path, capfd, monkeypatch)
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [want]
    assert "Traceback" not in r.stderr and "s, compile " not in r.stdout


@pytest.mark.slow
def test_train_py_trains_on_the_shipped_text(tmp_path):
    r = run_train(tmp_path, "data=text", "model=llama_tiny_a", "mesh=single", "trainer.steps=60")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["loss_floor"] is None
    assert summary["config"]["data"]["name"] == "text" and summary["config"]["data"]["tokenizer"] is None
    assert summary["last_loss"] < 3.3 < summary["first_loss"]  # below the bytes' unigram entropy (3.33 nats)
    assert "3 file(s), 3 document(s), 385633 tokens (bytes, vocab 256, no bos)" in r.stdout


# --- packed batches: segments, positions, BOS, loss mask -------------------------------------------


def reference_fields(stream_doc: list[int], window_start: int, seq_len: int) -> tuple[list[int], list[int]]:
    """Segment ids and positions of one window, by walking it: a new segment where the document changes."""
    seg, pos = [], []
    for t in range(seq_len):
        doc = stream_doc[window_start + t]
        if t == 0:
            seg.append(0)
            pos.append(0)
        elif doc != stream_doc[window_start + t - 1]:
            seg.append(seg[-1] + 1)
            pos.append(0)
        else:
            seg.append(seg[-1])
            pos.append(pos[-1] + 1)
    return seg, pos


def test_packed_batches_carry_segments_positions_and_mask(tmp_path):
    docs = ["ab", "cdefghij", "k", "lmnopqrstu", "vwxyz"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = load_text(tmp_path / "d.jsonl", seq_len=6, batch_size=2, shuffle=False)
    stream_doc = [i for i, d in enumerate(docs) for _ in range(len(d) + 1)]  # each doc and its NUL separator
    assert len(data.tokens) == len(stream_doc)
    n = len(data.windows)
    assert data.max_segments == max(len(set(stream_doc[5 * i : 5 * i + 6])) for i in range(n)) == 3
    for step in range(n // 2):
        b = data.batch(step)
        assert set(b) == set(BATCH_FIELDS) and all(v.dtype == np.int32 and v.shape == (2, 6) for v in b.values())
        for r in range(2):
            start = 5 * (2 * step + r)
            seg, pos = reference_fields(stream_doc, start, 6)
            assert b["tokens"][r].tolist() == list(data.tokens[start : start + 6])
            assert b["segment_ids"][r].tolist() == seg and b["positions"][r].tolist() == pos
            assert b["loss_mask"][r].tolist() == [1] * 6  # plain text: every token counts


def bos_tokenizer(path: pathlib.Path, texts, with_post_processor: bool = True) -> pathlib.Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=150, special_tokens=specials, show_progress=False))
    if with_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_bos_comes_from_the_post_processor_or_tokenizer_config(tmp_path):
    texts = ["the cat sat on the mat", "a dog on the log"] * 10
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:2]))
    folder = bos_tokenizer(tmp_path / "tok", texts)
    data = load_text(corpus, seq_len=4, batch_size=1, tokenizer=folder, shuffle=False)
    tok = data.tokenizer
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"
    want = []
    for t in texts[:2]:
        want += [tok.bos_id] + list(tok.encode(t)) + [tok.eos_id]
    assert list(data.tokens) == want
    b = data.batch(0)
    assert b["tokens"][0, 0] == tok.bos_id and b["positions"][0].tolist() == [0, 1, 2, 3]
    # tokenizer_config.json's add_bos_token wins over the post-processor
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    assert load_tokenizer(folder).bos_id is None
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": True, "bos_token": {"content": "<|im_start|>"}})
    )
    assert load_tokenizer(folder).bos_token == "<|im_start|>"
    # no post-processor, no config: no BOS; the bytes have none either
    assert load_tokenizer(bos_tokenizer(tmp_path / "plain", texts, with_post_processor=False)).bos_id is None
    assert load_tokenizer(None).bos_id is None


# A ChatML template as transformers' tokenizer_config.json carries it.
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def counted_text(data, tok) -> str:
    ids = np.asarray(data.tokens)
    mask = data.windows.packed.loss_mask
    return tok.decode(ids[mask])


def test_chat_lines_count_the_replies_only(tmp_path):
    chats = [
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi there"},
            {"role": "assistant", "content": "hello"},
        ],
        [
            {"role": "user", "content": "sum"},
            {"role": "assistant", "content": "one"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "two"},
        ],
    ]
    corpus = tmp_path / "chat.jsonl"
    corpus.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    # bytes: the documented fallback format
    data = load_text(corpus, seq_len=8, batch_size=1, shuffle=False)
    assert data.tokenizer.decode(data.tokens[: data.windows.packed.doc_starts[1]]) == (
        "system: be brief\nuser: hi there\nassistant: hello\n\x00"
    )
    assert counted_text(data, data.tokenizer) == "hello\n\x00one\ntwo\n\x00"
    # a tokenizer folder with a chat template: rendered by it, the replies with their end-of-turn marker counted
    folder = bos_tokenizer(tmp_path / "tok", ["system user assistant hi there hello be brief sum one more two"] * 10)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "bos_token": "<s>", "eos_token": "</s>"})
    )
    data = load_text(corpus, seq_len=8, batch_size=1, tokenizer=folder, shuffle=False)
    tok = data.tokenizer
    first = tok.decode(data.tokens[: data.windows.packed.doc_starts[1]]).replace(" ", "")
    assert first.startswith("<s><|im_start|>system") and first.count("<s>") == 1  # the template's BOS, not a second
    counted = [tok.decode([int(i)]) for i, m in zip(data.tokens, data.windows.packed.loss_mask) if m]
    assert "".join(counted).replace(" ", "") == "hello<|im_end|></s>one<|im_end|>two<|im_end|></s>"


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    corpus = tmp_path / "chat.jsonl"
    corpus.write_text(
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}) + "\n"
    )
    folder = bos_tokenizer(tmp_path / "tok", ["a b c"] * 5)
    # the number of messages shows at the start: a shorter conversation is not a prefix of the longer one
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages | length }}" + CHATML}))
    one_line_error(
        r"^data\.tokenizer: its chat template does not render",
        load_text,
        corpus,
        seq_len=4,
        batch_size=1,
        tokenizer=folder,
    )


def test_a_chat_template_without_jinja2_is_one_line(tmp_path, monkeypatch):
    import sys

    corpus = tmp_path / "chat.jsonl"
    corpus.write_text(
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}) + "\n"
    )
    folder = bos_tokenizer(tmp_path / "tok", ["a b c"] * 5)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    monkeypatch.setitem(sys.modules, "jinja2", None)  # import jinja2 now fails
    one_line_error(
        r"^data\.tokenizer: .* has a chat template, and rendering it needs jinja2; pip install jinja2",
        load_text,
        corpus,
        seq_len=4,
        batch_size=1,
        tokenizer=folder,
    )


# --- held-out evaluation and a corpus smaller than a batch ------------------------------------------


def test_eval_fraction_holds_out_evenly_spread_windows_whatever_the_seed(tmp_path):
    (tmp_path / "t.txt").write_text(numbered_text(400))
    kw = dict(seq_len=16, batch_size=4, eval_fraction=0.1)
    data = load_text(tmp_path, seed=1, **kw)
    n = len(data.windows)
    held = data.eval.window_ids
    assert len(held) == n // 10 and len(data.window_ids) == n - n // 10
    assert not set(held) & set(data.window_ids)
    assert np.diff(held).max() <= 10 and held[0] < 10 and held[-1] >= n - 11  # spread over the whole corpus
    np.testing.assert_array_equal(load_text(tmp_path, seed=2, **kw).eval.window_ids, held)
    # training never reads a held-out window; the eval split reads them in order
    seen = {r for s in range(2 * n // 4) for r in rows(data.batch(s)["tokens"])}
    held_rows = set(rows(np.stack([data.windows[int(i)] for i in held]).astype(np.int32)))
    assert not seen & held_rows and len(seen) == len(data.window_ids)
    assert rows(data.eval.batch(0)["tokens"]) == rows(
        np.stack([data.windows[int(i)] for i in held[:4]]).astype(np.int32)
    )
    assert data.eval.num_batches == len(held) // 4


def test_eval_path_and_the_splits_too_small_for_a_batch(tmp_path):
    train, held = tmp_path / "train.txt", tmp_path / "held.txt"
    train.write_text(numbered_text(100))
    held.write_text(numbered_text(28, start=500))
    data = load_text(train, seq_len=16, batch_size=4, eval_path=held)
    assert data.eval.source == str(held) and len(data.eval.window_ids) == num_windows(28 * 8 + 1, 16)
    assert data.eval.tokens.tobytes() != data.tokens.tobytes()
    one_line_error(
        r"^data\.eval_path: .*held\.txt \(\d+ tokens\) gives 14 windows of data\.seq_len=16 tokens, fewer than one "
        r"batch of "
        r"data\.batch_size=16; add text",
        load_text,
        train,
        seq_len=16,
        batch_size=16,
        eval_path=held,
    )
    one_line_error(
        r"^data\.eval_fraction: 0\.01 of .* gives 0 windows .* fewer than one batch of data\.batch_size=4; "
        r"raise data\.eval_fraction to at least 0\.076",
        load_text,
        train,
        seq_len=16,
        batch_size=4,
        eval_fraction=0.01,
    )
    one_line_error(
        r"^data\.eval_path: .*nope does not exist",
        load_text,
        train,
        seq_len=16,
        batch_size=4,
        eval_path=tmp_path / "nope",
    )
    one_line_error(
        r"^data\.eval_fraction: set it or data\.eval_path, not both",
        load_text,
        train,
        seq_len=16,
        batch_size=4,
        eval_fraction=0.1,
        eval_path=held,
    )
    # issue 13: a batch larger than the corpus (under one step per epoch)
    one_line_error(
        r"^data\.batch_size: .*train\.txt \(801 tokens\) gives 53 windows of data\.seq_len=16 tokens, fewer than one "
        r"batch "
        r"of data\.batch_size=64; a step would read more than the corpus; lower data\.batch_size or data\.seq_len",
        load_text,
        train,
        seq_len=16,
        batch_size=64,
    )


def test_batches_are_the_same_from_several_threads(tmp_path):
    import concurrent.futures

    (tmp_path / "t.txt").write_text(numbered_text(300))
    data = load_text(tmp_path, seq_len=16, batch_size=8, seed=3)
    steps = list(range(0, 60)) * 2  # several epochs, out of order across threads
    want = {s: load_text(tmp_path, seq_len=16, batch_size=8, seed=3).batch(s)["tokens"] for s in range(60)}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(data.batch, steps))
    for s, b in zip(steps, got):
        np.testing.assert_array_equal(b["tokens"], want[s])


# --- the synthetic markov chain --------------------------------------------------------------------


def markov_by_steps(d, step: int) -> np.ndarray:
    """The chain's definition, one position at a time (the generator's former loop)."""
    c = d.c
    rng = np.random.default_rng((c.seed, step))
    out = np.empty((c.batch_size, c.seq_len), np.int32)
    out[:, 0] = rng.integers(0, d.vocab_size, size=c.batch_size)
    u = rng.random((c.batch_size, c.seq_len))
    for t in range(1, c.seq_len):
        prev = out[:, t - 1]
        choice = (u[:, t, None] > d.cumprobs[prev]).sum(-1)
        out[:, t] = d.successors[prev, np.minimum(choice, d.successors.shape[1] - 1)]
    return out


@pytest.mark.parametrize("vocab, branching", [(256, 4), (50, 50)])
def test_vectorised_markov_batches_equal_the_step_by_step_chain(vocab, branching):
    from zoo.train.run_config import DataConfig
    from zoo.train.batches import SyntheticData

    c = DataConfig(batch_size=8, seq_len=33, branching=branching, seed=7)
    whole = SyntheticData(c, vocab)
    for step in (0, 5):
        want = markov_by_steps(whole, step)
        np.testing.assert_array_equal(whole.global_batch(step), want)
        parts = [SyntheticData(c, vocab, p, 4).batch(step) for p in range(4)]  # each process its rows only
        np.testing.assert_array_equal(np.concatenate(parts), want)
    assert len(np.unique(want)) > min(vocab, 20)


# --- the model on packed documents: each document as if alone ---------------------------------------

SEQ = 300  # past the blockwise path's 256-position tiles, so its tile skipping and segment masks both act


@pytest.fixture(scope="module")
def tiny_llama():
    import jax

    import zoo

    cfg = zoo.get_size("llama_tiny_a").replace(max_position_embeddings=512)
    return cfg, zoo.build(cfg, key=jax.random.key(1))


def packed_row(lengths, seed=0):
    """One row of documents of `lengths` (filling SEQ): tokens, segment ids, positions restarting per document."""
    rng = np.random.default_rng(seed)
    assert sum(lengths) == SEQ
    tokens = rng.integers(1, 256, size=SEQ).astype(np.int32)
    segments = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)]).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    return tokens, segments, positions


def features_fn(model, impl):
    import jax

    from zoo.model import abstract
    from zoo.nn.attention_kernels import segments_bound

    # The same weights under another attention path (a static field): no second initialisation.
    model = jax.tree.unflatten(
        jax.tree.structure(abstract(model.config.replace(attention_impl=impl))), jax.tree.leaves(model)
    )

    @jax.jit
    def logits(tokens, positions, segment_ids):
        with segments_bound(4):
            return model(tokens, positions=positions, segment_ids=segment_ids)

    return logits


def cudnn_stand_in(monkeypatch):
    """cuDNN's packed attention (per-row segment lengths and starts) computed by the XLA path from the
    same layout, and cuDNN accepted on CPU: the plumbing from segment ids to cuDNN's arguments runs."""
    import jax.numpy as jnp
    from zoo._compat import cudnn_fused_attention

    fa = cudnn_fused_attention()

    from zoo.nn import attention_kernels as A

    def packed_attention(
        q, k, v, *, scale, mask_type, sliding_window_length=None, q_seqlen, kv_seqlen, q_offsets, kv_offsets
    ):
        assert mask_type == fa.MaskType.PADDING_CAUSAL
        pos = jnp.arange(q.shape[1])
        # segment m covers [offset m, offset m + length m): the layout back to ids
        inside = (pos[None, None, :] >= q_offsets[:, :-1, None]) & (
            pos[None, None, :] < (q_offsets[:, :-1] + q_seqlen)[:, :, None]
        )
        ids = jnp.argmax(inside, axis=1)
        return A.xla_attention(q, k, v, scale=scale, segment_ids=ids)

    monkeypatch.setattr(A, "_cudnn_refusal", lambda *a, **k: None)
    monkeypatch.setattr(fa, "dot_product_attention", packed_attention)


LENGTHS = [40, 170, 1, 89]


@pytest.fixture(scope="module")
def alone_logits(tiny_llama):
    """Each document of the packed row at the start of a row of its own (what follows it cannot
    reach it through causal attention), positions from 0, no segment ids: its logits alone."""
    import jax.numpy as jnp

    _, model = tiny_llama
    tokens, _, _ = packed_row(LENGTHS)
    rows, at = [], 0
    for n in LENGTHS:
        rows.append(np.concatenate([tokens[at : at + n], np.zeros(SEQ - n, np.int32)]))
        at += n
    positions = jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32), (len(LENGTHS), SEQ))
    out = features_fn(model, "xla")(jnp.asarray(np.stack(rows)), positions, jnp.zeros((len(LENGTHS), SEQ), jnp.int32))
    return np.asarray(out)


@pytest.mark.parametrize("impl", ["xla", "blockwise", "cudnn"])
def test_a_packed_row_gives_each_document_its_logits_alone(tiny_llama, alone_logits, impl, monkeypatch):
    import jax.numpy as jnp

    if impl == "cudnn":
        cudnn_stand_in(monkeypatch)
    _, model = tiny_llama
    logits = features_fn(model, impl)
    tokens, segments, positions = packed_row(LENGTHS)
    tokens, positions = jnp.asarray(tokens[None]), jnp.asarray(positions[None])
    packed = np.asarray(logits(tokens, positions, jnp.asarray(segments[None])))[0]
    at = 0
    for i, n in enumerate(LENGTHS):
        np.testing.assert_allclose(packed[at : at + n], alone_logits[i, :n], rtol=2e-5, atol=2e-5)
        at += n
    # and without segment ids the documents do see each other, so the comparison above says something
    unmasked = np.asarray(logits(tokens, positions, jnp.zeros((1, SEQ), jnp.int32)))[0]
    assert np.abs(unmasked[LENGTHS[0] :] - packed[LENGTHS[0] :]).max() > 1e-2


# --- the trainer's loss on packed batches ----------------------------------------------------------


@pytest.fixture(scope="module")
def text_trainer(tiny_llama):
    import equinox as eqx
    import jax

    from zoo.offload import OffloadConfig
    from zoo.train.run_config import DataConfig, HardwareConfig, MeshConfig, OptimizerConfig, TrainConfig
    from zoo.train.run_config import TrainerConfig, XlaConfig, validate
    from zoo.train.step import Trainer

    cfg, model = tiny_llama

    def make(accum=1, chunk=512):
        c = TrainConfig(
            model=cfg,
            mesh=MeshConfig(devices=1),
            offload=OffloadConfig(),
            optimizer=OptimizerConfig(),
            data=DataConfig(name="text", batch_size=4, seq_len=24),
            xla=XlaConfig(),
            trainer=TrainerConfig(grad_accum=accum, loss_chunk_size=chunk),
            hardware=HardwareConfig(),
        )
        return Trainer(c, validate(c, len(jax.devices())))

    return make, eqx.partition(model, eqx.is_array)[0]


def pair_corpus(tmp_path) -> pathlib.Path:
    """Prompts in capitals and responses in lower case: a target's byte says which it is."""
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(12):
        prompt = "".join(rng.choice(list("ABCDEFGH"), size=rng.integers(3, 9)))
        response = "".join(rng.choice(list("abcdefgh"), size=rng.integers(2, 7)))
        lines.append(json.dumps({"prompt": prompt + ":", "response": response}))
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def per_target_nll(tiny_llama):
    """[rows, seq-1]: -log p(token t+1 | tokens of its row up to t), documents kept apart."""
    import jax

    from zoo.loss import chunked_next_token_nll

    _, model = tiny_llama

    @jax.jit
    def nll(tokens, positions, segment_ids):
        hidden, _ = model.features(tokens, positions=positions, segment_ids=segment_ids)
        return chunked_next_token_nll(hidden, model.head_weight(), tokens)

    return lambda batch: np.asarray(nll(batch["tokens"], batch["positions"], batch["segment_ids"]))


def test_prompt_response_loss_counts_response_tokens_only(tmp_path, text_trainer, per_target_nll):
    import jax

    make, params = text_trainer
    trainer = make()
    data = load_text(pair_corpus(tmp_path), seq_len=24, batch_size=4, shuffle=False)
    batch = data.batch(1)
    tokens, seg = batch["tokens"], batch["segment_ids"]
    # the mask marks the responses' bytes and the EOS after them, nothing of the prompts
    lower = (tokens >= ord("a")) & (tokens <= ord("h"))
    eos_after_response = (tokens == 0) & np.concatenate([np.zeros((4, 1), bool), lower[:, :-1]], axis=1)
    np.testing.assert_array_equal(batch["loss_mask"] == 1, lower | eos_after_response)
    # the trainer's loss is the mean over response targets that follow a token of their own document
    counted = (lower | eos_after_response)[:, 1:] & (seg[:, 1:] == seg[:, :-1])
    nll = per_target_nll(batch)
    want = nll[counted].mean()
    np.testing.assert_allclose(float(jax.jit(trainer.loss_and_aux)(params, batch)[0]), want, rtol=1e-5)
    # counting the prompts (or the cross-document targets) gives another number
    everything = seg[:, 1:] == seg[:, :-1]
    assert abs(nll[everything].mean() - want) > 1e-3 and counted.sum() < everything.sum()


@pytest.mark.parametrize("chunk", [512, 0])
def test_packed_loss_is_the_mean_over_all_the_steps_targets(tmp_path, text_trainer, per_target_nll, chunk):
    """Microbatches with unequal target counts: each one's loss is divided by the step's count, so
    their mean is the step's mean whatever grad_accum is (and with the whole-logits loss)."""
    import jax
    import jax.numpy as jnp

    make, params = text_trainer
    data = load_text(pair_corpus(tmp_path), seq_len=24, batch_size=4, shuffle=False)
    batch = data.batch(0)
    nll = per_target_nll(batch)
    counted = (batch["loss_mask"][:, 1:] == 1) & (batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1])
    want = nll[counted].mean()
    two = make(accum=2, chunk=chunk)
    staged = two.with_loss_denominators({k: jnp.asarray(v).reshape(2, 2, 24) for k, v in batch.items()})
    loss = jax.jit(two.loss_and_aux)
    losses = [float(loss(params, jax.tree.map(lambda x: x[i], staged))[0]) for i in range(2)]
    per_micro_counts = counted.reshape(2, 2, -1).sum(axis=(1, 2))
    assert per_micro_counts[0] != per_micro_counts[1]  # unequal, so a plain mean of means would differ
    np.testing.assert_allclose(np.mean(losses), want, rtol=1e-5)


def test_trainer_takes_packed_batches_and_plain_rows(text_trainer):
    make, _ = text_trainer
    trainer = make()
    abstract = trainer.abstract_tokens()
    assert set(abstract) == set(BATCH_FIELDS) and all(a.shape == (1, 4, 24) for a in abstract.values())
    rows = np.arange(4 * 24, dtype=np.int32).reshape(4, 24) % 256
    sharded = trainer.shard_tokens(rows)  # a plain array: one document per row
    assert set(sharded) == set(BATCH_FIELDS)
    np.testing.assert_array_equal(np.asarray(sharded["tokens"])[0], rows)
    np.testing.assert_array_equal(np.asarray(sharded["positions"])[0], np.broadcast_to(np.arange(24), (4, 24)))
    assert not np.asarray(sharded["segment_ids"]).any() and np.asarray(sharded["loss_mask"]).all()
    # zoo.tools.inspect_step and zoo.tools.plan lower the step on these abstract inputs
    text = trainer.lower().as_text()
    assert text.count("tensor<1x4x24xi32>") >= len(BATCH_FIELDS)
