"""How many KV blocks and GDN state slots a byte budget holds: the one place that arithmetic lives.

The engine's memory planner (``engine/model_runner.py``) and ``onecat plan``
(``runtime/plan.py``) both call :func:`plan_caches`, so they cannot disagree. Given the bytes
of the per-GPU KV cache + Gated-DeltaNet state pool (``--kv-cache-memory-bytes``, or what
``--gpu-memory-utilization`` leaves after the weights and the runtime's reserves), the pool is
split as the engine allocates it:

1. one scratch KV block and one scratch state row (the rows CUDA-graph padding writes to);
2. ``--max-num-seqs`` state slots (each one sequence's conv + recurrent states over every GDN
   layer, plus a row per draft position with speculative decoding), fewer when they would take
   more than half of the budget (``SLOT_SHARE``);
3. with prefix caching, up to ``MAX_STATE_CHECKPOINTS`` state checkpoint rows (at most
   ``max_num_seqs`` of them and an eighth of the budget, ``CHECKPOINT_SHARE``);
4. the rest in KV blocks of ``block_size`` tokens over every full-attention layer.

So the whole allocation never exceeds the budget. A sequence of ``L`` tokens holds
``ceil(L / block_size)`` blocks and one slot. The bytes per cache element come from
:func:`kv_element_bytes`, the one registry of ``--kv-cache-dtype`` values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from onecat.errors import OnecatError

MAX_STATE_CHECKPOINTS = 16
"""Most GDN state checkpoints kept for prefix caching (each is a whole slot: ~151 MB on the 27B)."""
SLOT_SHARE = 2
"""State slots may take at most 1/SLOT_SHARE of the budget (beyond it ``max_num_seqs`` is cut)."""
CHECKPOINT_SHARE = 8
"""State checkpoints may take at most 1/CHECKPOINT_SHARE of the budget."""
RECURRENT_STATE_BYTES = 4
"""The GDN recurrent state is fp32 whatever the activations' dtype."""

@dataclass(frozen=True)
class KVCacheDtype:
    """What one ``--kv-cache-dtype`` costs: bytes per cached key / value element (None: the
    activations' dtype, vLLM's ``auto``) and bytes per cached token and KV head beside them
    (the int8 cache's fp32 scale, one for the key and one for the value)."""

    element_bytes: int | None
    scale_bytes: int = 0


KV_CACHE_DTYPES: dict[str, KVCacheDtype] = {
    "auto": KVCacheDtype(None),
    "fp8_e5m2": KVCacheDtype(1),  # the top byte of the fp16 value (onecat.kernels.kv_cache)
    "int8": KVCacheDtype(1, 4),  # symmetric codes, one fp32 scale per token and KV head
}
"""``--kv-cache-dtype`` choices (vLLM's names) -> their :class:`KVCacheDtype`; the encodings
are ``onecat.kernels.kv_cache``'s. Every flag, plan and planner takes what is listed here."""


def kv_cache_dtype_choices() -> list[str]:
    """The ``--kv-cache-dtype`` values this onecat serves."""
    return list(KV_CACHE_DTYPES)


def check_kv_cache_dtype(name: str) -> str:
    """``name`` when it is a ``--kv-cache-dtype`` this onecat serves; else OnecatError naming
    the flag and the choices."""
    if name not in KV_CACHE_DTYPES:
        raise OnecatError(
            f"--kv-cache-dtype {name} is not supported by this onecat (choices: "
            f"{', '.join(KV_CACHE_DTYPES)}); use --kv-cache-dtype auto (the activations' dtype, "
            "fp16 on a GPU)"
        )
    return name


def kv_element_bytes(kv_cache_dtype: str, activation_bytes: int) -> int:
    """Bytes of one cached key or value element for ``kv_cache_dtype`` (``activation_bytes``:
    the model's activation element size, used by ``auto``)."""
    size = KV_CACHE_DTYPES[check_kv_cache_dtype(kv_cache_dtype)].element_bytes
    return activation_bytes if size is None else size


def kv_scale_bytes(kv_cache_dtype: str) -> int:
    """Bytes stored per cached token and KV head beside the key's (or the value's) elements:
    the int8 cache's scale, 0 for the others."""
    return KV_CACHE_DTYPES[check_kv_cache_dtype(kv_cache_dtype)].scale_bytes


def kv_block_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, element_bytes: int,
    scale_bytes: int = 0,
) -> int:
    """Bytes of one KV block (keys and values of ``block_size`` tokens, with ``scale_bytes``
    per token, head and key / value beside them) over ``num_layers`` full-attention layers of
    one GPU."""
    return num_layers * block_size * 2 * num_kv_heads * (head_dim * element_bytes + scale_bytes)


def gdn_state_bytes(
    conv_dim: int,
    conv_kernel: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    element_bytes: int,
) -> int:
    """Bytes of one sequence's states in one GDN layer: the last ``conv_kernel - 1`` conv
    inputs (activation dtype) and the fp32 recurrent state ``[H_v, d_k, d_v]``."""
    conv = conv_dim * (conv_kernel - 1) * element_bytes
    return conv + num_v_heads * head_k_dim * head_v_dim * RECURRENT_STATE_BYTES


@dataclass(frozen=True)
class CacheShape:
    """What one cache unit costs on one GPU: a KV block (``block_size`` tokens over every
    full-attention layer; 0 without such layers) and a state row (one sequence over every GDN
    layer; 0 without them). ``num_drafts``: speculative tokens, each needing one more state
    row per slot."""

    block_size: int
    block_bytes: int
    slot_bytes: int
    num_drafts: int = 0

    @property
    def per_slot_bytes(self) -> int:
        """Bytes of one sequence's state slot with its draft rows."""
        return self.slot_bytes * (1 + self.num_drafts)

    def blocks_for(self, tokens: int) -> int:
        """KV blocks a sequence of ``tokens`` tokens holds."""
        return -(-tokens // self.block_size)


@dataclass(frozen=True)
class CachePlan:
    """The engine's cache sizes for one budget (:func:`plan_caches`)."""

    budget: int
    num_blocks: int
    num_slots: int
    num_checkpoints: int
    wanted_slots: int
    shape: CacheShape

    @property
    def capacity_tokens(self) -> int:
        """Tokens the KV blocks hold (the longest context of one sequence)."""
        return self.num_blocks * self.shape.block_size

    @property
    def allocated_bytes(self) -> int:
        """Bytes the engine allocates for these caches (scratch block and row included)."""
        rows = self.num_slots * (1 + self.shape.num_drafts) + 1 + self.num_checkpoints
        return (self.num_blocks + 1) * self.shape.block_bytes + rows * self.shape.slot_bytes

    def concurrency(self, tokens: int) -> int:
        """How many sequences of ``tokens`` tokens run at once: each holds its KV blocks and
        one state slot."""
        if not self.shape.block_bytes:  # only linear attention: blocks are bookkeeping
            return self.num_slots
        return min(self.num_slots, self.num_blocks // self.shape.blocks_for(tokens))


def plan_caches(
    budget: int,
    shape: CacheShape,
    *,
    max_num_seqs: int,
    max_len: int,
    prefix_caching: bool,
    num_kv_blocks: int | None = None,
) -> CachePlan:
    """Split ``budget`` bytes (one GPU's KV cache + GDN state pool) into KV blocks, state slots
    and state checkpoints as the module docstring says. ``max_len``: the longest sequence
    (only used without full-attention layers, where blocks cost nothing); ``num_kv_blocks``
    overrides the block count. ``num_blocks`` is 0 when the budget holds none (see
    :func:`check_fits`)."""
    slots = max_num_seqs
    available = budget - shape.block_bytes - shape.slot_bytes  # the scratch block and row
    per_slot = shape.per_slot_bytes
    if per_slot and slots * per_slot > available // SLOT_SHARE:
        slots = max(1, available // SLOT_SHARE // per_slot)
    checkpoints = (
        min(max_num_seqs, MAX_STATE_CHECKPOINTS) if prefix_caching and shape.slot_bytes else 0
    )
    if checkpoints:
        checkpoints = max(0, min(checkpoints, available // CHECKPOINT_SHARE // shape.slot_bytes))
        available -= checkpoints * shape.slot_bytes
    if num_kv_blocks:
        blocks = num_kv_blocks
    elif not shape.block_bytes:  # only linear attention: blocks are bookkeeping, no memory
        blocks = slots * shape.blocks_for(max_len)
    else:
        blocks = max(0, (available - slots * per_slot) // shape.block_bytes)
    return CachePlan(int(budget), int(blocks), int(slots), int(checkpoints), max_num_seqs, shape)


def gib(n: float) -> str:
    """``n`` bytes for people: GiB with two decimals, MiB or KiB below 1 GiB / 1 MiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def fit_hints(tensor_parallel_size: int, kv_cache_dtype: str = "auto") -> str:
    """What to change when the caches do not fit: more GPUs, a smaller ``--kv-cache-dtype``
    (those of :data:`KV_CACHE_DTYPES` smaller than the current one), a larger budget, fewer
    sequences or a shorter context."""
    current = KV_CACHE_DTYPES.get(kv_cache_dtype, KV_CACHE_DTYPES["auto"]).element_bytes or 2
    smaller = [
        name
        for name, kind in KV_CACHE_DTYPES.items()
        if kind.element_bytes is not None and kind.element_bytes < current
    ]
    hints = [f"-tp {2 * tensor_parallel_size} (more GPUs)"]
    hints += [f"--kv-cache-dtype {name}" for name in smaller]
    hints += [
        "a larger --kv-cache-memory-bytes or --gpu-memory-utilization",
        "a lower --max-num-seqs",
    ]
    return ", ".join(hints)


def check_fits(
    plan: CachePlan,
    max_model_len: int | None,
    *,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
) -> None:
    """Raise OnecatError ("does not fit: ...", naming the flags) unless ``plan`` holds one
    sequence of ``max_model_len`` tokens (None: at least one KV block)."""
    shape = plan.shape
    if not shape.block_bytes:  # nothing grows with the context
        return
    tokens = max_model_len or 1
    if plan.capacity_tokens >= tokens:
        return
    need = shape.blocks_for(tokens)
    wanted = f"one --max-model-len {max_model_len} sequence" if max_model_len else "one sequence"
    shorter = (
        f"a lower --max-model-len (at most {plan.capacity_tokens} fits)"
        if plan.capacity_tokens
        else "a lower --max-model-len"
    )
    raise OnecatError(
        f"does not fit: {wanted} needs {need} KV blocks of {shape.block_size} tokens "
        f"({gib(need * shape.block_bytes)}) and a GDN state slot ({gib(shape.per_slot_bytes)}) per GPU, "
        f"but the KV cache + state budget of {gib(plan.budget)} holds {plan.num_blocks} blocks "
        f"({plan.capacity_tokens} tokens) beside {plan.num_slots} state slots and "
        f"{plan.num_checkpoints} checkpoints; use {fit_hints(tensor_parallel_size, kv_cache_dtype)}, "
        f"or {shorter}"
    )


def no_room_message(
    used: int,
    usable: int,
    what: str,
    *,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
) -> str:
    """The "does not fit" message when ``what`` (weights and runtime reserves, ``used`` bytes)
    leave nothing of the ``usable`` bytes for the caches."""
    return (
        f"does not fit: {what} take {gib(used)} per GPU of the {gib(usable)} usable, leaving no "
        f"memory for the KV cache and GDN states; use {fit_hints(tensor_parallel_size, kv_cache_dtype)}, "
        "or a lower --max-num-batched-tokens"
    )


_SUFFIXES = {
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,  # vLLM's decimal suffixes
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,  # vLLM's binary suffixes
    "kB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)")


def parse_bytes(text: str | int, flag: str) -> int:
    """A byte count as vLLM's ``human_readable_int`` reads it (``8589934592``, ``8G`` = 8 GiB,
    ``8g`` = 8e9, ``25.6k`` = 25600; binary suffixes take whole numbers only), plus ``8GiB`` /
    ``8GB``. OnecatError naming ``flag`` otherwise."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.fullmatch(text.strip())
        unit = match.group(2) if match else None
        if match is None or unit not in ("", *_SUFFIXES):
            raise OnecatError(
                f"{flag} {text!r} is not a size; give bytes (8589934592) or a number with a unit: "
                "8G / 8GiB (2^30), 8g / 8GB (10^9), also K M T, KiB MiB TiB, k m t"
            )
        number = match.group(1)
        binary = unit in ("K", "M", "G", "T") or unit.endswith("iB")
        if "." in number and (binary or not unit):
            raise OnecatError(
                f"{flag} {text!r}: a fraction needs a decimal unit (k m g t, kB MB GB TB), "
                "e.g. 8.5GB, or whole binary units, e.g. 8704M"
            )
        value = int(float(number) * _SUFFIXES[unit]) if unit else int(number)
    if value <= 0:
        raise OnecatError(f"{flag} must be a positive number of bytes, got {text!r}")
    return value


def model_cache_shape(
    model: Any, block_size: int, kv_cache_dtype: str = "auto", num_drafts: int = 0
) -> CacheShape:
    """The :class:`CacheShape` of a built model (a rank's shard; real or meta tensors): its
    full-attention layers (the MTP head's included) and GDN layers, as the engine allocates
    them (KV in ``kv_cache_dtype``, conv states in the model's dtype)."""
    from onecat.runtime.layers.attention import PagedAttention
    from onecat.runtime.models.qwen3_5 import GatedDeltaNet

    cfg = model.config
    dtype_bytes = model.model.embed_tokens.weight.element_size()
    attention = sum(isinstance(m, PagedAttention) for m in model.modules())
    element = kv_element_bytes(kv_cache_dtype, dtype_bytes)
    block = kv_block_bytes(
        attention, cfg.num_key_value_heads, cfg.head_dim, block_size, element,
        kv_scale_bytes(kv_cache_dtype),
    )  # fmt: skip
    slot = sum(
        gdn_state_bytes(
            m.conv_dim,
            m.conv1d.weight.shape[1],
            m.num_v_heads,
            m.head_k_dim,
            m.head_v_dim,
            dtype_bytes,
        )
        for m in model.modules()
        if isinstance(m, GatedDeltaNet)
    )
    return CacheShape(block_size, block, slot, num_drafts)
