"""router/models.py: what the router reads from a model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models

from kvmesh.contract.errors import InvalidArgument
from kvmesh.router.models import ModelFiles
from kvmesh.router.text.prompt import check_prompt_ids


def model_dir(path: Path, tokens: int, added: int, config_vocab: int) -> Path:
    """A directory of a word-level tokenizer (``tokens`` words, then ``added`` added tokens) and a config.json
    stating ``config_vocab``."""
    path.mkdir()
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(tokens)}, unk_token="w0"))
    tok.add_tokens([AddedToken(f"<extra{i}>") for i in range(added)])
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({"vocab_size": config_vocab, "max_position_embeddings": 256}))
    return path


@pytest.mark.parametrize(("tokens", "added", "config_vocab", "vocab"), [
    (10, 0, 64, 64),  # an embedding table padded past the tokenizer (the usual checkpoint)
    (10, 6, 12, 16),  # added tokens past config.json's size
], ids=["padded", "added"])
def test_the_vocabulary_edge_is_the_larger_of_the_config_and_the_tokenizer(tmp_path, tokens, added, config_vocab,
                                                                           vocab):
    """Catches the vocabulary edge read from the smaller source (issue 50: ``max`` -> ``min``): the edge is
    taken from the directory's files here, not from the value under test. The id below it passes, the id at it
    (behind one that passes) is refused naming the model."""
    files = ModelFiles.load(str(model_dir(tmp_path / "m", tokens, added, config_vocab)))
    assert files.vocab_size == vocab
    check_prompt_ids([0, vocab - 1], "token_ids", files.vocab_size, files.model_id)
    with pytest.raises(InvalidArgument, match=rf"token_ids\[1\] is {vocab}: outside the vocabulary of model 'm'"):
        check_prompt_ids([0, vocab], "token_ids", files.vocab_size, files.model_id)
