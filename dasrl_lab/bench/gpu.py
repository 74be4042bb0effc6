"""`dasrl bench gpu` (and scripts/gpu-check.sh): the engine on a device, with no weights and no network
(docs/benchmarks.md, "GPU check"). Three parts, each written to the JSON as soon as it is done (a timeout
keeps what finished): (a) the exactness ladder with a random small Llama, fp32 required token for token, bf16
reported (its kernels may round differently at other forward shapes); (b) calibration of the packed forward
for random models of Qwen2.5-1.5B and -7B shapes in bf16; (c) the simulator's paper-math what-if (scaled)
priced with the measured 7B-shape latency model beside the assumed one. `tiny=True` shrinks every shape (the
CPU test of this path). Every number in the JSON is measured or simulated in the run that writes it.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np

SHAPES = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab, tie_word_embeddings) of the HF configs
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064, False),
}
TINY_SHAPES = {
    "qwen2.5-1.5b": (64, 2, 4, 2, 128, 512, True),
    "qwen2.5-7b": (96, 2, 6, 2, 192, 512, False),
}


@dataclass(frozen=True)
class GPUCheckConfig:
    """What `dasrl bench gpu` runs."""

    device: str = "cuda"
    """Where the models run: cpu | cuda | cuda:N."""
    tiny: bool = False
    """Tiny shapes, grid and workload (the CPU test of this path; minutes become seconds)."""
    threads: int | None = None
    """torch intra-op threads (None = the cores available)."""
    parts: tuple[str, ...] = ("ladder", "calibrate", "whatif")
    """Which parts to run, in order."""
    seed: int = 0
    """Seed of the random weights and prompts."""

    def __post_init__(self) -> None:
        bad = sorted(set(self.parts) - {"ladder", "calibrate", "whatif"})
        if bad or not self.parts:
            raise ValueError(f"unknown or no parts {bad or list(self.parts)}; valid: ladder, calibrate, whatif")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


def random_model(kind: str, shape: tuple, *, dtype, device, seed: int):
    """A randomly initialised causal LM of `shape` (see SHAPES) on `device`: kind 'llama' or 'qwen2'."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    hidden, layers, heads, kv, inter, vocab, tie = shape
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[kind]
    cfg = cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
              tie_word_embeddings=tie)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


# ------------------------------------------------------------------------------------------ (a) ladder
def _compare(plain, spec) -> dict:
    """Token-for-token comparison of two lists of completions, with the first divergence."""
    first = None
    for i, (a, b) in enumerate(zip(plain, spec)):
        if a.token_ids != b.token_ids:
            pos = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                       min(len(a.token_ids), len(b.token_ids)))
            first = {"request": i, "position": pos}
            break
    return {"identical": first is None, "first_divergence": first,
            "drafted": sum(c.drafted for c in spec), "accepted": sum(c.accepted for c in spec)}


def ladder(cfg: GPUCheckConfig, dtype_name: str, log: Callable[[str], None]) -> list[dict]:
    """Speculative vs plain decoding on the device for every (sampler, drafter, budget); rows of results."""
    import torch

    from dasrl.drafter import DraftParams, DraftStore, StoreConfig
    from dasrl.engine import EngineConfig, SamplingParams, SpecEngine, default_threads
    from dasrl.policy import FixedBudget
    from dasrl_lab.drafters.baselines import NGramDrafter, OracleDrafter

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    shape = (64, 2, 4, 2, 128, 256, False) if cfg.tiny else (512, 4, 8, 2, 1536, 4096, False)
    model = random_model("llama", shape, dtype=dtype, device=cfg.device, seed=cfg.seed)
    engine = SpecEngine(model, config=EngineConfig(num_threads=cfg.threads or default_threads()))
    rng = np.random.default_rng(cfg.seed)
    n_req, new = (3, 12) if cfg.tiny else (8, 48)
    prompts = [rng.integers(0, shape[5], int(rng.integers(4, 12))).tolist() for _ in range(n_req)]
    seeds = list(range(100, 100 + n_req))
    samplers = {"greedy": SamplingParams(temperature=0.0),
                "sampled": SamplingParams(temperature=0.8, top_p=0.9, top_k=50)}
    kw = dict(max_new_tokens=new, ignore_eos=True, seeds=seeds)
    rows = []

    def add(sname: str, dname: str, k: int, plain, spec) -> None:
        rows.append({"dtype": dtype_name, "sampler": sname, "drafter": dname, "budget": k, **_compare(plain, spec)})

    for sname, sp in samplers.items():
        plain = engine.generate(prompts, sampling=sp, **kw)
        futures = {i: c.token_ids for i, c in enumerate(plain)}
        noisy = {i: [(t + 1) % shape[5] if j % 5 == 3 else t for j, t in enumerate(toks)]
                 for i, toks in futures.items()}  # every 5th token wrong: rejections are exercised
        for dname, branching in (("das-chain", 1), ("das-tree", 2)):
            for k in (4, 16):
                store = DraftStore(StoreConfig(params=DraftParams(branching=branching), vocab_size=shape[5]))
                # epoch 1 (history, no drafts), odd requests under other seeds: sampled, their history
                # differs from epoch 2 (rejections), the even ones' matches it (acceptances)
                engine.generate(prompts, sampling=sp, drafter=store,
                                **{**kw, "seeds": [s + 7 * (i % 2) for i, s in enumerate(seeds)]})
                store.end_step()
                add(sname, dname, k, plain, engine.generate(prompts, sampling=sp, drafter=store,
                                                            policy=FixedBudget(k), **kw))
        for dname, fut in (("oracle", futures), ("oracle-noisy", noisy)):
            for k in (1, 4, 16):
                add(sname, dname, k, plain, engine.generate(prompts, sampling=sp, drafter=OracleDrafter(fut),
                                                            policy=FixedBudget(k), **kw))
        add(sname, "ngram", 8, plain, engine.generate(prompts, sampling=sp, drafter=NGramDrafter(),
                                                      policy=FixedBudget(8), **kw))
    for r in rows:
        r["vacuous"] = r["accepted"] == 0 and r["drafter"] != "ngram"  # equality with nothing accepted proves nothing
        log(f"ladder {r['dtype']} {r['sampler']:<7} {r['drafter']:<12} k={r['budget']:<2} "
            f"{'identical' if r['identical'] else 'DIFFERS at ' + str(r['first_divergence'])} "
            f"(accepted {r['accepted']}/{r['drafted']})")
    return rows


# ------------------------------------------------------------------------------------------ (b) calibrate
def calibrate_shape(cfg: GPUCheckConfig, name: str, log: Callable[[str], None]) -> dict:
    """Fit the packed forward's latency for a random model of SHAPES[name] in bf16 on the device."""
    import torch

    from dasrl.engine import EngineConfig, SpecEngine, default_threads
    from dasrl.policy import LatencyModel
    from dasrl_lab.bench.engine import CalibrationGrid, calibrate, fit_latency, packed_vs_padded

    shape = (TINY_SHAPES if cfg.tiny else SHAPES)[name]
    t0 = time.perf_counter()
    model = random_model("qwen2", shape, dtype=torch.bfloat16, device=cfg.device, seed=cfg.seed)
    if torch.device(cfg.device).type == "cuda":
        torch.cuda.synchronize(cfg.device)
    build_s = time.perf_counter() - t0
    engine = SpecEngine(model, config=EngineConfig(num_threads=cfg.threads or default_threads()))
    grid = (CalibrationGrid(batch_sizes=(1, 2), tokens_per_row=(1, 4), contexts=(16, 32), repeats=1) if cfg.tiny
            else CalibrationGrid(batch_sizes=(1, 8, 32, 128), tokens_per_row=(1, 2, 4, 8, 16),
                                 contexts=(256, 1024), repeats=5))
    samples = calibrate(engine, grid)
    fitted, err = fit_latency(samples)
    n = [s["n_tokens"] for s in samples]
    secs = [s["seconds"] for s in samples]
    linear = LatencyModel.fit(n, secs)
    rows, draft, ctx = (4, 3, 16) if cfg.tiny else (32, 16, 256)
    pv = packed_vs_padded(engine, fitted, rows=rows, draft=draft, context=ctx, repeats=grid.repeats)
    out = {"shape": dict(zip(("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "tied"), shape)),
           "params": int(sum(p.numel() for p in model.parameters())), "dtype": "bf16",
           "build_s": round(build_s, 2), "grid": asdict(grid), "samples": samples,
           "latency": fitted.to_dict(), "fit_mean_rel_error": err,
           "latency_linear": linear.to_dict(), "fit_mean_rel_error_linear": linear.mean_rel_error(n, secs),
           "c_base_over_c_tok": fitted.c_base / fitted.c_tok if fitted.c_tok > 0 else None, "packed_vs_padded": pv}
    log(f"calibrate {name} ({out['params'] / 1e9:.2f}B params, bf16): c_base {fitted.c_base * 1e3:.2f} ms, "
        f"c_tok {fitted.c_tok * 1e6:.1f} us, c_other {fitted.c_other * 1e9:.2f} ns/row-ctx token, c_draft_kv "
        f"{fitted.c_draft_kv * 1e9:.2f} ns/drafting-row ctx token, fit error "
        f"{err:.1%} (linear {out['fit_mean_rel_error_linear']:.1%}); packed {pv['packed_s'] * 1e3:.1f} ms vs padded "
        f"{pv['padded_s'] * 1e3:.1f} ms")
    del engine, model
    if cfg.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------ (c) what-if
def whatif(cfg: GPUCheckConfig, latency: dict | None, log: Callable[[str], None]) -> dict:
    """The paper-math workload (scaled) simulated with no speculation and DAS, priced by the measured
    latency model (when there is one) and by the assumed PAPER_LATENCY."""
    from dasrl.policy import LatencyModel
    from dasrl_lab.sim.simulator import SimConfig, simulate
    from dasrl_lab.sim.workloads import PAPER_LATENCY, generate, get_workload

    name = "tiny" if cfg.tiny else "paper-math"
    wl = get_workload(name).config
    if not cfg.tiny:  # a quarter of the problems, an eighth of the lengths, two steps: minutes, not hours
        wl = replace(wl.scaled(0.125), problems=32, steps=2)
    t0 = time.perf_counter()
    responses = generate(wl)
    models = {"assumed": PAPER_LATENCY}
    if latency is not None:
        models["measured"] = LatencyModel.from_dict(latency, source="measured latency")
    out = {"workload": name, "config": asdict(wl), "responses": len(responses), "runs": {}}
    for src, lat in models.items():
        sc = SimConfig(latency=lat, warmup=1)
        base = simulate(responses, drafter="none", policy="none", config=sc).total
        das = simulate(responses, drafter="das", policy="das", config=sc).total
        out["runs"][src] = {"latency": lat.to_dict(), "none_s": base.makespan, "das_s": das.makespan,
                            "speedup": base.makespan / das.makespan if das.makespan else None,
                            "accepted_per_row_forward": das.accepted_per_row_forward}
        log(f"what-if {name} ({src} latency): none {base.makespan:.1f} s, das {das.makespan:.1f} s, "
            f"{out['runs'][src]['speedup']:.2f}x")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


# ------------------------------------------------------------------------------------------ driver
def environment(device: str) -> dict:
    import torch
    import transformers

    env = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "machine": platform.machine(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
        env["cuda"] = torch.version.cuda
    return env


def run(cfg: GPUCheckConfig, json_path: Path | None, log: Callable[[str], None] = print) -> dict:
    """Run the parts of `cfg`, writing the document to json_path after each; returns it. doc['ok'] is False
    when an fp32 ladder row differs or is vacuous, or a part failed."""
    import torch

    from dasrl_lab.models import resolve_device

    dev = resolve_device(cfg.device)
    cfg = replace(cfg, device=str(dev))
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    doc: dict = {"format": "dasrl-gpu-check/1", "config": asdict(cfg), "environment": environment(cfg.device),
                 "errors": {}}

    def save() -> None:
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = json_path.with_name(f".{json_path.name}.tmp")
            tmp.write_text(json.dumps(doc, indent=1, default=float))
            tmp.replace(json_path)

    def part(name: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        try:
            doc[name] = fn()
        except Exception as exc:  # a part's failure is recorded; the others still run
            doc["errors"][name] = f"{type(exc).__name__}: {exc}"
            log(f"{name} FAILED: {doc['errors'][name]}")
        doc.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        save()

    if "ladder" in cfg.parts:
        part("ladder", lambda: {d: ladder(cfg, d, log) for d in ("fp32", "bf16")})
    if "calibrate" in cfg.parts:
        part("calibrate", lambda: {name: calibrate_shape(cfg, name, log) for name in SHAPES})
    if "whatif" in cfg.parts:
        lat = doc.get("calibrate", {}).get("qwen2.5-7b", {}).get("latency")
        part("whatif", lambda: whatif(cfg, lat, log))
    fp32 = doc.get("ladder", {}).get("fp32", [])
    rejected = sum(r["drafted"] - r["accepted"] for r in fp32)  # the rejection path was exercised too
    doc["ladder_fp32_exact"] = bool(fp32) and rejected > 0 and all(r["identical"] and not r["vacuous"] for r in fp32)
    doc["ok"] = not doc["errors"] and ("ladder" not in cfg.parts or doc["ladder_fp32_exact"])
    save()
    return doc


def register(app, bench) -> None:
    import typer

    from dasrl_lab.cli_args import between, max_threads, output_file, user_errors

    @bench.command("gpu")
    def gpu_cmd(
        device: str = typer.Option("cuda", help="cpu | cuda | cuda:N."),
        tiny: bool = typer.Option(False, help="Tiny shapes (the CPU test of this path)."),
        threads: int = typer.Option(0, help="torch threads (0 = the cores available).",
                                    callback=between(0, max_threads())),
        parts: str = typer.Option("ladder,calibrate,whatif", help="Comma-separated parts to run."),
        json_out: Optional[Path] = typer.Option(None, "--json", callback=output_file,
                                                help="Write the results here (default: $OUT/gpu-check.json when "
                                                     "$OUT is set)."),
    ) -> None:
        """The engine on a device with random weights: exactness ladder, calibration of the Qwen2.5-1.5B/7B
        shapes (bf16), the paper-math what-if with the measured latency (scripts/gpu-check.sh)."""
        import os

        with user_errors():
            cfg = GPUCheckConfig(device=device, tiny=tiny, threads=threads or None,
                                 parts=tuple(p.strip() for p in parts.split(",") if p.strip()))
        path = json_out or (Path(os.environ["OUT"]) / "gpu-check.json" if os.environ.get("OUT") else None)
        try:
            doc = run(cfg, path, log=print)
        except ValueError as e:  # a bad device
            raise typer.BadParameter(str(e), param_hint="'--device'") from None
        print(f"ok: {doc['ok']} (fp32 ladder exact: {doc['ladder_fp32_exact']}; errors: {doc['errors'] or 'none'})"
              + (f"; wrote {path}" if path else ""))
        raise typer.Exit(0 if doc["ok"] else 1)


if __name__ == "__main__":
    import typer as _typer

    _app, _bench = _typer.Typer(), _typer.Typer()
    register(_app, _bench)
    _bench()
