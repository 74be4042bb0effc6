"""The shared collection run: a GRPO loop on the embedded model (the demo's pieces) that records every
step's rollouts to a Parquet trace and, on some steps, rolls the same prompts out again with each engine
variant (same weights and seeds), which must reproduce the baseline's tokens exactly: the numbers behind
experiments 1, 8 and 9. On the other steps each variant session takes the baseline's rollouts into its
history (RolloutSession.record), as if it had run every step. Cached under <out>/collect-<key>/."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from dasrl.atomic import MAX_JSON_BYTES, read_json, write_json
from dasrl.drafter import DraftParams, Drafter, StoreConfig
from dasrl.engine import SamplingParams
from dasrl.policy import POLICIES, BudgetPolicy, ClassCaps
from dasrl.rollout import Rollout, RolloutSession, SessionConfig, StepSummary, speculation_policy
from dasrl_lab.demo.grpo import GRPOConfig, GRPOTrainer, advantages
from dasrl_lab.demo.run import score, step_batch, trace_rows
from dasrl_lab.drafters.baselines import NGramDrafter, OracleDrafter
from dasrl_lab.experiments.machine import load_avg
from dasrl_lab.policies import make_lab_policy
from dasrl_lab.tasks import preset
from dasrl_lab.trace import Trace, TraceWriter, read_trace

FORMAT = "dasrl-experiments-collect/3"
UNBOUNDED_CAP = ClassCaps().long
"""Draft cap of the unbounded variant: the most DAS ever gives a request (its long class)."""
NO_ALLOWANCE = 1 << 20
"""draft_allowance that never binds (the paper's unbounded drafting has no per-forward cap)."""


@dataclass(frozen=True)
class CollectConfig:
    """The GRPO run the experiments share."""

    preset: str = "math"
    """Task set (dasrl_lab/tasks.py): math (CHAMP statements) | enumerations (a toy long tail) | short."""
    model: str = "smollm2-135m"
    """Model: the embedded default, a local HF folder, or a hub id (online only)."""
    steps: int = 24
    """GRPO steps (every prompt comes back each step)."""
    prompts: int = 6
    """Distinct problems."""
    samples: int = 6
    """Samples per problem (GRPO group size)."""
    max_new_tokens: int = 512
    """Generation limit per sample."""
    temperature: float | None = None
    """Sampling temperature; None = the preset's."""
    top_p: float | None = None
    """Nucleus sampling mass; None = the preset's."""
    seed: int = 0
    """Run seed (tasks, sample seeds)."""
    variant_every: int = 8
    """The engine variants run on steps every-1, 2*every-1, ... (each with history before it)."""
    grpo: GRPOConfig = field(default_factory=lambda: GRPOConfig(lr=2e-5))
    """Policy update after each step."""

    def __post_init__(self) -> None:
        for name in ("steps", "prompts", "samples", "max_new_tokens", "variant_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"collect {name} must be >= 1, got {getattr(self, name)}")
        if self.variant_every > self.steps:
            raise ValueError(f"variant_every ({self.variant_every}) > steps ({self.steps}): no variant step")

    @staticmethod
    def quick(model: str = "smollm2-135m") -> "CollectConfig":
        return CollectConfig(model=model, steps=3, prompts=3, samples=3, max_new_tokens=48, variant_every=3)

    def sampling(self) -> SamplingParams:
        p = preset(self.preset)
        return SamplingParams(temperature=p.temperature if self.temperature is None else self.temperature,
                              top_p=p.top_p if self.top_p is None else self.top_p)

    @property
    def variant_steps(self) -> list[int]:
        return [s for s in range(self.steps) if (s + 1) % self.variant_every == 0]

    def key(self) -> str:
        return hashlib.blake2b(json.dumps(asdict(self), sort_keys=True).encode(), digest_size=6).hexdigest()


@dataclass(frozen=True)
class Variant:
    """One engine configuration rolled out next to the baseline."""

    name: str
    """Short name (figures, JSON)."""
    description: str
    """One line for docs/results.md."""
    policy: str = "das"
    """Budget policy (make_lab_policy name; a lab policy runs as itself, unpriced)."""
    policy_kw: tuple[tuple[str, object], ...] = ()
    """Its keyword arguments."""
    store: StoreConfig = StoreConfig()
    """History drafter (used when `drafter` is None)."""
    drafter: Callable[[], Drafter] | None = None
    """Another drafter instead of the DraftStore."""
    allowance: bool = True
    """Keep the session's per-forward draft allowance (False: drafts are never clipped by it)."""
    oracle: bool = False
    """A fresh OracleDrafter per step, told the baseline's outputs of that step."""

    def session_config(self, seed: int) -> SessionConfig:
        # counting=False: the variants compare history drafters, as the paper does and validate-sim replays.
        # fit_latency=False: one fixed price model, so the simulator can replay the session draft for draft.
        return SessionConfig(speculate=True, policy=self.policy if self.policy in POLICIES else "das",
                             policy_kw=self.policy_kw if self.policy in POLICIES else (), store=self.store,
                             seed=seed, draft_allowance=None if self.allowance else NO_ALLOWANCE, counting=False,
                             fit_latency=False)

    def session(self, model, tokenizer, seed: int) -> RolloutSession:
        drafter = self.drafter() if self.drafter else (OracleDrafter({}) if self.oracle else None)
        return RolloutSession(model, tokenizer, self.session_config(seed), drafter=drafter,
                              policy=self.session_policy(seed))

    def session_policy(self, seed: int) -> BudgetPolicy:
        """The library's policy by name (the session's own), or the lab's as itself (validate-sim's too)."""
        if self.policy in POLICIES:
            return speculation_policy(self.session_config(seed))
        return make_lab_policy(self.policy, **dict(self.policy_kw))


ARCTIC_STORE = StoreConfig(mode="global", window=0, decay=1.0, params=DraftParams(max_match=24, min_prob=0.1))
"""ArcticInference / vLLM `suffix`: one global tree of every past response (never evicted, full weight)
plus the live requests, matching <= 24 tokens, branches cut below path probability 0.1 (its defaults)."""

VARIANTS: tuple[Variant, ...] = (
    Variant("unbounded", f"DAS drafter, every request drafts as far as its match goes up to {UNBOUNDED_CAP} "
            "tokens (DAS's long-class cap) from the first token, no per-forward allowance",
            policy="unbounded", policy_kw=(("limit", UNBOUNDED_CAP),), allowance=False),
    Variant("das", "DAS: per-problem history drafter (problem+request, window 16) + length-aware budgets"),
    Variant("global", "ArcticInference-style global suffix tree (all history, one tree), DAS budgets",
            store=ARCTIC_STORE),
    Variant("ngram", "n-gram prompt lookup (vLLM `ngram`), DAS budgets", drafter=NGramDrafter),
    Variant("oracle", "oracle drafter (knows the step's outputs), DAS budgets", oracle=True),
)
BASELINE = "none"


def summary_dict(s: StepSummary, shapes: list[list[int]], forward_times: list[float], points: int = 300) -> dict:
    """What the experiments keep of one rollout: totals, the batch curve, each forward's shape (for the
    latency model) and where the time went (so validate-sim can tell the model's error from the overhead)."""
    curve = s.batch_curve
    if len(curve) > points:
        idx = sorted({round(i * (len(curve) - 1) / (points - 1)) for i in range(points)})
        curve = [curve[i] for i in idx]
    return {"rollout_s": round(s.rollout_s, 4), "forwards": s.forwards, "row_forwards": s.row_forwards,
            "new_tokens": s.new_tokens, "drafted": s.drafted, "accepted": s.accepted,
            "tokens_per_row_forward": round(s.tokens_per_row_forward, 4),
            "batch_curve": [[round(t, 4), int(b)] for t, b in curve], "shapes": shapes,
            "draft_s": round(s.draft_s, 4), "verify_s": round(s.verify_s, 4), "forward_s": round(s.forward_s, 4),
            "forward_times": [round(t, 5) for t in forward_times]}


@dataclass
class Collection:
    """A finished collection run: its config, folder, per-step records and the trace."""

    config: CollectConfig
    folder: Path
    steps: list[dict]
    """One record per step: step, train_s, loss, mean_reward, load, baseline, variants {name: summary}."""
    wall_s: float

    def trace(self) -> Trace:
        return read_trace(self.folder / "trace")

    def variant_steps(self) -> list[dict]:
        return [s for s in self.steps if s["variants"]]


def _check_identical(name: str, step: int, ref: list[Rollout], out: list[Rollout]) -> None:
    for i, (a, b) in enumerate(zip(ref, out)):
        if a.completion_ids != b.completion_ids:
            raise RuntimeError(f"variant {name!r} changed the output of sample {i} (problem {a.problem_id}, "
                               f"sample {a.sample}) on step {step}: speculation must be lossless")


def ensure_collection(cfg: CollectConfig, ctx) -> Collection:
    """The cached collection for cfg under ctx.options.out, running it when there is none."""
    folder = Path(ctx.options.out) / f"collect-{cfg.key()}"
    meta = folder / "collect.json"
    if meta.exists():
        doc = read_json(meta, MAX_JSON_BYTES, follow_symlinks=True)
        if doc.get("format") == FORMAT and doc.get("key") == cfg.key() and doc.get("complete", True):
            ctx.console.print(f"collection: reusing {folder}")
            return Collection(cfg, folder, doc["steps"], doc["wall_s"])
    if folder.exists():  # an interrupted run of ours (its partial collect.json kept what it measured): start over
        shutil.rmtree(folder)
    return run_collection(cfg, ctx, folder)


def _doc(cfg: CollectConfig, records: list[dict], wall: float, *, complete: bool) -> dict:
    return {"format": FORMAT, "key": cfg.key(), "config": asdict(cfg), "complete": complete,
            "variants": {v.name: v.description for v in VARIANTS}, "steps": records, "wall_s": round(wall, 1)}


def run_collection(cfg: CollectConfig, ctx, folder: Path) -> Collection:
    import torch

    model, tok = ctx.model()
    torch.manual_seed(cfg.seed)
    t_start = time.perf_counter()
    tasks = preset(cfg.preset).tasks(cfg.prompts, seed=cfg.seed)
    prompts, answers, pids = step_batch(tok, tasks, cfg.samples)
    sampling = cfg.sampling()
    base = RolloutSession(model, tok, SessionConfig(speculate=False, seed=cfg.seed))
    sessions = {v.name: v.session(model, tok, cfg.seed) for v in VARIANTS}
    trainer = GRPOTrainer(model, cfg.grpo)
    trace = TraceWriter(folder / "trace", vocab_size=int(model.get_output_embeddings().weight.shape[0]))
    records: list[dict] = []
    total = (cfg.steps + len(cfg.variant_steps) * len(VARIANTS)) * len(prompts)
    ctx.console.print(f"collection: {cfg.steps} GRPO steps of {cfg.prompts} prompts x {cfg.samples} samples "
                      f"(<= {cfg.max_new_tokens} tokens); engine variants on steps {cfg.variant_steps}")
    with ctx.progress("collecting rollouts", total) as advance:
        for step in range(cfg.steps):
            def roll(name: str, sess: RolloutSession, seeds=None) -> tuple[list[Rollout], dict]:
                seen, shapes, times = [0], [], []

                def tick(info) -> None:
                    advance(info.finished, note=f"step {step} {name}: {info.batch_size} live")
                    seen[0] += info.finished
                    shapes.append([info.batch_size, info.tokens, info.kv_tokens, info.draft_kv_tokens])  # its cost
                    times.append(info.forward_s)

                out = sess.generate(prompts, problem_ids=pids, seeds=seeds, sampling=sampling,
                                    max_new_tokens=cfg.max_new_tokens, on_step=tick,
                                    stop_lines=preset(cfg.preset).stop_lines)
                advance(len(prompts) - seen[0])
                return out, summary_dict(sess.history[-1], shapes, times)

            rec = {"step": step, "load": load_avg()}
            ref, rec["baseline"] = roll(BASELINE, base)
            rec["variants"] = {}
            seeds = [r.seed for r in ref]
            for v in VARIANTS:
                sess = sessions[v.name]
                if step in cfg.variant_steps:
                    if v.oracle:
                        sess.drafter = OracleDrafter({(sess.step, i): r.completion_ids for i, r in enumerate(ref)})
                    out, rec["variants"][v.name] = roll(v.name, sess, seeds)
                    _check_identical(v.name, step, ref, out)
                else:
                    sess.record(ref)
            rewards = score(tok, ref, answers, step=step)
            t0 = time.perf_counter()
            rec["loss"] = trainer.step(prompts, [r.completion_ids for r in ref], advantages(rewards, pids))
            rec["train_s"] = round(time.perf_counter() - t0, 3)
            rec["mean_reward"] = sum(rewards) / len(rewards)
            rec["load_after"] = load_avg()
            trace.write_step(trace_rows(step, ref, rewards))
            for sess in (base, *sessions.values()):
                sess.end_step()
            records.append(rec)
            # After every step, so a run cut short (killed, out of memory) keeps what it measured:
            # validate-sim reads a partial run; ensure_collection reuses only a complete one.
            write_json(folder / "collect.json", _doc(cfg, records, time.perf_counter() - t_start, complete=False),
                       indent=None)
            var = "  ".join(f"{k} {v['rollout_s']:.1f}s" for k, v in rec["variants"].items())
            ctx.console.print(f"step {step}: baseline {rec['baseline']['rollout_s']:.1f}s, train "
                              f"{rec['train_s']:.1f}s{'  ' + var if var else ''}  "
                              f"(load {rec['load'][0] if rec['load'] else '?'})")
    wall = time.perf_counter() - t_start
    write_json(folder / "collect.json", _doc(cfg, records, wall, complete=True), indent=None)
    ctx.console.print(f"collection: {cfg.steps} steps in {wall / 60:.1f} min -> {folder}")
    return Collection(cfg, folder, records, wall)
