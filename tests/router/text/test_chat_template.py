"""router/text/chat_template.py renders exactly what transformers' apply_chat_template renders, on the
checkpoints `kvmesh make-model` writes and on templates written the other ways transformers reads."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from kvmesh.contract.errors import InvalidArgument
from kvmesh.make_model import CHAT_TEMPLATE, ModelSpec, make_model
from kvmesh.router.models import ModelFiles
from kvmesh.router.text.chat_template import ChatTemplate

TINY = ModelSpec(arch="qwen2", layers=1, hidden_size=32, heads=2, kv_heads=1, intermediate_size=64,
                 max_position_embeddings=256)

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there, what is a KV cache?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why route by prefix?"}],
    [{"role": "system", "content": "Be kind.\nAlways."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Tell me a story."}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "unicode: é 漢字 🙂 <s> </s>"}, {"role": "assistant", "content": None}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("chat") / "tiny-chat", TINY)


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_make_model_template_renders_and_tokenizes_as_transformers(model_dir, hf, conversation,
                                                                    add_generation_prompt):
    files = ModelFiles.load(str(model_dir))
    assert files.chat_template is not None and files.chat_template.source == CHAT_TEMPLATE
    text = files.chat_template.render(conversation, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    # The router's ids (what it hashes and the worker computes) are transformers' ids.
    ids = files.tokenizer.encode(text, add_special_tokens=False).ids
    expected = hf.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected  # transformers 5 returns a dict
    assert ids == list(expected)
    assert ids[0] == hf.bos_token_id  # the template's BOS, not one added by the tokenizer on top


def test_the_template_writes_each_role_and_the_generation_prompt(model_dir):
    template = ChatTemplate.from_dir(model_dir)
    assert template is not None
    text = template.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                            {"role": "assistant", "content": "A"}], add_generation_prompt=True)
    assert text == "<s><|system|>\nS\n<|user|>\nU\n<|assistant|>\nA</s>\n<|assistant|>\n"


def test_continue_final_message_matches_transformers(model_dir, hf):
    conversation = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi, I am"}]
    ours = ChatTemplate.from_dir(model_dir).render(conversation, add_generation_prompt=False,
                                                   continue_final_message=True)
    assert ours == hf.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
    assert ours.endswith("Hi, I am")


def test_refusals_are_invalid_argument_with_the_templates_message(model_dir):
    template = ChatTemplate.from_dir(model_dir)
    with pytest.raises(InvalidArgument, match="roles are system, user and assistant, got 'tool'"):
        template.render([{"role": "tool", "content": "x"}])
    with pytest.raises(InvalidArgument, match="messages is empty"):
        template.render([])
    with pytest.raises(InvalidArgument, match="exclude each other"):
        template.render([{"role": "user", "content": "x"}], continue_final_message=True)


def test_template_file_wins_over_tokenizer_config_and_named_templates(tmp_path, model_dir):
    d = tmp_path / "m"
    d.mkdir()
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "{{ bos_token }}D{{ messages[0]['content'] }}"},
                               {"name": "tool_use", "template": "T"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_dir(d).render([{"role": "user", "content": "x"}]) == "<s>Dx"
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}"
                                           "{% if add_generation_prompt %}>{% endif %}{{ eos_token }}")
    assert ChatTemplate.from_dir(d).render([{"role": "user", "content": "x"}]) == "[user]></s>"
    config["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="none 'default'"):
        ChatTemplate.from_dir(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert ChatTemplate.from_dir(d) is None
    (d / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate.from_dir(d)


def test_the_sandbox_refuses_python_internals():
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidArgument, match="refused the messages"):
        template.render([{"role": "user", "content": "x"}])
    mutate = ChatTemplate("{% set _ = messages.append(1) %}{{ messages | length }}")
    with pytest.raises(InvalidArgument):
        mutate.render([{"role": "user", "content": "x"}])
