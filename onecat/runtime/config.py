"""The engine's settings (one dataclass; names and defaults follow ``vllm serve``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Settings of :class:`onecat.runtime.engine.LLMEngine`.

    ``model`` is a packed artifact, an AWQ / compressed-tensors checkpoint or an fp16/bf16
    checkpoint directory. ``device`` "auto" picks CUDA when available. ``max_model_len`` None
    means the model's ``max_position_embeddings`` limited by what the KV cache can hold.
    ``max_num_batched_tokens`` is the per-step token budget (prompts are prefilled in chunks
    of at most that many tokens). ``num_kv_blocks`` overrides the KV cache size (on CPU the
    default is a fixed byte budget). ``enforce_eager`` turns CUDA graphs off. ``tensor_parallel_size`` N > 1 splits the model
    over N GPUs of this host (or N CPU processes), see ``onecat.runtime.distributed``.
    ``enable_prefix_caching`` reuses the KV blocks and GDN states of prompt prefixes computed
    before (``onecat.runtime.engine.scheduler``); ``state_checkpoint_interval`` (tokens, rounded
    down to whole KV blocks) is how often a long prompt's GDN states are checkpointed for it.
    ``speculative_config`` (vLLM's ``--speculative-config``), e.g. ``{"method": "mtp",
    "num_speculative_tokens": 3}``, turns on speculative decoding with the checkpoint's MTP
    head (``onecat.runtime.engine.speculative``). ``async_scheduling`` (vLLM's name) overlaps
    decode steps: the next step is queued on the device before the host reads the tokens of
    the one before (``LLMEngine.step``); turn it off only to compare.
    ``disable_custom_all_reduce`` (vLLM's ``--disable-custom-all-reduce``) makes tensor
    parallelism sum every activation with NCCL instead of onecat's one-shot kernel for small
    tensors (``onecat.runtime.distributed.custom_all_reduce``).
    ``kv_cache_memory_bytes`` (vLLM's ``--kv-cache-memory-bytes``) is the exact size of each
    device's KV cache + GDN state pool; ``gpu_memory_utilization`` then does not size it
    (``onecat.runtime.capacity``). ``kv_cache_dtype`` (vLLM's ``--kv-cache-dtype``): one of
    ``capacity.KV_CACHE_DTYPES``.
    """

    model: str
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    gpu_memory_utilization: float = 0.92
    kv_block_size: int = 16
    num_kv_blocks: int | None = None
    enforce_eager: bool = False
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    state_checkpoint_interval: int = 1024
    speculative_config: dict | str | None = None
    async_scheduling: bool = True
    disable_custom_all_reduce: bool = False
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
