"""What each tensor-parallel rank owns, and a weight source that hands it only that.

Rank ``r`` of ``N`` builds the single-GPU model of its shard: a :class:`ModelConfig` whose
head counts and intermediate sizes are divided by ``N`` (:func:`shard_config`), so every
layer, the KV cache and the GDN state slots take their per-rank sizes with no model code
knowing about ranks. The split follows Megatron / vLLM:

- column parallel, split by heads (each rank owns whole heads): attention ``q_proj`` (query
  and gate rows of a head stay together), ``k_proj`` / ``v_proj`` (KV heads; when ``N``
  exceeds the KV heads, each KV head is replicated on ``N / kv_heads`` ranks, as vLLM does),
  GDN ``in_proj_qkv`` (its q, k and v sections each split by key / value heads; the
  depthwise ``conv1d`` channels likewise), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
  ``A_log`` and ``dt_bias`` by value heads; MLP and shared-expert ``gate_proj`` / ``up_proj``;
- row parallel (the input split the same way; the partial sums are added by the one
  all-reduce after the mixer or the MLP / MoE block): ``o_proj``, GDN ``out_proj``,
  ``down_proj`` (a bias is kept by rank 0 only);
- expert parallel: rank ``r`` owns routed experts ``r*E/N .. (r+1)*E/N - 1`` whole
  (``layers/expert_parallel.py``); the router and the shared-expert gate are replicated, the
  shared expert is split like a dense MLP (the block is linear in both, so the all-reduce
  after it sums routed and shared parts at once);
- vocab parallel (as vLLM's ``ParallelLMHead``): ``lm_head``, float or packed, by output
  rows: rank ``r`` holds vocabulary rows ``r*R .. (r+1)*R - 1``, ``R`` the vocabulary over
  ``N`` rounded up to 32-row tiles (``ModelConfig.lm_head_rows``), the last slices padded
  with zero rows; every rank computes its logits and one all-gather gives every rank all of
  them, the padding cut off (``Qwen3_5ForCausalLM.compute_logits``; rank 0 samples). The
  MTP drafter's 4-bit head is made from the rank's rows and gathered the same way. With tied
  embeddings the rank's ``lm_head`` is a view of its rows of the whole embedding;
- replicated: embeddings, norms, the router.

Packed linears are cut with :func:`onecat.pack.volta_layout.slice_volta`, the rule the vLLM
plugin uses; a slice the Volta layout cannot hold is refused by
:func:`~onecat.pack.partitions.check_partition`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from onecat.errors import OnecatError
from onecat.formats.fp16_headroom import HeadroomPlan, plan_from_config
from onecat.pack.partitions import check_partition
from onecat.pack.volta_layout import TILE, slice_volta
from onecat.runtime.distributed.parallel_state import tp_rank, tp_size
from onecat.runtime.layers.linear import LinearWeights
from onecat.runtime.loader import WeightSource, load_weights, read_model_config
from onecat.runtime.models.config import ModelConfig, vocab_rows_per_partition
from onecat.runtime.models.qwen3_5 import Qwen3_5ForCausalLM
from onecat.runtime.quant_plan import QuantPlan

COLUMN_BY_HEADS = (".self_attn.q_proj", ".linear_attn.in_proj_z", ".linear_attn.in_proj_a",
                   ".linear_attn.in_proj_b", ".mlp.gate_proj", ".mlp.up_proj",
                   ".shared_expert.gate_proj", ".shared_expert.up_proj")
COLUMN_KV = (".self_attn.k_proj", ".self_attn.v_proj")
ROW = (".self_attn.o_proj", ".linear_attn.out_proj", ".mlp.down_proj", ".shared_expert.down_proj")
GDN_QKV = ".linear_attn.in_proj_qkv"
GDN_CONV = ".linear_attn.conv1d.weight"
GDN_PER_HEAD = (".linear_attn.A_log", ".linear_attn.dt_bias")
LM_HEAD = "lm_head"


def _split_counts(cfg: ModelConfig) -> dict[str, int]:
    counts = {
        "num_attention_heads": cfg.num_attention_heads,
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
    }
    if cfg.is_moe:
        counts["num_experts"] = cfg.num_experts
        counts["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    else:
        counts["intermediate_size"] = cfg.intermediate_size
    return counts


def _fits(cfg: ModelConfig, world_size: int) -> list[str]:
    problems = [f"{name} {n}" for name, n in _split_counts(cfg).items() if n % world_size]
    kv = cfg.num_key_value_heads
    if kv % world_size and world_size % kv:
        problems.append(f"num_key_value_heads {kv} (must divide, or be divided by, the size)")
    return problems


def shard_config(cfg: ModelConfig, world_size: int, source: str = "config.json") -> ModelConfig:
    """The model config of one rank's shard: head counts, the dense MLP's and the shared
    expert's intermediate sizes divided by ``world_size`` (KV heads: at least 1), the
    vocabulary split ``world_size`` ways for ``lm_head`` (``vocab_partitions``). The routed
    experts' count stays global (the router scores all of them), as does ``vocab_size``.

    Raises OnecatError naming every count that ``world_size`` does not divide, and the sizes
    that would work.
    """
    if world_size < 1:
        raise OnecatError(f"--tensor-parallel-size must be at least 1, got {world_size}")
    problems = _fits(cfg, world_size)
    if problems:
        allowed = [n for n in range(1, 65) if not _fits(cfg, n)]
        raise OnecatError(
            f"{source}: --tensor-parallel-size {world_size} does not divide this model's "
            f"{', '.join(problems)}; every rank must own whole heads and experts. Sizes that "
            f"work for this model: {', '.join(map(str, allowed))}"
        )
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // world_size,
        num_key_value_heads=max(1, cfg.num_key_value_heads // world_size),
        linear_num_key_heads=cfg.linear_num_key_heads // world_size,
        linear_num_value_heads=cfg.linear_num_value_heads // world_size,
        intermediate_size=cfg.intermediate_size // world_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // world_size,
        vocab_partitions=world_size,
    )


def check_shardable(path: str | Path, world_size: int) -> None:
    """Raise OnecatError unless checkpoint ``path`` can be split ``world_size`` ways (cheap:
    reads config.json only; called before worker processes start)."""
    if world_size != 1:
        path = Path(path)
        shard_config(read_model_config(path)[1], world_size, str(path / "config.json"))


def expert_range(num_experts: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first expert, count) of the routed experts rank ``rank`` owns."""
    count = num_experts // world_size
    return rank * count, count


def _piece(size: int, parts: int, index: int) -> tuple[int, int]:
    step = size // parts
    return index * step, step


def _padded(t: torch.Tensor, start: int, count: int, rows: int) -> torch.Tensor:
    """Rows ``start .. start + count - 1`` of ``t`` followed by zero rows, ``rows`` in all."""
    out = t.new_zeros((rows, *t.shape[1:]))
    out[:count] = t[start : start + count]
    return out


class ShardedWeightSource:
    """This rank's view of a weight source (a :class:`~onecat.runtime.loader.WeightSource`,
    or anything with its ``path``, ``actual``, ``plan``, ``linear``, ``expert`` and
    ``tensor``): linears and tensors are sliced as the module docstring says, expert ``e``
    is the rank's ``e``-th expert. ``cfg`` is the full (unsharded) model config."""

    def __init__(self, base: Any, cfg: ModelConfig, rank: int, world_size: int) -> None:
        self.base, self.path = base, base.path
        self.rank, self.world_size = rank, world_size
        key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        self._gdn_sections = [key_dim, key_dim, value_dim]
        kv = cfg.num_key_value_heads
        # KV heads: split when there are at least as many as ranks, else replicated
        self._kv_parts = min(kv, world_size)
        self._kv_index = rank if kv >= world_size else rank * kv // world_size
        self.first_expert = expert_range(cfg.num_experts, rank, world_size)[0] if cfg.is_moe else 0
        self.vocab_size, self.lm_head_rows = cfg.vocab_size, vocab_rows_per_partition(cfg.vocab_size, world_size)

    def actual(self, name: str) -> str:
        """The checkpoint's key for text-model name ``name``."""
        return self.base.actual(name)

    def plan(self) -> QuantPlan:
        """Which linears are quantized (the same on every rank)."""
        return self.base.plan()

    # --- linears -----------------------------------------------------------------------

    def linear(self, name: str) -> LinearWeights | None:
        """This rank's slice of linear ``name`` (None if absent)."""
        weights = self.base.linear(name)
        if weights is None:
            return None
        if name.endswith(GDN_QKV):
            return self._rows(name, weights, self._gdn_sections, self.world_size, self.rank)
        if name.endswith(COLUMN_KV):
            return self._rows(name, weights, [self._rows_of(weights)], self._kv_parts, self._kv_index)
        if name.endswith(COLUMN_BY_HEADS):
            return self._rows(name, weights, [self._rows_of(weights)], self.world_size, self.rank)
        if name.endswith(ROW):
            return self._columns(name, weights)
        if name == LM_HEAD:
            return self._vocab_rows(name, weights)
        return weights  # replicated: router, shared-expert gate, experts

    @staticmethod
    def _rows_of(w: LinearWeights) -> int:
        return w.qweight.shape[0] * TILE if w.is_packed else w.weight.shape[0]

    def _rows(self, name: str, w: LinearWeights, sections: list[int], parts: int, index: int) -> LinearWeights:
        """Piece ``index`` of ``parts`` of each row section, concatenated (column parallel)."""
        if sum(sections) != self._rows_of(w):
            raise OnecatError(f"{self.path}: {self.actual(name)} has {self._rows_of(w)} rows, "
                              f"the config implies {sum(sections)}")
        pieces, offset = [], 0
        for size in sections:
            start, rows = _piece(size, parts, index)
            pieces.append((offset + start, rows))
            offset += size
        bias = None if w.bias is None else torch.cat([w.bias[s : s + r] for s, r in pieces])
        if not w.is_packed:
            return LinearWeights(weight=torch.cat([w.weight[s : s + r] for s, r in pieces]), bias=bias)
        k = w.qweight.shape[1] * TILE
        check_partition(self.actual(name), [r for _, r in pieces], k, w.group_size)
        q = torch.cat([w.qweight[s // TILE : (s + r) // TILE] for s, r in pieces])
        sz = torch.cat([w.scales_zeros[s // TILE : (s + r) // TILE] for s, r in pieces])
        return LinearWeights(qweight=q, scales_zeros=sz, group_size=w.group_size, bias=bias)

    def _vocab_rows(self, name: str, w: LinearWeights) -> LinearWeights:
        """This rank's ``lm_head_rows`` rows of the vocabulary (vocab parallel), rows past the
        vocabulary zero (a packed slice: whole tiles, scales and ``-z * s`` zero, so they
        dequantise to 0)."""
        if self._rows_of(w) != self.vocab_size:
            raise OnecatError(f"{self.path}: {self.actual(name)} has {self._rows_of(w)} rows, "
                              f"config.json's vocab_size is {self.vocab_size}")
        start = self.rank * self.lm_head_rows
        have = max(0, min(self.lm_head_rows, self.vocab_size - start))  # the rest is padding
        bias = None if w.bias is None else _padded(w.bias, start, have, self.lm_head_rows)
        if not w.is_packed:
            return LinearWeights(weight=_padded(w.weight, start, have, self.lm_head_rows), bias=bias)
        q = _padded(w.qweight, start // TILE, have // TILE, self.lm_head_rows // TILE)
        sz = _padded(w.scales_zeros, start // TILE, have // TILE, self.lm_head_rows // TILE)
        return LinearWeights(qweight=q, scales_zeros=sz, group_size=w.group_size, bias=bias)

    def _columns(self, name: str, w: LinearWeights) -> LinearWeights:
        """This rank's slice of the inputs (row parallel); rank 0 keeps the bias."""
        bias = w.bias if w.bias is None or self.rank == 0 else torch.zeros_like(w.bias)
        if not w.is_packed:
            k = w.weight.shape[1]
            start, cols = _piece(k, self.world_size, self.rank)
            return LinearWeights(weight=w.weight[:, start : start + cols], bias=bias)
        k = w.qweight.shape[1] * TILE
        check_partition(self.actual(name), [w.qweight.shape[0] * TILE], k // self.world_size, w.group_size)
        q, sz = slice_volta(w.qweight, w.scales_zeros, w.group_size, "in", self.rank, self.world_size)
        return LinearWeights(qweight=q, scales_zeros=sz, group_size=w.group_size, bias=bias)

    def expert(self, prefix: str, expert: int, which: str) -> LinearWeights:
        """This rank's ``expert``-th routed expert (global ``first_expert + expert``), whole."""
        return self.base.expert(prefix, self.first_expert + expert, which)

    # --- other tensors -----------------------------------------------------------------

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name``: GDN conv channels and per-head decays sliced, the rest whole."""
        t = self.base.tensor(name)
        if name.endswith(GDN_CONV):
            pieces, offset = [], 0
            for size in self._gdn_sections:
                start, rows = _piece(size, self.world_size, self.rank)
                pieces.append(t[offset + start : offset + start + rows])
                offset += size
            return torch.cat(pieces)
        if name.endswith(GDN_PER_HEAD):
            start, rows = _piece(t.shape[0], self.world_size, self.rank)
            return t[start : start + rows]
        return t


def load_model_shard(
    path: str | Path, device: torch.device, dtype: torch.dtype, *, mtp: bool = False,
    headroom: HeadroomPlan | None = None,
) -> Qwen3_5ForCausalLM:
    """This rank's shard of checkpoint ``path`` (``onecat.runtime.loader.load_model`` at
    tensor-parallel size 1; ``mtp``: with the multi-token-prediction head, its decoder layer
    split like the model's; ``headroom``: the fp16 headroom plan, None for config.json's).
    Call after ``parallel_state.init_tensor_parallel``."""
    from onecat.runtime.loader import apply_norm_eps, check_mtp, load_model

    world = tp_size()
    if world == 1:
        return load_model(path, device, dtype, mtp=mtp, headroom=headroom)
    path = Path(path)
    raw, cfg = read_model_config(path)
    local = shard_config(cfg, world, str(path / "config.json"))
    plan = headroom if headroom is not None else plan_from_config(raw, str(path / "config.json"))
    base = WeightSource(path, raw, plan)
    if mtp:
        check_mtp(base)
    source = ShardedWeightSource(base, cfg, tp_rank(), world)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(local, source.plan(), dtype, mtp=mtp)
    load_weights(model, source)
    apply_norm_eps(model, base)
    return model
