"""Latency profiles that price a replayed forward on hardware this project does not have.

Every shipped profile is *assumed*: derived from first principles (docs/whatif.md, "Latency profiles"), not
measured, until a device runs `dasrl bench gpu` (or `dasrl calibrate`) and a measured file replaces it
(`dasrl whatif --latency`). c_draft_kv is left out: vLLM verifies drafts in the same kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

from dasrl.policy import LatencyModel

# (hidden, layers, heads, kv_heads, intermediate, vocab, tied embeddings) from the models' HF config.json
MODELS = {
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, True),   # huggingface.co/Qwen/Qwen2.5-1.5B config.json
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064, False),   # huggingface.co/Qwen/Qwen2.5-7B config.json
    "qwen2.5-32b": (5120, 64, 40, 8, 27648, 152064, False),  # huggingface.co/Qwen/Qwen2.5-32B config.json
}

# Peak figures from the vendors' datasheets: (memory bytes/s, dense bf16 FLOP/s without sparsity, memory bytes)
CARDS = {
    "h100": (3.35e12, 989e12, 80e9),   # NVIDIA H100 SXM5 datasheet: HBM3 3.35 TB/s, BF16 989 TFLOPS dense
    "h200": (4.8e12, 989e12, 141e9),   # NVIDIA H200 SXM datasheet: HBM3e 4.8 TB/s, BF16 989 TFLOPS dense
    "l4": (300e9, 121e12, 24e9),       # NVIDIA L4 datasheet: GDDR6 300 GB/s, BF16 121 TFLOPS dense (242 sparse)
}

MEM_EFFICIENCY = 0.80
"""Fraction of peak bandwidth a decode step's weight streaming reaches (assumed; STREAM-like copies reach
~85-90% of HBM peak, GEMV kernels at small batch somewhat less)."""
FLOP_EFFICIENCY = 0.60
"""Fraction of dense bf16 peak that serving-shaped GEMMs reach (assumed; MLPerf-class LLM inference runs
report roughly 50-70% MFU in the compute-bound regime)."""
STEP_OVERHEAD_S = 1.0e-3
"""Per-forward framework time beside the kernels: scheduler, sampler, CUDA-graph launch (assumed, vLLM-class
engine; vLLM turns async scheduling off for custom drafters, so this is not hidden)."""
BYTES = 2  # bf16 weights and KV cache


def param_counts(shape: tuple) -> tuple[int, int]:
    """(all parameters, those a forward streams): the input embedding table is read row by row, so an
    untied model's table is left out of the bytes per forward (a tied one is read whole as the LM head)."""
    hidden, layers, heads, kv, inter, vocab, tied = shape
    head_dim = hidden // heads
    attn = hidden * hidden * 2 + 2 * hidden * kv * head_dim + hidden + 2 * kv * head_dim  # q, o, k, v, biases
    mlp = 3 * hidden * inter
    per_layer = attn + mlp + 2 * hidden  # two RMSNorms
    embed = vocab * hidden
    total = layers * per_layer + hidden + embed + (0 if tied else embed)
    return total, total - (0 if tied else embed)


@dataclass(frozen=True)
class Profile:
    name: str
    latency: LatencyModel
    status: str
    """"assumed" (derived, see `derivation`) or "measured" (a calibrate / bench gpu file)."""
    derivation: dict

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "latency": self.latency.to_dict(),
                "derivation": self.derivation}


def derive(model: str, card: str) -> Profile:
    shape, (bw, flops, mem) = MODELS[model], CARDS[card]
    total, streamed = param_counts(shape)
    hidden, layers, heads, kv, *_ = shape
    kv_bytes = 2 * layers * kv * (hidden // heads) * BYTES
    bw_eff, flops_eff = bw * MEM_EFFICIENCY, flops * FLOP_EFFICIENCY
    # every streamed weight takes part in one multiply-add per token
    lat = LatencyModel(c_base=streamed * BYTES / bw_eff + STEP_OVERHEAD_S, c_tok=2 * streamed / flops_eff,
                       c_other=kv_bytes / bw_eff)
    weights = total * BYTES
    if weights >= mem:
        raise ValueError(f"{model} ({weights / 1e9:.0f} GB in bf16) does not fit one {card} ({mem / 1e9:.0f} GB)")
    return Profile(f"{model}-{card}", lat, "assumed", {
        "parameters": total, "streamed_parameters": streamed, "weight_bytes": weights, "kv_bytes_per_token": kv_bytes,
        "kv_room_tokens": int((mem * 0.9 - weights) / kv_bytes),
        "peak_bandwidth": bw, "peak_bf16_flops": flops, "mem_efficiency": MEM_EFFICIENCY,
        "flop_efficiency": FLOP_EFFICIENCY, "step_overhead_s": STEP_OVERHEAD_S,
        "c_base": "streamed_parameters * 2 B / (peak_bandwidth * mem_efficiency) + step_overhead_s",
        "c_tok": "2 * streamed_parameters / (peak_bf16_flops * flop_efficiency)",
        "c_other": "kv_bytes_per_token / (peak_bandwidth * mem_efficiency)",
        "sources": "model shapes: the HF config.json of each model; cards: NVIDIA datasheets (dense bf16, "
                   "no sparsity); efficiencies and overhead: assumed, see dasrl_lab/sim/profiles.py",
    })


SHIPPED = ("qwen2.5-7b-h100", "qwen2.5-32b-h200", "qwen2.5-1.5b-l4")
"""The 32B model goes on an H200: in bf16 its 65 GB of weights leave an 80 GB H100 too little KV room for
a step of long reasoning rollouts."""


def shipped() -> list[Profile]:
    return [derive(*name.rsplit("-", 1)) for name in SHIPPED]


def measured(name: str, latency: LatencyModel, source: str) -> Profile:
    return Profile(name, latency, "measured", {"source": source})
