"""Small random checkpoints (Llama / Qwen2 / Qwen3 / Mistral) with a real byte-level BPE tokenizer.

The checkpoint is written by transformers itself (``config.json``, ``model.safetensors``,
``generation_config.json``), so it loads the same way a downloaded model does, in our engine and
in transformers. The tokenizer is trained with ``tokenizers`` on ``kvmesh/data/corpus.txt``;
``tokenizer_config.json`` carries a small chat template (``CHAT_TEMPLATE``), so chat requests work
on these checkpoints in kvmesh, transformers and vLLM alike.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
BOS, EOS = "<s>", "</s>"
CORPUS = Path(__file__).parent / "data" / "corpus.txt"
TOKENIZER_TARGET_VOCAB = 1024
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ('system', 'user', 'assistant') %}\n"
    "        {{- raise_exception(\"roles are system, user and assistant, got '\" ~ message['role'] ~ \"'\") }}\n"
    "    {%- endif %}\n"
    "    {%- if message['content'] is not defined or message['content'] is none %}\n"
    "        {%- set content = '' %}\n"
    "    {%- elif message['content'] is string %}\n"
    "        {%- set content = message['content'] %}\n"
    "    {%- else %}\n"
    "        {%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('\\n') %}\n"
    "    {%- endif %}\n"
    "    {{- '<|' ~ message['role'] ~ '|>\\n' ~ content }}\n"
    "    {%- if message['role'] == 'assistant' %}\n"
    "        {{- eos_token }}\n"
    "    {%- endif %}\n"
    "    {{- '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|assistant|>\\n' }}\n"
    "{%- endif %}\n"
)
"""The chat template every checkpoint gets (tokenizer_config.json's ``chat_template``): BOS, then per
message ``<|role|>\\n`` + its text (+ EOS after an assistant turn) + ``\\n``; the generation prompt is
``<|assistant|>\\n``. Content may be a string or OpenAI's list of parts (text parts joined by a
newline); a role other than system / user / assistant is refused with ``raise_exception``."""
SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)


@dataclass(slots=True)
class ModelSpec:
    """Shape of a random checkpoint; defaults give the default model of ``make run``."""

    arch: str = "llama"
    """One of llama, qwen2, qwen3, mistral."""
    layers: int = 4
    """Decoder layers."""
    hidden_size: int = 256
    """Hidden size."""
    heads: int = 8
    """Attention heads."""
    kv_heads: int = 2
    """Key/value heads (GQA)."""
    head_dim: int | None = None
    """Size of an attention head; None = hidden_size / heads (Qwen3's checkpoints set their own)."""
    intermediate_size: int = 768
    """MLP intermediate size."""
    vocab_size: int | None = None
    """None = the trained tokenizer's vocabulary; larger values pad the embedding table."""
    max_position_embeddings: int = 4096
    """The model's context length (config.json)."""
    sliding_window: int | None = None
    """Mistral: every layer attends to keys at positions > i - window. Qwen2/3: the layers from
    ``max_window_layers`` on do (``use_sliding_window``), the others are full attention."""
    max_window_layers: int | None = None
    """Qwen2/3 with a sliding window: layers before this index are full attention (transformers'
    rule); None = half the layers."""
    seed: int = 0
    """Same seed, same weights."""
    # NOTE: 0.02 (transformers' default) makes the default model repeat one token forever; at 0.1
    # greedy outputs of the default model vary (tests/model_worker/test_make_model.py checks).
    init_std: float = 0.1
    """Std of the normal weight init (config initializer_range)."""
    extra_config: dict[str, Any] = field(default_factory=dict)
    """Raw config.json overrides (e.g. ``rope_parameters`` for llama3 rope scaling)."""

    def check(self) -> None:
        """Raises ValueError on a shape transformers would reject or mis-build."""
        if self.arch not in ARCHS:
            raise ValueError(f"--arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        for name in (
            "layers",
            "hidden_size",
            "heads",
            "kv_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim is not None and (self.head_dim < 2 or self.head_dim % 2):
            raise ValueError(f"head_dim must be even and >= 2 (rotary pairs its halves), got {self.head_dim}")
        if self.head_dim is None and self.hidden_size % self.heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of heads ({self.heads}), "
                             "or give --head-dim")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.sliding_window is not None and (self.arch == "llama" or self.sliding_window < 1):
            raise ValueError("--sliding-window needs --arch mistral, qwen2 or qwen3 and a value >= 1")
        if self.max_window_layers is not None and (
            self.arch not in ("qwen2", "qwen3")
            or self.sliding_window is None
            or not 0 <= self.max_window_layers <= self.layers
        ):
            raise ValueError(
                "--max-window-layers needs --arch qwen2 or qwen3, --sliding-window and a value in [0, layers]"
            )


def train_tokenizer(vocab_size: int = TOKENIZER_TARGET_VOCAB):
    """Byte-level BPE trained on the shipped corpus; ``<s>`` (id 0) is prepended on encode."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # NOTE: the split regex is the one Qwen2's tokenizer class forces on load (digits one by one);
    # using it for every arch keeps AutoTokenizer's ids equal to tokenizer.json's.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(), trainer=trainer)
    # NOTE: special tokens are trained first, so BOS = 0 and EOS = 1 in every build.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tok


def _hf_config(spec: ModelSpec, vocab_size: int, bos: int, eos: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
        initializer_range=spec.init_std,
    )
    if spec.head_dim is not None:
        common["head_dim"] = spec.head_dim
    if spec.arch == "llama":
        cfg = LlamaConfig(**common)
    elif spec.arch in ("qwen2", "qwen3"):
        window = {}
        if spec.sliding_window is not None:
            first = spec.max_window_layers if spec.max_window_layers is not None else spec.layers // 2
            window = dict(use_sliding_window=True, sliding_window=spec.sliding_window, max_window_layers=first)
        if spec.arch == "qwen2":
            cfg = Qwen2Config(**common, tie_word_embeddings=True, **window)
        else:
            # NOTE: Qwen3Config's head_dim defaults to 128 whatever the hidden size: set it always.
            common.setdefault("head_dim", spec.hidden_size // spec.heads)
            cfg = Qwen3Config(**common, **window)
    else:
        cfg = MistralConfig(**common, sliding_window=spec.sliding_window)
    for key, value in spec.extra_config.items():
        setattr(cfg, key, value)
    return cfg


def make_model(out_dir: str | os.PathLike[str], spec: ModelSpec | None = None) -> Path:
    """Writes a random checkpoint + tokenizer to ``out_dir`` and returns its path.

    Args:
        out_dir: target directory (created; existing files are overwritten).
        spec: the model shape; ``ModelSpec()`` when None.

    Returns:
        The directory, loadable by ``AutoModelForCausalLM`` / ``AutoTokenizer`` and our engine.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec = spec or ModelSpec()
    spec.check()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    vocab = tok.get_vocab_size()
    vocab_size = spec.vocab_size if spec.vocab_size is not None else vocab
    if vocab_size < vocab:
        raise ValueError(f"vocab_size ({vocab_size}) is smaller than the tokenizer's vocabulary ({vocab})")

    cfg = _hf_config(spec, vocab_size, bos, eos)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # NOTE: transformers zero-inits biases and sets norm weights to one; random biases exercise Qwen2's
    # qkv bias, random q/k norm weights Qwen3's per-head norms (a swapped or unloaded one changes tokens).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, spec.init_std)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1.0, 0.5)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    model.save_pretrained(out)

    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}, indent=2) + "\n"
    )
    return out


def add_chat_template(model_dir: Path) -> bool:
    """Writes ``CHAT_TEMPLATE`` into a checkpoint made before make-model wrote one (the cached
    default model of an older kvmesh); True when it did. Atomic: a temp file renamed over the old."""
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if config.get("chat_template") is not None or (model_dir / "chat_template.jinja").exists():
        return False
    config["chat_template"] = CHAT_TEMPLATE
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(path)
    return True


def cache_dir() -> Path:
    """``$KVMESH_CACHE_DIR`` or ``~/.cache/kvmesh``."""
    return Path(os.environ.get("KVMESH_CACHE_DIR") or Path.home() / ".cache" / "kvmesh")


def ensure_default_model() -> Path:
    """The default model of ``make run``: made once under the cache dir, then reused."""
    target = cache_dir() / "models" / "default"
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        add_chat_template(target)
        return target
    # NOTE: build in a sibling dir and rename, so a crash never leaves a half-written default.
    tmp = target.with_name(f"default.tmp-{os.getpid()}")
    make_model(tmp, ModelSpec())
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race; use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target
