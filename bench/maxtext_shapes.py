"""The shapes bench/peer_maxtext.py runs (`Shape`: one model's dimensions at one batch, in MaxText's terms
and Zoo's), the policies both have (`POLICIES`), and a shape as bench/tpu.py's setup (`zoo_setup`), so that
bench/tpu.py reads the peer's records (`as_tpu_record`) without importing the peer script."""

import dataclasses
import statistics


@dataclasses.dataclass(frozen=True)
class Shape:
    """One model shape at one batch, in MaxText's terms (`base_emb_dim` ... ) and Zoo's."""

    emb: int
    mlp: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    batch: int
    seq: int
    tied: bool = False
    # MLA (DeepSeek-V3's attention): q_lora, kv_lora, qk_nope, qk_rope, v_head; 0: grouped-query attention
    q_lora: int = 0
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    # Routed experts (0: a dense MLP of width `mlp`), each `mlp` wide, `top_k` per token, `shared` experts
    experts: int = 0
    top_k: int = 0
    shared: int = 0

    @property
    def mla(self) -> bool:
        return self.kv_lora > 0

    def problems(self) -> list[str]:
        """What either framework refuses, said before anything starts."""
        out = []
        for f in ("emb", "mlp", "heads", "kv_heads", "head_dim", "layers", "vocab", "batch", "seq"):
            if getattr(self, f) < 1:
                out.append(f"{f}={getattr(self, f)}: must be at least 1")
        if not out and not self.mla and self.heads % self.kv_heads:
            out.append(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads} (grouped-query attention)")
        if self.mla and min(self.kv_lora, self.qk_nope, self.qk_rope, self.v_head) < 1:
            out.append("an MLA shape needs kv_lora, qk_nope, qk_rope and v_head of at least 1")
        if self.mla and self.qk_rope % 2:
            out.append(f"qk_rope={self.qk_rope}: rotary dims come in pairs, use an even number")
        if not self.mla and self.head_dim % 2:
            out.append(f"head_dim={self.head_dim}: rotary dims come in pairs, use an even number")
        if self.experts and not (1 <= self.top_k <= self.experts):
            out.append(f"top_k={self.top_k}: choose 1 to experts={self.experts}")
        if self.seq % 128 and not self.toy_sized():
            out.append(f"seq={self.seq}: the TPU attention kernels (splash) tile by 128; use a multiple of 128")
        return out

    def toy_sized(self) -> bool:
        return self.emb <= 256

    def zoo_model(self):
        """The Zoo ModelConfig of these dimensions (Llama's or DeepSeek-V3's layer, cut as said)."""
        from zoo.config import MLAConfig
        from zoo.families import SIZES

        if not self.mla:
            return SIZES["llama_1b"].replace(
                hidden_size=self.emb,
                intermediate_size=self.mlp,
                num_heads=self.heads,
                num_kv_heads=self.kv_heads,
                head_dim=self.head_dim,
                num_layers=self.layers,
                vocab_size=self.vocab,
                tie_word_embeddings=self.tied,
            )
        base = SIZES["dsv3_100m"]
        moe = dataclasses.replace(
            base.moe,
            n_routed_experts=self.experts,
            num_experts_per_tok=self.top_k,
            moe_intermediate_size=self.mlp,
            n_shared_experts=self.shared,
            n_group=1,
            topk_group=1,
        )
        return base.replace(
            hidden_size=self.emb,
            intermediate_size=self.mlp,
            num_heads=self.heads,
            num_kv_heads=self.heads,
            num_layers=self.layers,
            first_k_dense_replace=0,
            vocab_size=self.vocab,
            tie_word_embeddings=self.tied,
            mla=MLAConfig(
                q_lora_rank=self.q_lora or None,
                kv_lora_rank=self.kv_lora,
                qk_nope_head_dim=self.qk_nope,
                qk_rope_head_dim=self.qk_rope,
                v_head_dim=self.v_head,
            ),
            moe=moe,
        )

    def maxtext_args(self) -> list[str]:
        """MaxText's overrides for these dimensions (its keys in maxtext/configs/base.yml)."""
        a = [
            f"base_emb_dim={self.emb}",
            f"base_mlp_dim={self.mlp}",
            f"base_num_query_heads={self.heads}",
            f"base_num_kv_heads={self.heads if self.mla else self.kv_heads}",
            f"head_dim={self.head_dim}",
            f"base_num_decoder_layers={self.layers}",
            f"vocab_size={self.vocab}",
            f"logits_via_embedding={str(self.tied).lower()}",
            f"per_device_batch_size={self.batch}",
            f"max_target_length={self.seq}",
        ]
        if self.layers == 1:
            # One layer scanned is a one-trip loop XLA removes, and MaxText's scan lets XLA fold the
            # checkpoint's recompute back into the forward: its remat policies compile to nearly `none`
            # (DeepSeek-V3's layer compiled for a v5e: `full` recomputes 2.41 of 17.1 TFLOP, `minimal`
            # nothing). Unscanned, a policy recomputes what it says, as at any depth; Zoo keeps its
            # one-layer checkpoint on purpose.
            a.append("scan_layers=false")
        if not self.mla:
            return a + ["decoder_block=llama2", "rope_type=default", "rope_max_timescale=500000"]
        return a + [
            "decoder_block=deepseek",
            "attention_type=mla",
            f"q_lora_rank={self.q_lora}",
            f"kv_lora_rank={self.kv_lora}",
            f"qk_nope_head_dim={self.qk_nope}",
            f"qk_rope_head_dim={self.qk_rope}",
            f"v_head_dim={self.v_head}",
            f"num_experts={self.experts}",
            f"num_experts_per_tok={self.top_k}",
            f"base_moe_mlp_dim={self.mlp}",
            f"shared_experts={self.shared}",
            "first_num_dense_layers=0",
            "routed_score_func=sigmoid",
            "routed_bias=true",
            "routed_scaling_factor=2.5",
            "rope_type=default",
            "rope_max_timescale=10000",
            "megablox=true",
            "sparse_matmul=true",
            "capacity_factor=-1",
        ]

    def state_bytes(self) -> float:
        """Float32 parameters, gradients and AdamW's two moments: 16 bytes a parameter."""
        from zoo.counts import count_params

        return 16.0 * count_params(self.zoo_model())


# The shapes of issue #56, each at a batch where `none` runs out of memory on the v5e (the offload
# policies' case). Cuts to fit one 15.75 GB chip with float32 AdamW state on the device:
# `llama8b_*`: Llama 3.1 8B's layer (4096 / 14336, 32 / 8 heads of 128), 2 layers, the vocabulary cut
#   from 128,256 to 32,768 (128k alone is 1.05B parameters, 16.8 GB of state);
# `dsv3_*`: DeepSeek-V3's layer (MLA at 7168 wide, 128 heads, q/kv LoRA 1536 / 512, heads 128 + 64 / 128;
#   experts 2048 wide, one shared), one layer, 4 routed experts (top 2) instead of 256 (top 8), the
#   vocabulary cut to 16,384.
SHAPES = {
    "llama1b_2048": Shape(2048, 8192, 32, 8, 64, 4, 128256, batch=12, seq=2048, tied=True),
    "llama1b_8192": Shape(2048, 8192, 32, 8, 64, 4, 128256, batch=3, seq=8192, tied=True),
    "llama8b_8192": Shape(4096, 14336, 32, 8, 128, 2, 32768, batch=2, seq=8192),
    "dsv3_4096": Shape(
        7168, 2048, 128, 128, 128, 1, 16384, batch=2, seq=4096, q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64,
        v_head=128, experts=4, top_k=2, shared=1,
    ),
}  # fmt: skip
TOY_SHAPES = {
    "toy_dense": Shape(64, 128, 4, 2, 16, 2, 256, batch=2, seq=128),
    "toy_mla": Shape(
        64, 64, 4, 4, 16, 1, 256, batch=2, seq=128, q_lora=32, kv_lora=32, qk_nope=16, qk_rope=8, v_head=16,
        experts=4, top_k=2, shared=1,
    ),
}  # fmt: skip

# MaxText's `minimal` names (its Decoder.minimal_policy): every projection and MLP output.
_MAXTEXT_MINIMAL = ["query_proj", "key_proj", "value_proj", "qkv_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo"]
# A policy both have: Zoo's label (bench/tpu.py's syntax) and MaxText's remat overrides. Each keeps its
# own preset of the name: MaxText's `minimal` also keeps the MLP's output (`mlpwo`), Zoo's recomputes it.
POLICIES = {
    "none": ("none", ["remat_policy=none"]),
    "full": ("full", ["remat_policy=full"]),
    "minimal": ("minimal", ["remat_policy=minimal"]),
    "save_qkv_proj": ("save_qkv_proj", ["remat_policy=save_qkv_proj"]),
    "qkv_proj_offloaded": ("qkv_proj_offloaded", ["remat_policy=qkv_proj_offloaded"]),
    "minimal_offloaded": ("minimal_offloaded", ["remat_policy=minimal_offloaded"]),
    "context_offloaded": (
        "minimal_context_offloaded",
        ["remat_policy=custom", "context=offload", *[f"{t}=device" for t in _MAXTEXT_MINIMAL]],
    ),
}
RECOMPUTE_ONLY = {"none", "full", "minimal", "save_qkv_proj"}


def recompute_only(policy: str) -> bool:
    """A policy of the table that sends nothing to host: a preset of `RECOMPUTE_ONLY`, or a Zoo label
    (`full:tag=device,...`) with no tag offloaded."""
    return policy in RECOMPUTE_ONLY or (":" in policy and "=offload" not in policy)


def zoo_label(policy: str) -> str:
    """Zoo's label of a policy of --policies: a shared one's (POLICIES), or a label of bench/tpu.py's
    syntax as given (Zoo's side only: `minimal:context=device,out_proj=offload`)."""
    return POLICIES[policy][0] if policy in POLICIES else policy


def zoo_setup(name: str, shape: Shape, labels: list[str], group: str = "default") -> dict:
    """bench/tpu.py's setup of a shape (its model registered in zoo.families.SIZES under
    `maxtext_bench_<name>`), running the Zoo labels `labels`."""
    from zoo.families import SIZES

    model = f"maxtext_bench_{name}"
    SIZES[model] = shape.zoo_model()
    return {"model": [model, {}], "batch": shape.batch, "seq": shape.seq, "group": group, "policies": labels}


def as_tpu_record(record: dict) -> dict:
    """This script's record as bench/tpu.py's (its Zoo runs, each shape a setup marked out of sample),
    for the step model's fit and its transfer evidence (`python bench/tpu.py --fit`)."""
    setups = {}
    for name, entry in (record.get("shapes") or {}).items():
        runs = {}
        for policy, r in ((entry.get("zoo") or {}).get("runs") or {}).items():
            times = r.get("step_times_s") or []
            runs[zoo_label(policy)] = {**r, "median_step_s": statistics.median(times) if times else None}
        setup = zoo_setup(name, Shape(**entry["shape"]), list(runs))
        setups[f"maxtext_{name}"] = {"setup": setup, "runs": runs, "command": entry.get("command"), "peer": True}
    return {"schema": "zoo.bench.tpu/1", "command": "", "setups": setups}
