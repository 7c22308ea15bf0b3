"""Building one decoder layer from checkpoint tensors with transformers' own classes.

The recipe names the decoder-layer and rotary-embedding classes; the layer is instantiated
on the meta device (no memory, no random init), fused MoE experts are swapped for
:class:`~onecat.quantize.moe.ExpertList`, and the checkpoint tensors are assigned in the
compute dtype. Attention runs through SDPA with no mask (is_causal): calibration samples are
full-length, unpadded sequences.
"""

from __future__ import annotations

import torch
from torch import nn

from onecat.errors import OnecatError
from onecat.quantize.moe import ExpertList, split_fused_experts
from onecat.quantize.recipe import Recipe, import_class


def _get_module(root: nn.Module, dotted: str) -> nn.Module | None:
    try:
        return root.get_submodule(dotted)
    except AttributeError:
        return None


class LayerFactory:
    """Builds decoder layers and their position embeddings for one model."""

    def __init__(self, recipe: Recipe, config, device: torch.device, dtype: torch.dtype) -> None:
        self.recipe = recipe
        self.config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.config._attn_implementation = "sdpa"
        self.device, self.dtype = device, dtype
        self.layer_cls = import_class(recipe.decoder_layer, recipe, "architecture.decoder_layer")
        rotary_cls = import_class(recipe.rotary_embedding, recipe, "architecture.rotary_embedding")
        self.rotary = rotary_cls(config=self.config).to(device)
        self._position_cache: dict[tuple[int, int], tuple] = {}

    @property
    def num_layers(self) -> int:
        """Decoder layers in the model (config.num_hidden_layers)."""
        return int(self.config.num_hidden_layers)

    def position_embeddings(self, batch: int, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for positions 0..seqlen-1, as the model's rotary embedding computes them."""
        key = (batch, seqlen)
        if key not in self._position_cache:
            position_ids = torch.arange(seqlen, device=self.device).unsqueeze(0).expand(batch, -1)
            probe = torch.empty(1, dtype=self.dtype, device=self.device)
            rotary_ids = position_ids
            if hasattr(self.rotary, "mrope_section"):
                # Multimodal RoPE (Qwen3.5): text positions repeat on its 3 axes. transformers
                # 5.17 requires the (3, batch, seq) form; later releases also accept 2-D.
                rotary_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
            self._position_cache[key] = (self.rotary(probe, rotary_ids), position_ids)
        return self._position_cache[key]

    def build(self, index: int, tensors: dict[str, torch.Tensor], where: str) -> nn.Module:
        """Instantiate layer ``index`` and load ``tensors`` (layer-relative names) into it."""
        with torch.device("meta"):
            layer = self.layer_cls(self.config, index)
        experts = self.recipe.experts
        if experts is not None and _get_module(layer, experts.module) is not None:
            fused = _get_module(layer, experts.module)
            gate_up = getattr(fused, experts.gate_up_proj)
            num, two_inter, hidden = gate_up.shape
            parent_name, _, child = experts.module.rpartition(".")
            parent = _get_module(layer, parent_name) if parent_name else layer
            with torch.device("meta"):
                replacement = ExpertList(num, hidden, two_inter // 2, fused.act_fn)
            setattr(parent, child, replacement)
            tensors = split_fused_experts(
                tensors, experts.module, experts.gate_up_proj, experts.down_proj
            )
        # copy=True: the layer is modified in place (smoothing, clipping), and .to() alone
        # would alias float32 CPU source tensors, corrupting the caller's originals
        state = {
            k: v.to(device=self.device, dtype=self.dtype if v.is_floating_point() else v.dtype, copy=True)
            for k, v in tensors.items()
        }
        expected = set(layer.state_dict())
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - expected)
        if missing or unexpected:
            raise OnecatError(
                f"{where}: checkpoint tensors do not match {self.layer_cls.__name__} "
                f"(missing: {', '.join(missing[:5]) or 'none'}; unexpected: "
                f"{', '.join(unexpected[:5]) or 'none'}); the checkpoint is incomplete or the "
                f"recipe {self.recipe.path} does not fit this model"
            )
        layer.load_state_dict(state, assign=True, strict=True)
        for name, buf in layer.named_buffers():
            if buf.is_meta:
                raise OnecatError(f"{where}: buffer {name} has no value after loading")
        # keep fp32 where transformers wants it (A_log is read as .float() anyway)
        return layer.eval()

    def run(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Run ``layer`` on a batch ``hidden [B, L, H]``; returns the new hidden states."""
        (cos_sin, position_ids) = self.position_embeddings(hidden.shape[0], hidden.shape[1])
        out = layer(
            hidden,
            position_embeddings=cos_sin,
            attention_mask=None,
            position_ids=position_ids,
        )
        return out[0] if isinstance(out, tuple) else out
