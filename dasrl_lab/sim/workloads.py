"""Synthetic long-tail RL rollout workloads, for tests and paper-scale what-ifs (docs/simulator.md).

Each problem owns *slots* of alternative *segments* (reasoning moves), often after a phrase from a bank
shared by every problem: the boilerplate that makes one global index ambiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from dasrl.policy import CPU_LATENCY, LatencyModel, GPU_LATENCY
from dasrl_lab.trace import Response


@dataclass(frozen=True)
class WorkloadConfig:
    """A synthetic workload: problems x samples per step, for a number of RL steps."""

    problems: int = 16
    """Distinct prompts per step (the same prompts every step, as in RL epochs)."""
    samples: int = 8
    """Responses per problem per step (GRPO group size)."""
    steps: int = 4
    """RL steps (epochs) in the trace."""
    vocab: int = 4096
    """Vocabulary size; token ids are in [0, vocab)."""
    max_len: int = 2048
    """Length limit: runaway generations stop here with finish_reason 'length'."""
    prompt_len: int = 48
    """Prompt length in tokens."""
    median_len: float = 300.0
    """Median response length across problems."""
    problem_sigma: float = 0.7
    """Log-normal sigma of the per-problem median length."""
    sample_sigma: float = 0.4
    """Log-normal sigma of a sample's length around its problem's median."""
    runaway: float = 0.01
    """Probability that a sample runs away (loops) to max_len."""
    variants: int = 3
    """Alternative segments per slot."""
    zipf: float = 1.5
    """Skew of the choice among alternatives (weight 1/(rank+1)**zipf)."""
    shared_frac: float = 0.5
    """Fraction of segments that start with a phrase from the shared bank."""
    bank: int = 48
    """Phrases in the shared bank."""
    phrase_len: tuple[int, int] = (24, 96)
    """Length range of a shared phrase."""
    segment_len: tuple[int, int] = (8, 48)
    """Length range of a problem-specific segment."""
    content_vocab: int = 0
    """Problem-specific segments draw from the first content_vocab ids (0 = the whole vocab): a small
    one (digits, variables) makes short contexts ambiguous across problems."""
    drift: float = 0.05
    """Per step, probability that an alternative is replaced by a fresh one."""
    length_drift: float = 0.05
    """Per step, log-normal sigma of the change of each problem's median length."""
    noise: float = 0.005
    """Per-token probability of a random substitution in a sample."""
    seed: int = 0
    """Random seed: the same config gives the same trace."""

    def __post_init__(self) -> None:
        for name in ("problems", "samples", "steps", "vocab", "max_len", "prompt_len", "variants", "bank"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload {name} must be >= 1, got {getattr(self, name)}")
        for name in ("runaway", "shared_frac", "drift", "noise"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"workload {name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("phrase_len", "segment_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"workload {name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        if self.median_len <= 0:
            raise ValueError(f"median_len must be > 0, got {self.median_len}")

    def scaled(self, factor: float) -> "WorkloadConfig":
        """The same shape with lengths (median, max, segments) scaled by factor: quick what-ifs."""
        f = float(factor)
        if f <= 0:
            raise ValueError(f"scale must be > 0, got {factor}")
        return replace(self, max_len=max(8, int(self.max_len * f)), median_len=self.median_len * f)


@dataclass(frozen=True)
class Workload:
    """A named workload and the latency it assumes."""

    config: WorkloadConfig
    """What to generate."""
    latency: LatencyModel
    """The forward cost the workload's numbers assume."""
    description: str = ""
    """One line on what it models."""


# The paper setting's latency: Qwen2.5-7B bf16 on an H100 (profiles.derive; assumed until a device measures it).
PAPER_LATENCY = GPU_LATENCY

WORKLOADS: dict[str, Workload] = {
    "tiny": Workload(WorkloadConfig(problems=6, samples=4, steps=3, vocab=512, max_len=256, median_len=60,
                                    phrase_len=(8, 24), segment_len=(4, 16), bank=12),
                     PAPER_LATENCY, "unit-test size: 6 problems x 4 samples, 3 steps"),
    "drift": Workload(WorkloadConfig(problems=12, samples=8, steps=5, vocab=1024, max_len=1024, median_len=160,
                                     drift=0.1, shared_frac=0.8, phrase_len=(32, 96), segment_len=(6, 24),
                                     bank=16),
                      PAPER_LATENCY, "drifting, boilerplate-heavy: 12 problems x 8 samples, 5 steps"),
    "long-tail": Workload(WorkloadConfig(problems=32, samples=16, steps=4, max_len=4096, median_len=500,
                                         problem_sigma=0.8, sample_sigma=0.5, runaway=0.02),
                          PAPER_LATENCY, "long tail at a quarter of the paper's scale: 32 x 16, 4K max"),
    "skewed": Workload(WorkloadConfig(problems=32, samples=16, steps=4, max_len=4096, median_len=400,
                                      problem_sigma=1.0, sample_sigma=0.25, runaway=0.0),
                       PAPER_LATENCY, "predictable per-problem lengths (long problems stay long), no runaways"),
    "paper-math": Workload(WorkloadConfig(problems=128, samples=16, steps=4, max_len=16384, median_len=2500,
                                          problem_sigma=0.6, sample_sigma=0.5, runaway=0.01),
                           PAPER_LATENCY, "the paper's math setting: 128 x 16, 16K max (7B-on-H100 latency)"),
}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; valid workloads: {', '.join(WORKLOADS)}") from None


class _Problem:
    def __init__(self, cfg: WorkloadConfig, rng: np.random.Generator, bank: list[np.ndarray]) -> None:
        self.cfg, self.rng, self.bank = cfg, rng, bank
        self.prompt = rng.integers(0, cfg.vocab, cfg.prompt_len, dtype=np.int32)
        self.median = cfg.median_len * float(np.exp(rng.normal(0, cfg.problem_sigma)))
        self.slots: list[list[np.ndarray]] = []

    def _segment(self) -> np.ndarray:
        c, r = self.cfg, self.rng
        hi = c.content_vocab or c.vocab
        own = r.integers(0, hi, int(r.integers(c.segment_len[0], c.segment_len[1] + 1)), dtype=np.int32)
        if r.random() < c.shared_frac:
            return np.concatenate([self.bank[int(r.integers(len(self.bank)))], own])
        return own

    def _slot(self, i: int) -> list[np.ndarray]:
        while len(self.slots) <= i:
            self.slots.append([self._segment() for _ in range(self.cfg.variants)])
        return self.slots[i]

    def drift(self) -> None:
        c, r = self.cfg, self.rng
        for alts in self.slots:
            for v in range(len(alts)):
                if r.random() < c.drift:
                    alts[v] = self._segment()
        self.median *= float(np.exp(r.normal(0, c.length_drift)))

    def sample(self) -> tuple[np.ndarray, str]:
        c, r = self.cfg, self.rng
        runaway = r.random() < c.runaway
        natural = int(np.clip(round(self.median * np.exp(r.normal(0, c.sample_sigma))), 1, c.max_len))
        target = c.max_len if runaway else natural
        w = 1.0 / np.arange(1, c.variants + 1) ** c.zipf
        w /= w.sum()
        parts, n, i = [], 0, 0
        while n < natural:
            seg = self._slot(i)[int(r.choice(c.variants, p=w))]
            parts.append(seg)
            n += len(seg)
            i += 1
        out = np.concatenate(parts)[:natural]
        if runaway and len(out) < target:  # a loop on the last segment until the limit
            loop = parts[-1]
            out = np.concatenate([out, np.tile(loop, (target - len(out)) // len(loop) + 1)])[:target]
        flip = r.random(len(out)) < c.noise
        out = out.copy()
        out[flip] = r.integers(0, c.vocab, int(flip.sum()), dtype=np.int32)
        return out, ("length" if len(out) >= c.max_len else "stop")


def generate(cfg: WorkloadConfig) -> list[Response]:
    """The whole trace of the workload, step by step (deterministic in cfg.seed)."""
    rng = np.random.default_rng(cfg.seed)
    bank = [rng.integers(0, cfg.vocab, int(rng.integers(cfg.phrase_len[0], cfg.phrase_len[1] + 1)), dtype=np.int32)
            for _ in range(cfg.bank)]
    problems = [_Problem(cfg, rng, bank) for _ in range(cfg.problems)]
    out: list[Response] = []
    for step in range(cfg.steps):
        if step:
            for p in problems:
                p.drift()
        for pid, p in enumerate(problems):
            for s in range(cfg.samples):
                toks, reason = p.sample()
                out.append(Response(step, pid, s, p.prompt, toks, float(rng.random() < 0.5), reason))
    return out
