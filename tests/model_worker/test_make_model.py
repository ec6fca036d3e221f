"""`kvmesh make-model` writes a checkpoint transformers and our engine both load, with a real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tokenizers import Tokenizer

from kvmesh.cli import main
from kvmesh.contract.types import SamplingParams
from kvmesh.make_model import CHAT_TEMPLATE, ensure_default_model
from kvmesh.model_worker.engine.llm import LLM
from tests.support.model_worker import EXACT

SMALL = [
    "--layers",
    "1",
    "--hidden-size",
    "32",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--intermediate-size",
    "48",
]


def test_flags_land_in_config_and_tokenizer_loads_with_autotokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    out = tmp_path / "m"
    argv = ["make-model", str(out), "--arch", "mistral", *SMALL]
    assert main([*argv, "--max-position-embeddings", "256", "--sliding-window", "8", "--seed", "5"]) == 0
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    cfg = json.loads((out / "config.json").read_text())
    expected = {
        "architectures": ["MistralForCausalLM"],
        "num_hidden_layers": 1,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 48,
        "max_position_embeddings": 256,
        "sliding_window": 8,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    assert {k: cfg[k] for k in expected} == expected
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert cfg["vocab_size"] == raw.get_vocab_size()
    hf = AutoTokenizer.from_pretrained(out)
    assert (hf.bos_token, hf.eos_token, hf.bos_token_id, hf.eos_token_id) == ("<s>", "</s>", 0, 1)
    text = "The keeper wrote 1024 words in the logbook, didn't she?"
    ids = raw.encode(text).ids
    assert hf(text)["input_ids"] == ids and ids[0] == 0
    assert hf.decode(ids, skip_special_tokens=True) == text


def test_seed_decides_the_weights(tmp_path: Path) -> None:
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        assert main(["make-model", str(tmp_path / name), *SMALL, "--seed", seed]) == 0
    a, b, c = (load_file(tmp_path / n / "model.safetensors") for n in "abc")
    assert all((a[k] == b[k]).all() for k in a)
    assert not (a["model.embed_tokens.weight"] == c["model.embed_tokens.weight"]).all()


def test_vocab_size_pads_the_embedding(tmp_path: Path) -> None:
    assert main(["make-model", str(tmp_path / "m"), *SMALL, "--vocab-size", "1000"]) == 0
    assert load_file(tmp_path / "m" / "model.safetensors")["model.embed_tokens.weight"].shape == (1000, 32)


@pytest.mark.parametrize(
    "extra",
    [
        ["--arch", "llama", "--sliding-window", "8"],
        ["--heads", "3"],
        ["--vocab-size", "10"],
        ["--layers", "0"],
    ],
)
def test_bad_shapes_exit_2_with_a_message(tmp_path: Path, capsys, extra: list[str]) -> None:
    assert main(["make-model", str(tmp_path / "m"), *SMALL, *extra]) == 2
    assert "kvmesh make-model: error:" in capsys.readouterr().err


def test_default_model_is_made_once_and_not_degenerate(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    path = ensure_default_model()
    assert path == tmp_path / "cache" / "models" / "default"
    cfg = json.loads((path / "config.json").read_text())
    shape = [
        cfg[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")
    ]
    assert shape == [4, 256, 8, 2] and cfg["max_position_embeddings"] >= 4096
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    # A default model cached by an older kvmesh (no chat template) gets the template, weights untouched.
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert config.pop("chat_template") == CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ensure_default_model() == path
    assert json.loads((path / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp

    llm = LLM(str(path), num_blocks=300, **EXACT)
    (out,) = llm.generate(["The keeper of the light"], SamplingParams(max_tokens=32, ignore_eos=True))
    assert len(set(out.token_ids)) > 8
