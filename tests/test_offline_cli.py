"""`kvmesh offline` as a user runs it: a subprocess on a tiny model made by `kvmesh make-model`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

KVMESH = str(Path(sys.executable).parent / "kvmesh")
# NOTE: one torch thread: on a shared 2-core machine more threads spin and slow every op down.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def kvmesh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVMESH, *args], capture_output=True, text=True, env=ENV, timeout=300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("offline") / "tiny"
    small = [
        "--layers",
        "2",
        "--hidden-size",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--intermediate-size",
        "128",
    ]
    # NOTE: init std 0.2: with the default a tied qwen2 head repeats the input token forever,
    # an output any broken engine could match.
    done = kvmesh("make-model", str(out), "--arch", "qwen2", *small, "--max-position-embeddings", "512",
                  "--init-std", "0.2")
    assert done.returncode == 0, done.stderr
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@cache
def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the rows set ignore_eos
    return model


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face transformers' greedy ``generate``: the correctness oracle."""
    with torch.inference_mode():
        out = _hf_model(model_dir).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_outputs_in_input_order_and_token_exact(model_dir: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from kvmesh.contract.types import SamplingParams
    from kvmesh.model_worker.engine.llm import LLM

    shared = list(range(100, 148))  # 3 full blocks shared by rows 0 and 2
    text = "The keeper of the light"
    rows = [
        {"prompt_token_ids": shared + [7, 8], "max_tokens": 9, "ignore_eos": True},
        {"prompt": text, "max_tokens": 4, "ignore_eos": True},
        {
            "prompt_token_ids": shared + [9],
            "max_tokens": 6,
            "temperature": 0.8,
            "seed": 3,
            "ignore_eos": True,
        },
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 5, "top_k": 1, "temperature": 1.0, "ignore_eos": True},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, rows)
    done = kvmesh(
        "offline",
        "--model",
        str(model_dir),
        "--input",
        str(src),
        "--output",
        str(dst),
        "--num-blocks",
        "64",
        "--max-num-batched-tokens",
        "32",
    )
    assert done.returncode == 0, done.stderr
    got = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [len(g["token_ids"]) for g in got] == [9, 4, 6, 5]
    assert [g["finish_reason"] for g in got] == ["length"] * 4

    torch.set_num_threads(1)
    # Greedy rows (top_k=1 is greedy too) equal transformers token for token; the text row is
    # tokenized as the CLI documents it (tokenizer.json, special tokens added).
    text_ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=True).ids
    for row, ids in ((0, rows[0]["prompt_token_ids"]), (1, text_ids), (3, rows[3]["prompt_token_ids"])):
        assert got[row]["token_ids"] == hf_greedy(model_dir, ids, rows[row]["max_tokens"]), row
    assert len(set(got[0]["token_ids"])) > 1  # not a constant output, which a broken model could also give
    # The sampled row has no transformers oracle: it must be what the engine gives for its seed
    # in any process, and the texts what the engine's detokenizer makes of the ids.
    llm = LLM(str(model_dir), num_blocks=64, max_num_batched_tokens=32)
    prompts = [r["prompt_token_ids"] if "prompt_token_ids" in r else r["prompt"] for r in rows]
    params = [SamplingParams(**{k: v for k, v in r.items() if not k.startswith("prompt")}) for r in rows]
    want = llm.generate(prompts, params)
    assert got[2]["token_ids"] == want[2].token_ids
    assert [g["text"] for g in got] == [w.text for w in want]
    # Rows 0 and 2 are admitted in the same step; row 2 hits the 3 blocks row 0 caches.
    assert [g["cached_tokens"] for g in got] == [0, 0, 48, 0]


def test_a_bad_line_fails_fast_naming_its_line(model_dir: Path, tmp_path: Path) -> None:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"prompt_token_ids": [1, 2]}\n\n{"prompt_token_ids": [1, 2], "max_tokens": 0}\n')
    done = kvmesh("offline", "--model", str(model_dir), "--input", str(src), "--output", str(dst))
    assert done.returncode == 2
    assert f"{src}:3: max_tokens must be an integer in [1, 2**32) (leave it unset for the default), got 0" in done.stderr
    assert not dst.exists()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"prompt_token_ids": [1, 2], "temprature": 0.5}', "unknown keys ['temprature']"),
        ('{"max_tokens": 3}', "exactly one of 'prompt'"),
        ('{"prompt": [1, 2]}', "'prompt' must be a string"),
        ('{"prompt_token_ids": [1], "top_p": "high"}', "'top_p' must be a number, got 'high'"),
        ('{"prompt_token_ids": [1], "ignore_eos": 1}', "'ignore_eos' must be true or false, got 1"),
    ],
)
def test_parse_line_rejects(line: str, message: str) -> None:
    from kvmesh.commands.offline import parse_line

    with pytest.raises(ValueError) as err:
        parse_line(line, "in.jsonl:7")
    assert str(err.value).startswith("in.jsonl:7: ") and message in str(err.value)
