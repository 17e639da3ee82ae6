# The peer for bench/peer.py: PyTorch eager (transformers LlamaForCausalLM, sdpa attention) training
# steps on CPU, in its own environment (torch is not a Zoo dependency):
#
#   python3 -m venv /tmp/torchpeer && /tmp/torchpeer/bin/pip install torch==2.13.0 transformers==5.24.0
#   /tmp/torchpeer/bin/python bench/torch_llama_step.py --config tiny|100m --remat none|full \
#       [--steps 12] [--json out.json]
#
# Every step: forward + loss (labels=x, shifted inside the model) + backward + grad-norm clip 1.0 + AdamW step.
# Each step gets a fresh uniform-random batch (made before the step clock starts), like zoo's data=uniform.
# Prints one line per step and writes a JSON record (per-step times, losses, param counts).
import argparse
import json
import math
import statistics
import sys
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

CONFIGS = {
    "tiny": dict(vocab=32000, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, mlp=1024, batch=8, seq=256),
    "100m": dict(vocab=32000, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, mlp=2048, batch=4, seq=512),
}


def llama_config(d: dict) -> LlamaConfig:
    """transformers' config of the peer Llama `d` (one of CONFIGS): sdpa attention, untied head, no biases."""
    return LlamaConfig(
        vocab_size=d["vocab"],
        hidden_size=d["hidden"],
        num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"],
        head_dim=d["head_dim"],
        intermediate_size=d["mlp"],
        max_position_embeddings=max(512, d["seq"]),
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        use_cache=False,
        attn_implementation="sdpa",
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    ap.add_argument("--remat", choices=["none", "full"], default="none")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    d = CONFIGS[a.config]

    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    cfg = llama_config(d)
    m = LlamaForCausalLM(cfg).to(torch.float32)
    if a.remat == "full":
        # one checkpoint per decoder layer (torch.utils.checkpoint, use_reentrant=False):
        # keeps its input, recomputes the rest
        (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
    m.train()
    # zoo's optimizer settings (conf/optimizer/adamw.yaml): b1 .9, b2 .95, eps 1e-8, wd .1, clip 1.0 (no schedule here)
    opt = torch.optim.AdamW(m.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    times, losses = [], []
    for i in range(a.steps):
        x = torch.randint(0, d["vocab"], (d["batch"], d["seq"]), generator=g)
        t = time.perf_counter()
        out = m(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.item()
        dt = time.perf_counter() - t
        times.append(dt)
        losses.append(loss)
        print(f"step {i + 1}/{a.steps} loss {loss:.4f} {dt * 1e3:.1f} ms", flush=True)
    n = sum(p.numel() for p in m.parameters())
    n_emb = m.model.embed_tokens.weight.numel()
    timed = times[2:] if len(times) > 2 else times
    rec = {
        "system": "torch",
        "config": a.config,
        "remat": a.remat,
        "steps": a.steps,
        "step_times_s": times,
        "losses": losses,
        "median_step_s_3_to_end": statistics.median(timed),
        "params": n,
        "params_embedding": n_emb,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attn_implementation": m.config._attn_implementation,
        "dtype": str(next(m.parameters()).dtype),
    }
    print(
        f"torch eager {a.remat}: median step (steps 3..{a.steps}) {rec['median_step_s_3_to_end'] * 1e3:.1f} ms, "
        f"params {n / 1e6:.2f}M, loss {losses[0]:.4f} -> {losses[-1]:.4f} (ln V = {math.log(d['vocab']):.3f})",
        flush=True,
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
