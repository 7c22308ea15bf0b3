"""``onecat plan``: what a configuration holds per GPU, from the artifact alone (no GPU, no weights).

The artifact's config.json and safetensors headers (``loader.WeightSource``: which linears are
packed, read from the headers only) give the model; each rank's shard is built on torch's
``meta`` device from ``sharding.shard_config`` (the engine's own rules), so the weight bytes
are exactly the tensors the engine allocates, and its caches' shape is what the engine's
planner sees. ``capacity.plan_caches`` then splits the budget as the engine does.

The budget: ``--kv-cache-memory-bytes`` when given (exact, as the engine uses it); otherwise
``--gpu-memory`` x ``--gpu-memory-utilization`` less the weights and the runtime's reserves.
The engine measures two of those at start-up, so here they are estimates (named constants
below): the memory outside torch's allocator (``NON_TORCH_BYTES``, plus
``TP_COMMUNICATION_BYTES`` under tensor parallelism) and the activation peak of one
``--max-num-batched-tokens`` prefill (:func:`activation_bytes`; counted twice with CUDA graphs,
whose piecewise prompt graphs keep a pass's activations in their own pool). The sampling
reserve and ``GRAPH_RESERVE_BYTES`` are the engine's own constants.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from onecat.errors import OnecatError
from onecat.runtime import capacity
from onecat.runtime.capacity import CachePlan, gib
from onecat.runtime.config import EngineConfig
from onecat.runtime.engine.model_runner import GRAPH_RESERVE_BYTES, SAMPLING_BYTES_PER_LOGIT
from onecat.runtime.models.config import ModelConfig
from onecat.runtime.quant_plan import QuantPlan
from onecat.runtime.sharding import shard_config

NON_TORCH_BYTES = 512 << 20
"""Estimated GPU memory outside torch's allocator: the CUDA context, cuBLAS handles and the
loaded kernel images (the engine measures it as ``others``)."""
TP_COMMUNICATION_BYTES = 256 << 20
"""Estimated extra GPU memory per rank under tensor parallelism: NCCL's buffers and the
one-shot all-reduce's peer buffers."""
ACTIVATION_SLACK = 2
"""The activation estimate's margin over the widest layer's live tensors (fp32 temporaries of
norms and gates, allocator rounding)."""
CONCURRENCY_LENGTHS = (4096, 32768)
"""The sequence lengths whose concurrency ``onecat plan`` reports."""


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each storage once (tied and folded weights
    are views). Works on meta tensors."""
    storages: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage._cdata] = storage.nbytes()  # _cdata: the storage's identity, also on meta
    return sum(storages.values())


def activation_bytes(cfg: ModelConfig, tokens: int, max_num_seqs: int, dtype_bytes: int) -> int:
    """Estimated peak activation bytes of one prefill pass of ``tokens`` tokens on one rank
    (``cfg``: the rank's shard): the residual stream and the widest layer's projections (dense
    MLP, routed + shared experts, GDN or gated attention) times ``ACTIVATION_SLACK``, and the
    logits of up to ``max_num_seqs`` rows (gathered over the vocabulary under TP)."""
    mlp = 3 * cfg.intermediate_size
    if cfg.is_moe:
        mlp = 3 * ((cfg.num_experts_per_tok + 1) * cfg.moe_intermediate_size) + 2 * cfg.num_experts
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    gdn = 2 * (2 * key_dim + value_dim) + 3 * value_dim + 2 * cfg.linear_num_value_heads
    attention = (
        4 * cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim
    )
    per_token = 4 * cfg.hidden_size + max(mlp, gdn, attention)
    rows = min(max_num_seqs, tokens)
    logits = rows * cfg.lm_head_rows * dtype_bytes
    if cfg.vocab_partitions > 1:
        logits += rows * cfg.vocab_size * dtype_bytes
    return tokens * per_token * dtype_bytes * ACTIVATION_SLACK + logits


def shard_model(
    cfg: ModelConfig,
    quant: QuantPlan,
    tensor_parallel_size: int,
    dtype: torch.dtype,
    *,
    mtp: bool = False,
    source: str = "config.json",
) -> torch.nn.Module:
    """Rank 0's model on the meta device, as the engine builds it (shared experts folded)."""
    from onecat.runtime.models.qwen3_5 import Qwen3_5ForCausalLM, fold_shared_experts

    local = shard_config(cfg, tensor_parallel_size, source)
    with _as_rank_zero_of(tensor_parallel_size), torch.device("meta"):
        model = Qwen3_5ForCausalLM(local, quant, dtype, mtp=mtp)
        fold_shared_experts(model)
    return model


@contextlib.contextmanager
def _as_rank_zero_of(world_size: int) -> Iterator[None]:
    """Make the layers that ask ``parallel_state`` (routed experts, a tied ``lm_head``) build
    rank 0's part of ``world_size`` ranks, with no process group (the engine's workers have
    one); restored afterwards."""
    from onecat.runtime.distributed import parallel_state

    if parallel_state.tp_size() != 1:
        raise OnecatError("onecat plan runs outside a tensor-parallel process group")
    saved = parallel_state._rank, parallel_state._world_size
    parallel_state._rank, parallel_state._world_size = 0, world_size
    try:
        yield
    finally:
        parallel_state._rank, parallel_state._world_size = saved


@dataclass
class CapacityReport:
    """What one configuration holds per GPU (:func:`plan_capacity`)."""

    model: str
    tensor_parallel_size: int
    kv_cache_dtype: str
    gpu_memory: int | None
    usable_bytes: int | None
    budget_from: str
    weight_bytes: int
    overheads: dict[str, int]
    cache: CachePlan
    max_model_len: int | None
    model_max_len: int
    concurrency: dict[int, int] = field(default_factory=dict)
    problem: str | None = None

    @property
    def fits(self) -> bool:
        """Whether the engine would start with this configuration."""
        return self.problem is None

    @property
    def serving_len(self) -> int:
        """The engine's max_model_len: the asked one, else the model's capped by the KV cache."""
        if self.max_model_len:
            return self.max_model_len
        if not self.cache.shape.block_bytes:
            return self.model_max_len
        return min(self.model_max_len, self.cache.capacity_tokens)

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON types (``onecat plan --json``)."""
        shape = self.cache.shape
        return {
            "model": self.model,
            "fits": self.fits,
            "problem": self.problem,
            "tensor_parallel_size": self.tensor_parallel_size,
            "kv_cache_dtype": self.kv_cache_dtype,
            "gpu_memory_bytes": self.gpu_memory,
            "usable_bytes": self.usable_bytes,
            "weight_bytes_per_gpu": self.weight_bytes,
            "overhead_bytes": dict(self.overheads),
            "overhead_bytes_total": sum(self.overheads.values()),
            "kv_cache_memory_bytes": self.cache.budget,
            "budget_from": self.budget_from,
            "kv_block_size": shape.block_size,
            "kv_block_bytes": shape.block_bytes,
            "state_slot_bytes": shape.per_slot_bytes,
            "num_kv_blocks": self.cache.num_blocks,
            "num_state_slots": self.cache.num_slots,
            "num_state_checkpoints": self.cache.num_checkpoints,
            "cache_bytes_allocated": self.cache.allocated_bytes,
            "kv_capacity_tokens": self.cache.capacity_tokens,
            "max_model_len": self.serving_len if self.fits else self.max_model_len,
            "concurrency": {str(length): n for length, n in self.concurrency.items()},
        }


def plan_capacity(
    cfg: ModelConfig,
    quant: QuantPlan,
    *,
    gpu_memory: int | None,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
    max_model_len: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    gpu_memory_utilization: float = 0.92,
    enable_prefix_caching: bool = True,
    enforce_eager: bool = False,
    kv_block_size: int = 16,
    num_kv_blocks: int | None = None,
    dtype: torch.dtype = torch.float16,
    num_drafts: int = 0,
    model_name: str = "model",
    source: str = "config.json",
) -> CapacityReport:
    """The capacity of model ``cfg`` (``quant``: its packed linears) per GPU under the engine's
    flags (vLLM's names). ``gpu_memory`` None: no GPU check, ``kv_cache_memory_bytes`` required.
    ``dtype``: the activations' dtype (fp16 on a GPU; the CPU engine runs fp32). A
    configuration that does not fit comes back with ``problem`` set (the engine's message)."""
    capacity.check_kv_cache_dtype(kv_cache_dtype)
    if gpu_memory is None and kv_cache_memory_bytes is None:
        raise OnecatError("give --gpu-memory (the memory of one GPU) or --kv-cache-memory-bytes")
    model = shard_model(
        cfg, quant, tensor_parallel_size, dtype, mtp=bool(num_drafts), source=source
    )
    local: ModelConfig = model.config
    weights = weight_bytes(model)
    shape = capacity.model_cache_shape(model, kv_block_size, kv_cache_dtype, num_drafts)
    wanted_len = max_model_len or cfg.max_position_embeddings
    tokens = min(max_num_batched_tokens, wanted_len)
    dtype_bytes = dtype.itemsize
    activations = activation_bytes(local, tokens, max_num_seqs, dtype_bytes)
    overheads = {
        "non_torch": NON_TORCH_BYTES + (TP_COMMUNICATION_BYTES if tensor_parallel_size > 1 else 0),
        "activations": activations,
        "prompt_graphs": 0 if enforce_eager else activations,
        "sampling": max_num_seqs * cfg.vocab_size * SAMPLING_BYTES_PER_LOGIT,
        "graph_reserve": GRAPH_RESERVE_BYTES,
    }
    problem = None
    usable = None
    if kv_cache_memory_bytes is not None:
        budget, budget_from = kv_cache_memory_bytes, "--kv-cache-memory-bytes"
        if gpu_memory is not None:
            usable = gpu_memory
            left = gpu_memory - weights - sum(overheads.values())
            if kv_cache_memory_bytes > left:
                problem = (
                    f"does not fit: --kv-cache-memory-bytes {kv_cache_memory_bytes} "
                    f"({gib(kv_cache_memory_bytes)}) exceeds the {gib(max(0, left))} the weights "
                    f"({gib(weights)}) and runtime reserves ({gib(sum(overheads.values()))}) leave of "
                    f"--gpu-memory {gib(gpu_memory)}; lower it, or use "
                    f"{capacity.fit_hints(tensor_parallel_size, kv_cache_dtype)}"
                )
    else:
        usable = int(gpu_memory * gpu_memory_utilization)
        budget, budget_from = usable - weights - sum(overheads.values()), "--gpu-memory-utilization"
        if budget <= 0:
            problem = capacity.no_room_message(
                weights + sum(overheads.values()),
                usable,
                "the weights and runtime reserves (estimated)",
                tensor_parallel_size=tensor_parallel_size,
                kv_cache_dtype=kv_cache_dtype,
            )
    cache = capacity.plan_caches(
        max(budget, 0),
        shape,
        max_num_seqs=max_num_seqs,
        max_len=wanted_len,
        prefix_caching=enable_prefix_caching and shape.slot_bytes > 0,
        num_kv_blocks=num_kv_blocks,
    )
    if problem is None:
        try:
            capacity.check_fits(
                cache,
                max_model_len,
                tensor_parallel_size=tensor_parallel_size,
                kv_cache_dtype=kv_cache_dtype,
            )
        except OnecatError as exc:
            problem = str(exc)
    report = CapacityReport(
        model=model_name,
        tensor_parallel_size=tensor_parallel_size,
        kv_cache_dtype=kv_cache_dtype,
        gpu_memory=gpu_memory,
        usable_bytes=usable,
        budget_from=budget_from,
        weight_bytes=weights,
        overheads=overheads,
        cache=cache,
        max_model_len=max_model_len,
        model_max_len=cfg.max_position_embeddings,
        problem=problem,
    )
    for length in CONCURRENCY_LENGTHS:
        report.concurrency[length] = (
            0 if problem or length > report.serving_len else cache.concurrency(length)
        )
    return report


def read_artifact(path: str | Path) -> tuple[ModelConfig, QuantPlan]:
    """The model facts and packed-linear plan of the checkpoint or artifact at ``path``, from
    config.json and the safetensors headers only (no tensor is read)."""
    from onecat.runtime.loader import WeightSource, read_model_config

    path = Path(path)
    raw, cfg = read_model_config(path)
    return cfg, WeightSource(path, raw).plan()


def plan_artifact(path: str | Path, **flags: Any) -> CapacityReport:
    """:func:`plan_capacity` of the checkpoint or packed artifact at ``path``."""
    path = Path(path)
    cfg, quant = read_artifact(path)
    return plan_capacity(
        cfg, quant, model_name=path.name, source=str(path / "config.json"), **flags
    )


def check_engine_config(config: EngineConfig, dtype: torch.dtype) -> None:
    """Before any weight loads: refuse (OnecatError, the message ``onecat plan`` prints) an
    engine configuration whose exact cache budget (``kv_cache_memory_bytes``) cannot hold one
    ``max_model_len`` sequence. Without that flag the budget is only known after the engine's
    memory profile, where the engine's planner makes the same check."""
    from onecat.runtime.engine.speculative import SpeculativeConfig

    capacity.check_kv_cache_dtype(config.kv_cache_dtype)
    if config.kv_cache_memory_bytes is None:
        return
    speculation = SpeculativeConfig.parse(config.speculative_config)
    report = plan_artifact(
        config.model,
        gpu_memory=None,
        tensor_parallel_size=config.tensor_parallel_size,
        kv_cache_dtype=config.kv_cache_dtype,
        max_model_len=config.max_model_len,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        kv_block_size=config.kv_block_size,
        num_kv_blocks=config.num_kv_blocks,
        dtype=dtype,
        num_drafts=speculation.num_speculative_tokens if speculation else 0,
    )
    if report.problem:
        raise OnecatError(report.problem)


def report_table(report: CapacityReport) -> Any:
    """The report as a rich table (``onecat plan``)."""
    from rich.table import Table

    table = Table(
        title=f"{report.model}: per GPU, -tp {report.tensor_parallel_size}, "
        f"--kv-cache-dtype {report.kv_cache_dtype}",
        show_header=False,
    )
    table.add_column("item")
    table.add_column("value", justify="right")
    table.add_column("note")
    cache, shape = report.cache, report.cache.shape
    if report.gpu_memory is not None:
        table.add_row(
            "GPU memory",
            gib(report.gpu_memory),
            "usable (x --gpu-memory-utilization): " + gib(report.usable_bytes or 0)
            if report.budget_from == "--gpu-memory-utilization"
            else "--kv-cache-memory-bytes given",
        )
    table.add_row("weights", gib(report.weight_bytes), "exact: the tensors the engine allocates")
    notes = {
        "non_torch": "CUDA context, kernels (NON_TORCH_BYTES"
        + (" + TP_COMMUNICATION_BYTES)" if report.tensor_parallel_size > 1 else ")"),
        "activations": "one --max-num-batched-tokens prefill (estimated)",
        "prompt_graphs": "piecewise CUDA graphs' pool (estimated; 0 with --enforce-eager)",
        "sampling": "--max-num-seqs x vocab x SAMPLING_BYTES_PER_LOGIT",
        "graph_reserve": "GRAPH_RESERVE_BYTES: graph pools, allocator slack",
    }
    for name, size in report.overheads.items():
        table.add_row(f"  {name.replace('_', ' ')}", gib(size), notes[name])
    table.add_row("KV cache + GDN states", gib(cache.budget), f"from {report.budget_from}")
    table.add_row(
        "  KV blocks",
        str(cache.num_blocks),
        f"{shape.block_size} tokens, {gib(shape.block_bytes)} each",
    )
    table.add_row(
        "  state slots",
        str(cache.num_slots),
        f"{gib(shape.per_slot_bytes)} each (of --max-num-seqs {cache.wanted_slots})",
    )
    table.add_row("  state checkpoints", str(cache.num_checkpoints), "prefix caching")
    table.add_row(
        "longest context",
        str(cache.capacity_tokens if shape.block_bytes else report.model_max_len),
        f"tokens the KV cache holds; max_model_len {report.serving_len}",
    )
    for length, n in report.concurrency.items():
        table.add_row(
            f"sequences of {length // 1024}k", str(n), "at once (KV blocks and a state slot each)"
        )
    return table
