"""Which linears of a model are stored 4-bit packed, decided per module from the checkpoint.

Checkpoints in the wild mix quantized and float modules (some leave layer-0 experts or the
attention projections in fp16), so the decision is per source linear, never per file. A
merged layer (q/k/v, gate/up, ...) is packed only when all of its parts are, with one group
size, and the result fits the Volta layout; otherwise its parts are dequantised and it
computes in floating point.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onecat.pack.volta_layout import TILE, fits_layout

ALWAYS_FLOAT = ("lm_head", ".mlp.gate", ".shared_expert_gate", ".in_proj_a", ".in_proj_b")
"""Name endings of the source linears a default plan keeps in floating point (as AWQ
checkpoints, and onecat's Qwen3.5 recipes, do): the output head, the MoE router, the
shared-expert gate and the GDN's one-row-per-head b and a projections."""


@dataclass
class QuantPlan:
    """``group_sizes`` maps a quantized source linear's prefix (text-model names,
    ``model.layers.N....``) to its group size; ``default`` packs every other linear that fits
    with that group size (used to build random packed models), except ``ALWAYS_FLOAT``."""

    group_sizes: dict[str, int] = field(default_factory=dict)
    default: int | None = None

    def lookup(self, source: str) -> int | None:
        """Group size of one source linear, None when it is float."""
        if source in self.group_sizes:
            return self.group_sizes[source]
        if self.default is not None and not source.endswith(ALWAYS_FLOAT):
            return self.default
        return None

    def group_size(self, sources: list[str], output_sizes: list[int], in_features: int) -> int | None:
        """Group size for a layer merging ``sources`` (parts of ``output_sizes`` rows), or None
        when it must compute in floating point."""
        sizes = {self.lookup(s) for s in sources}
        if len(sizes) != 1 or None in sizes:
            return None
        group = sizes.pop()
        if any(n % TILE for n in output_sizes) or not fits_layout(sum(output_sizes), in_features, group):
            return None
        return group
