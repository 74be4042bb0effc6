"""Simulator vs engine on a recorded collection run: `dasrl validate-sim RUN`.

A collection run (dasrl_lab.experiments.collect) keeps every step's baseline rollouts (the trace) and measured
rollout time; on its variant steps, the same for each engine variant with its forward shapes and drafted /
accepted counts. The replay gives the simulator what each variant's session had: its drafter, its policy object
(`Variant.session_policy`), its history (record() on the steps without variants), the engine's batching. Both
are lossless replays of the same tokens, so drafted and accepted tokens and forwards must agree exactly
(`exact`). The prediction prices each forward with a latency model plus `StepOverhead`; `priced_s` prices the
engine's own recorded forwards the same way, so a gap between predicted and priced is the replay's, a gap
between priced and measured the cost model's.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from dasrl.atomic import MAX_JSON_BYTES, read_json
from dasrl.drafter import DraftStore
from dasrl.policy import LatencyModel, nonnegative_lstsq
from dasrl_lab.experiments.collect import BASELINE, FORMAT, VARIANTS, Variant
from dasrl_lab.sim.simulator import Simulator, StepStats
from dasrl_lab.trace import read_trace


@dataclass(frozen=True)
class StepOverhead:
    """What a rollout step costs beside its forwards (seconds)."""

    per_forward: float = 0.0
    """Per engine step: sampling, verification and bookkeeping around one forward."""
    per_row_forward: float = 0.0
    """Per row in a forward (its sampler draw, its verification, its bookkeeping)."""
    per_draft_token: float = 0.0
    """Per drafted token (proposing it and building its part of the packed inputs)."""

    def predict(self, *, forwards: int, row_forwards: int, drafted: int) -> float:
        return self.per_forward * forwards + self.per_row_forward * row_forwards + self.per_draft_token * drafted

    @classmethod
    def measure(cls, rollouts: list[dict], latency: LatencyModel,
                priced: list[float] | None = None) -> "StepOverhead":
        """Fitted to recorded rollouts: the wall seconds beyond their forwards priced by `latency` (`priced`, when
        given) on forwards, row-forwards and drafted tokens (least squares relative to each rollout's time,
        coefficients >= 0): what the latency model leaves out and scales with the step's work."""
        if len(rollouts) < 3:
            raise ValueError(f"measuring the step overhead needs >= 3 recorded rollouts, got {len(rollouts)}")
        if priced is None:
            priced = [_price(latency, r["shapes"]) for r in rollouts]
        a = np.array([[r["forwards"], r["row_forwards"], r["drafted"]] for r in rollouts], dtype=np.float64)
        out = np.array([r["rollout_s"] for r in rollouts]) - np.asarray(priced, dtype=np.float64)
        w = 1.0 / np.array([r["rollout_s"] for r in rollouts])
        return cls(*(float(c) for c in nonnegative_lstsq(a * w[:, None], out * w)))


@dataclass(frozen=True)
class Row:
    """One (variant, step): the simulator's prediction next to the engine's measurement."""

    variant: str
    step: int
    predicted_s: float
    """Simulated forwards priced by the latency model, plus the step overhead."""
    measured_s: float
    """The engine's wall time for the step's rollouts."""
    priced_s: float
    """The engine's recorded forward shapes priced the same way (replay left out)."""
    error: float
    """(predicted - measured) / measured."""
    forwards: tuple[int, int]
    """(simulated, engine)."""
    drafted: tuple[int, int]
    accepted: tuple[int, int]
    forward_s: float | None = None
    """The engine's measured seconds in its forwards (None: a run recorded without engine timers)."""
    priced_forward_s: float = 0.0
    """The latency model's price of the engine's forwards alone (its error: against forward_s)."""
    overhead_s: float = 0.0
    """The step overhead in the prediction."""

    @property
    def exact(self) -> bool:
        return all(sim == engine for sim, engine in (self.forwards, self.drafted, self.accepted))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["exact"] = self.exact
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def find_collection(run: Path) -> Path:
    """The collection folder: RUN itself (it holds collect.json) or its single collect-* subfolder."""
    run = Path(run)
    if (run / "collect.json").is_file():
        return run
    found = sorted(p.parent for p in run.glob("collect-*/collect.json"))
    if not found:
        raise FileNotFoundError(f"{run}: no collect.json here or in a collect-* folder (run `dasrl experiments` "
                                f"with --out {run} first)")
    if len(found) > 1:
        raise ValueError(f"{run}: {len(found)} collection runs ({', '.join(p.name for p in found)}); "
                         f"name one of them")
    return found[0]


def _price(lat: LatencyModel, shapes) -> float:
    return float(sum(lat.price(shape) for shape in shapes))


def _simulator(variant: Variant | None, seed: int) -> Simulator:
    if variant is None:
        return Simulator(drafter="none", policy="none", label=BASELINE)
    policy = variant.session_policy(seed)  # "oracle": the simulator makes a fresh one per step
    drafter = "oracle" if variant.oracle else variant.drafter() if variant.drafter else DraftStore(variant.store)
    return Simulator(drafter=drafter, policy=policy, label=variant.name)


def _read_collect(meta: Path) -> dict:
    """collect.json with every field replay() and validate() read checked, so that a damaged or foreign file
    is one error naming it rather than a KeyError deep in the replay."""
    try:
        doc = read_json(meta, MAX_JSON_BYTES, follow_symlinks=True)
    except (OSError, ValueError) as e:  # ValueError: bad JSON or UTF-8, a FIFO, a device
        raise ValueError(f"{meta}: not a readable JSON file ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{meta}: format {got!r}, this dasrl reads {FORMAT!r} (rerun the collection)")
    try:
        int(doc["config"]["seed"]), int(doc["config"]["max_new_tokens"])
        for rec in doc["steps"]:
            int(rec["step"])
            for m in (rec["baseline"], *rec["variants"].values()):
                [float(m[k]) for k in ("forwards", "row_forwards", "drafted", "accepted", "rollout_s")]
                [[int(x) for x in shape] for shape in m["shapes"]]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{meta}: not what `dasrl experiments` writes ({type(e).__name__}: {e})") from None
    return doc


def replay(folder: Path, *, progress: Callable[[str], None] | None = None) -> tuple[dict, dict]:
    """(collect.json, {(variant, step): StepStats}) — every variant replayed over the trace up to its last
    variant step; the baseline on every step."""
    doc = _read_collect(folder / "collect.json")
    cfg = doc["config"]
    steps = dict(read_trace(folder / "trace").by_step())
    recorded = {s["step"]: s for s in doc["steps"]}
    if not set(recorded) <= set(steps):  # a run cut short may have traced one step more than it recorded
        raise ValueError(f"{folder}: collect.json has steps {sorted(set(recorded) - set(steps))} the trace lacks")
    out: dict[tuple[str, int], StepStats] = {}
    for v in (None, *VARIANTS):
        name = BASELINE if v is None else v.name
        wanted = sorted(s for s, r in recorded.items() if v is None or name in r["variants"])
        if not wanted:
            continue
        sim = _simulator(v, cfg["seed"])
        for step in sorted(steps):
            if step > wanted[-1]:
                break
            if step in wanted:
                out[(name, step)] = sim.run_step(step, steps[step], max_new_tokens=cfg["max_new_tokens"])
            else:
                sim.record(step, steps[step])
        if progress is not None:
            progress(name)
    return doc, out


def validate(folder: Path, *, latency: LatencyModel, overhead: StepOverhead | None = StepOverhead(),
             progress: Callable[[str], None] | None = None) -> list[Row]:
    """One Row per (variant, step) of the collection in `folder`. `overhead=None`: measured from the
    run itself (StepOverhead.measure on every other recorded rollout: the predicted one is left out)."""
    doc, sims = replay(folder, progress=progress)
    recorded = [(name, rec["step"], meas) for rec in doc["steps"]
                for name, meas in [(BASELINE, rec["baseline"]), *rec["variants"].items()]]
    priced_fwd = [_price(latency, m["shapes"]) for _, _, m in recorded]  # each recorded rollout priced once
    rows = []
    for i, (name, step, meas) in enumerate(recorded):
        st = sims.get((name, step))
        if st is None:
            continue
        others = [j for j in range(len(recorded)) if j != i]
        oh = overhead if overhead is not None else StepOverhead.measure(
            [recorded[j][2] for j in others], latency, [priced_fwd[j] for j in others])
        sim_oh = oh.predict(forwards=st.forwards, row_forwards=st.row_forwards, drafted=st.proposed)
        pred = _price(latency, st.shapes) + sim_oh
        fwd_priced = priced_fwd[i]
        priced = fwd_priced + oh.predict(forwards=meas["forwards"], row_forwards=meas["row_forwards"],
                                         drafted=meas["drafted"])
        wall = meas["rollout_s"]
        rows.append(Row(name, step, pred, wall, priced, (pred - wall) / wall, (st.forwards, meas["forwards"]),
                        (st.proposed, meas["drafted"]), (st.accepted, meas["accepted"]),
                        forward_s=meas.get("forward_s"), priced_forward_s=fwd_priced, overhead_s=sim_oh))
    return rows


def summary(rows: list[Row]) -> dict:
    """Median and worst |error| of the prediction; the same for the engine's own forwards priced (the
    replay left out) and, where the engine timed them, for the latency model on those forwards alone."""
    def rel(pairs):
        errs = [abs(a - b) / b for a, b in pairs]
        return (round(statistics.median(errs), 4), round(max(errs), 4)) if errs else (None, None)

    out = {"rows": len(rows), "exact_rows": sum(r.exact for r in rows)}
    out["median_abs_error"], out["max_abs_error"] = rel((r.predicted_s, r.measured_s) for r in rows)
    out["median_abs_error_priced"], _ = rel((r.priced_s, r.measured_s) for r in rows)
    timed = [r for r in rows if r.forward_s]
    out["median_abs_error_forwards"], out["max_abs_error_forwards"] = rel(
        (r.priced_forward_s, r.forward_s) for r in timed)
    out["median_outside_forwards"] = round(statistics.median(
        (r.measured_s - r.forward_s) / r.measured_s for r in timed), 4) if timed else None
    return out


def scatter(rows: list[Row], path: Path, *, title: str) -> None:
    """Predicted vs measured seconds per (variant, step), the y = x line and the +-10% / 20% bands."""
    from dasrl_lab.plots import pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(6, 5.5))
    top = max(max(r.measured_s, r.predicted_s) for r in rows) * 1.08
    xs = [0, top]
    ax.plot(xs, xs, color="black", lw=1, label="predicted = measured")
    for band, style in ((0.1, "--"), (0.2, ":")):
        ax.plot(xs, [x * (1 + band) for x in xs], color="grey", ls=style, lw=0.8, label=f"+-{band:.0%}")
        ax.plot(xs, [x * (1 - band) for x in xs], color="grey", ls=style, lw=0.8)
    for name in dict.fromkeys(r.variant for r in rows):
        sub = [r for r in rows if r.variant == name]
        ax.scatter([r.measured_s for r in sub], [r.predicted_s for r in sub], s=28, label=name)
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured rollout time (s)", ylabel="simulator's prediction (s)",
           title=title)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    save_figure(fig, path, dpi=120, tight=False)
