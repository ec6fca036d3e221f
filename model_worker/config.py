"""The three configs of a worker: the model's (config.json, parsed once), the engine's and the worker process's."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvmesh.contract.block_hash import DEFAULT_BLOCK_SIZE, SHA256_128, algorithm_name
from kvmesh.contract.settings import flag
from kvmesh.model_worker.scheduling.config import SchedulerConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``"bf16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of float32, float16, bfloat16") from None


@dataclass(slots=True)
class ModelConfig:
    """The fields of a Llama-family config.json the model code reads (one place for defaults)."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """``rope_type`` + its parameters when not the default rope (e.g. llama3)."""
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """Qwen3: an RMSNorm of ``head_dim`` over each query and key head, after the projection and
    before rotary."""
    tie_word_embeddings: bool = False
    sliding_windows: list[int | None] = field(default_factory=list)
    """Per layer: the attention window, None = full attention."""
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: torch.dtype = torch.float32
    """The checkpoint's stored dtype."""

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Parses ``model_dir/config.json``; raises ValueError naming what is unsupported."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no config.json; is it a Hugging Face model directory?")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "")
        archs = cfg.get("architectures") or [_ARCH_BY_TYPE.get(model_type, "")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu")
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads "
                             f"({num_kv_heads}): no grouped-query attention serves that")
        num_layers = cfg["num_hidden_layers"]
        # NOTE: Qwen3Config's head_dim defaults to 128, not hidden_size / heads (Qwen3-0.6B: 1024 / 16 x 128).
        head_dim = cfg.get("head_dim") or (128 if arch == "Qwen3ForCausalLM" else cfg["hidden_size"] // num_heads)
        # NOTE: transformers >= 5 writes rope_parameters {rope_theta, rope_type, ...}; older
        # checkpoints have rope_theta + rope_scaling {type|rope_type, ...}. Both land here.
        rope = dict(cfg.get("rope_parameters") or {})
        rope.update(cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        rope_scaling = None
        if rope_type != "default":
            if rope_type != "llama3":
                raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
            rope_scaling = {"rope_type": rope_type, **rope}
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_windows=_sliding_windows(cfg, model_type, num_layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=parse_dtype(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )


_ARCH_BY_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def _sliding_windows(cfg: dict[str, Any], model_type: str, num_layers: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
        # Qwen2/3: the window applies only when use_sliding_window, to layers listed as sliding.
        if not cfg.get("use_sliding_window", False) or not window:
            return [None] * num_layers
        types = cfg.get("layer_types")
        if types is None:
            first = cfg.get("max_window_layers", num_layers)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        return [window if t == "sliding_attention" else None for t in types]
    if model_type == "mistral" and window:
        return [window] * num_layers
    return [None] * num_layers


@dataclass(slots=True, kw_only=True)
class EngineConfig(SchedulerConfig):
    """Everything the engine is told (the scheduler's settings included: SchedulerConfig); ``check``
    runs once in ``LLMEngine.__init__``."""

    model: str
    """Directory with config.json, *.safetensors and tokenizer.json."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV block (also the prefix-hash block)."""
    num_blocks: int | None = None
    """KV blocks in the pool, incl. the null block; none = derived from --memory-fraction."""
    memory_fraction: float | None = None
    """CUDA: this worker's share of the GPU's total memory for everything it holds (weights,
    activations, CUDA graphs, KV cache), whatever other processes hold, as vLLM's
    --gpu-memory-utilization; it must be free at start (none = 0.9). CPU: share of available RAM for
    the KV cache (none = 0.05)."""
    enable_prefix_caching: bool = flag(True, name="no-prefix-caching")
    """Reuse cached KV blocks of earlier prompts (vLLM's automatic prefix caching)."""
    hash_algorithm: str = SHA256_128
    """Block hash; must match the other workers of the model (docs/block-hashing.md)."""
    dtype: str = "auto"
    """auto = float32 on CPU, the checkpoint's half dtype (or bfloat16) on CUDA."""
    device: str = "auto"
    """auto = cuda when available, else cpu."""
    seed: int = 0
    """Seeds the generator of sampled requests that have no seed of their own."""
    model_id: str | None = None
    """Model identity in block hashes and the index; none = the model directory's name (docs/block-hashing.md)."""
    compile: bool | None = None
    """torch.compile the forward pass (inductor fuses norms, rotary, activation and residuals; attention
    and the KV write stay opaque custom ops); neither flag = the device's default: on for CUDA, off for
    CPU (docs/engine.md, "Compiled forward")."""
    async_scheduling: bool | None = None
    """Plan step n+1 while step n runs (vLLM's async scheduling, SGLang's overlap scheduler): sampled ids stay
    on the device as the next step's inputs and come to the host behind the next launch; neither flag = the
    device's default: on for CUDA, off for the CPU, where a step leaves nothing to overlap (docs/engine.md,
    "Async scheduling")."""
    enforce_eager: bool = False
    """No CUDA graphs: every decode step runs eagerly (vLLM's --enforce-eager). CUDA only; a CPU worker
    never captures graphs."""
    cuda_graph_sizes: list[int] = field(default_factory=list)
    """Decode batch sizes captured as CUDA graphs (a batch runs padded to the next one; larger batches
    run eagerly); none = 1, 2, 4, 8 and every multiple of 16 up to --max-num-seqs (at most 512)."""
    host_kv_blocks: int | None = None
    """Host KV tier, in blocks: blocks evicted from the device pool are kept in host memory (pinned on CUDA)
    and loaded back instead of recomputed; none or 0 = off (docs/engine.md, Host KV tier)."""
    kv_offloading_size: float | None = None
    """Host KV tier, in GiB (vLLM's --kv-offloading-size with its native backend); none or 0 = off. Give this or
    --host-kv-blocks, not both."""
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT directories) on top of the base model; a request names one or none, and one
    batch mixes them (docs/engine.md, "LoRA adapters")."""
    lora_modules: list[str] = flag(default_factory=list, metavar="NAME=PATH,...")
    """Adapters loaded at start-up, as name=path (more at run time: LLMEngine.load_adapter); needs --enable-lora."""
    max_loras: int = 1
    """LoRA adapters in device slots at once, i.e. distinct adapters among running requests (vLLM's meaning)."""
    max_lora_rank: int = 16
    """The largest adapter rank served (each slot holds this rank)."""
    max_cpu_loras: int | None = None
    """LoRA adapters kept loaded in host memory (LRU; others are read from disk again); none = --max-loras."""

    def check(self, model_config: ModelConfig) -> None:
        """Validates and fills derived fields; raises ValueError with what to change."""
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.host_kv_blocks is not None and self.host_kv_blocks < 0:
            raise ValueError(f"--host-kv-blocks must be >= 0 (0 = no host tier), got {self.host_kv_blocks}")
        if self.kv_offloading_size is not None and not (0 <= self.kv_offloading_size < float("inf")):
            raise ValueError(f"--kv-offloading-size must be a size in GiB >= 0 (0 = no host tier), "
                             f"got {self.kv_offloading_size}")
        if self.host_kv_blocks and self.kv_offloading_size:
            raise ValueError("give the host KV tier's size once: --host-kv-blocks N or --kv-offloading-size GIB, "
                             "not both")
        if self.host_tier and not self.enable_prefix_caching:
            raise ValueError("a host KV tier needs prefix caching (it keeps and loads back cached blocks): drop "
                             "--no-prefix-caching, or --host-kv-blocks / --kv-offloading-size")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        bad = [s for s in self.cuda_graph_sizes if not 1 <= s <= self.max_num_seqs]
        if bad:
            raise ValueError(f"cuda_graph_sizes must lie in [1, max_num_seqs = {self.max_num_seqs}] (a decode "
                             f"batch holds at most max_num_seqs sequences), got {bad}")
        self._check_lora()
        if self.max_model_len is None:
            self.max_model_len = model_config.max_position_embeddings
        self.validate()
        self.hash_algorithm = algorithm_name(self.hash_algorithm)
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            if self.device.startswith("cuda"):
                half = model_config.dtype in (torch.float16, torch.bfloat16)
                self.dtype = str(model_config.dtype if half else torch.bfloat16).removeprefix("torch.")
            else:
                self.dtype = "float32"
        parse_dtype(self.dtype)
        if self.compile is None:
            self.compile = self.device.startswith("cuda")
        if self.async_scheduling is None:
            self.async_scheduling = self.device.startswith("cuda")

    def _check_lora(self) -> None:
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("--lora-modules needs --enable-lora")
            self.max_adapters_per_step = None
            return
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})")
        parse_lora_modules(self.lora_modules)
        self.max_adapters_per_step = self.max_loras

    def scheduler_config(self, num_scheduler_steps: int | None = None) -> SchedulerConfig:
        """The scheduler's part (``num_scheduler_steps`` overridden: a runner without windows runs 1)."""
        out = SchedulerConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulerConfig)})
        if num_scheduler_steps is not None:
            out.num_scheduler_steps = num_scheduler_steps
        return out

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def host_tier(self) -> bool:
        """Whether a host KV tier is asked for (its size in blocks is the runner's to work out)."""
        return bool(self.host_kv_blocks or self.kv_offloading_size)


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """``["name=path", ...]`` (``--lora-modules``) -> ``[(name, path), ...]``.

    Raises:
        ValueError: an entry is not ``name=path``, or a name repeats.
    """
    out: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules takes name=path entries, got {spec!r}")
        out.append((name.strip(), path.strip()))
    names = [n for n, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--lora-modules names {dup} more than once")
    return out


@dataclass(slots=True)
class WorkerConfig:
    """The worker process around the engine: where it listens, whom it reports to, its limits."""

    host: str = "0.0.0.0"
    """Listen address."""
    port: int = 50061
    """gRPC port; 0 picks a free one (tests)."""
    advertise_address: str | None = flag(None, metavar="HOST:PORT")
    """The address routers dial; none = $POD_IP or this host's name, with --port."""
    kv_service: str | None = flag("127.0.0.1:50052", metavar="HOST:PORT")
    """The kv_service to register with and publish block events to; none = run alone."""
    worker_id: str | None = None
    """This worker's id in the index and in served_by; none = the host name."""
    max_queued_requests: int = 1024
    """Requests in flight before RESOURCE_EXHAUSTED."""
    stream_interval: int = 1
    """Tokens per stream message after the first, as vLLM's --stream-interval: larger values cut host
    overhead per token; the first token still goes out at once."""
    torch_threads: int = 0
    """torch intra-op threads; 0 = the engine's default (CPU: every usable core but one, at least
    one; OMP_NUM_THREADS in the environment wins)."""
    role: str = flag("both", metavar="prefill|decode|both")
    """What this worker serves (prefill/decode disaggregation, docs/architecture.md): prefill = prompts,
    its KV then handed to a decode worker; decode = decode legs, taking a prompt's KV from a prefill worker
    (or prefilling it itself when the router says the transfer does not pay); both = every request."""
    kv_transport: str = flag("auto", metavar="auto|nixl|grpc")
    """How KV blocks travel between prefill and decode workers: auto = NIXL (UCX) when it loads, else a gRPC
    stream (named in the log and the kvmesh:kv_transfers metric); nixl = refuse to start without it."""
    kv_hold_ttl: float = 30.0
    """Seconds a prefill worker holds a prompt's KV blocks for a decode worker that has not taken them."""

    def check(self) -> None:
        """Raises ValueError with the flag to fix."""
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        if self.torch_threads < 0:
            raise ValueError(f"--torch-threads must be >= 0, got {self.torch_threads}")
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"--role must be prefill, decode or both, got {self.role!r}")
        if self.kv_transport not in ("auto", "nixl", "grpc"):
            raise ValueError(f"--kv-transport must be auto, nixl or grpc, got {self.kv_transport!r}")
        if not self.kv_hold_ttl > 0:
            raise ValueError(f"--kv-hold-ttl must be > 0 seconds, got {self.kv_hold_ttl}")
