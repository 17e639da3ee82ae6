# The torch side of bench/peer_parts.py: each part of bench/peer.py's Llama step timed alone in PyTorch eager
# (float32, 2 threads), in its own environment (torch is not a Zoo dependency):
#
#   /tmp/torchpeer/bin/python bench/torch_parts.py --config tiny|100m [--reps 9] [--json out.json]
#
# The parts and their shapes are bench/peer_parts.py's (its docstring says what each one times); every
# number is the median of `--reps` timed calls after two untimed ones.
import argparse
import json
import statistics
import time

import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaRotaryEmbedding

from torch_llama_step import CONFIGS, llama_config  # this folder: the script runs as bench/torch_parts.py


def timed(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def parts(d, reps: int) -> dict:
    torch.manual_seed(0)
    B, T, D, F, V = d["batch"], d["seq"], d["hidden"], d["mlp"], d["vocab"]
    N, K, H = d["heads"], d["kv_heads"], d["head_dim"]
    out = {}

    x2 = torch.randn(B * T, D)
    w_mlp = torch.randn(F, D) * D ** -0.5  # nn.Linear's [out, in] layout
    w_head = torch.randn(V, D) * D ** -0.5
    out["matmul_mlp"] = timed(lambda: x2 @ w_mlp.T, reps)
    out["matmul_head"] = timed(lambda: x2 @ w_head.T, reps)

    h = x2.clone().requires_grad_()
    head = w_head.clone().requires_grad_()
    targets = torch.randint(0, V, (B * T,))

    def loss():
        torch.nn.functional.cross_entropy(h @ head.T, targets).backward()
        h.grad = head.grad = None

    out["loss"] = timed(loss, reps)

    q = torch.randn(B, N, T, H, requires_grad=True)
    k = torch.randn(B, K, T, H, requires_grad=True)
    v = torch.randn(B, K, T, H, requires_grad=True)

    def attention():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
        q.grad = k.grad = v.grad = None

    out["attention"] = timed(attention, reps)

    cfg = llama_config(d)
    x3 = torch.randn(B, T, D, requires_grad=True)
    mlp = LlamaMLP(cfg)

    def run_mlp():
        mlp(x3).sum().backward()
        mlp.zero_grad(set_to_none=True)
        x3.grad = None

    out["mlp"] = timed(run_mlp, reps)

    layer = LlamaDecoderLayer(cfg, 0)
    pos = torch.arange(T)[None].expand(B, T)
    pe = LlamaRotaryEmbedding(cfg)(x3, pos)

    def run_layer():
        y = layer(x3, attention_mask=None, position_embeddings=pe, position_ids=pos)
        (y[0] if isinstance(y, tuple) else y).sum().backward()
        layer.zero_grad(set_to_none=True)
        x3.grad = None

    out["layer"] = timed(run_layer, reps)

    model = LlamaForCausalLM(cfg)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def optimizer():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    out["optimizer"] = timed(optimizer, reps)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rec = {"system": "torch", "config": a.config, "seconds": parts(CONFIGS[a.config], a.reps), "torch": torch.__version__}
    print(json.dumps(rec))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f)


if __name__ == "__main__":
    main()
