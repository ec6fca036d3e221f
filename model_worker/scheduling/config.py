"""The scheduler's settings (the records of a step are output.py, the logic scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.contract.settings import code_only, flag


@dataclass(slots=True)
class SchedulerConfig:
    """What the scheduler is told: one declaration of these settings, for the engine (EngineConfig
    extends it) and the simulator's engines (kvmesh/sim/mesh.py); `kvmesh worker` and `kvmesh
    simulate` derive the same flags from it."""

    max_num_seqs: int = 128
    """Running requests at most."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes)."""
    max_model_len: int | None = None
    """Prompt + output tokens at most; none = the model's max_position_embeddings."""
    enable_chunked_prefill: bool = flag(True, name="no-chunked-prefill")
    """Split a prompt over steps when it exceeds the step's remaining budget."""
    num_scheduler_steps: int = 1
    """Decode steps per scheduler call when the batch is all decodes (multi-step decode); 1 = off."""
    max_adapters_per_step: int | None = code_only(None)
    """Distinct LoRA adapters among running requests at most (the engine's --max-loras: its device slots);
    a waiting request of another adapter waits. None = no cap (no LoRA)."""

    def validate(self) -> None:
        """Raises ValueError on a configuration that could never schedule some request."""
        if self.max_adapters_per_step is not None and self.max_adapters_per_step < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_adapters_per_step}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is None or self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (the model's context when unset), got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}), or a long prompt could never be scheduled"
            )
