"""CUDA graphs for passes with prompt tokens, captured piece by piece between the mixers' cores.

A prompt pass cannot be one graph: attention and Gated DeltaNet mix tokens within each
sequence, so their work depends on how the step's tokens split into sequences (lengths,
tokens already cached, state slots). Everything else in a layer works token by token:
projections, norms, RoPE, gates, the MLP or the grouped MoE op (which routes on the GPU).
Run eagerly, that token-wise part is ~70 kernel launches per layer, and a prompt pass of a
few hundred tokens spends most of its time launching them (measured on the 35B-A3B shape:
~70 ms of host time against ~20 ms of GPU time).

So, as vLLM's piecewise graphs do, the runner captures for each token-count bucket one graph
per stretch between two cores:

- stretch 0: the embedding, layer 0's input norm and its mixer's projections;
- stretch i (1..L-1): layer i-1's output gate and projection, residual add and norm, MLP or
  MoE, then layer i's input norm and projections;
- stretch L: the last layer's tail and the final norm.

A pass pads its ``n`` tokens to the bucket, replays the stretches in order, and between
them runs each mixer's ``core`` eagerly on the first ``n`` rows, in the pass's
``ForwardContext`` (KV writes, slots and lengths concern the real tokens only; padding rows
are token-wise garbage that nothing reads). Where a layer's token-wise projection writes its
keys and values into the KV cache itself (the fused attention-input kernel), the stretches
read the KV slots from a static buffer (``slots``: the pass's slot mapping, -1 on padding
rows, which write nothing). A step that decodes some sequences while it
prefills others runs as one such pass: the cores handle both kinds of tokens, and the
weights (all experts, for a MoE prompt) are read once for the whole step. Steps with only
decode tokens replay the whole-model decode graphs instead (no eager cores at all). Stretches hand tensors to each other and to the
cores through static buffers, one set sized for the largest bucket (smaller buckets use their
leading rows), so memory does not grow with depth. All graphs share the runner's pool and
replay in capture order, one pass at a time.
"""

from __future__ import annotations

import logging

import torch

from onecat.runtime.context import ForwardContext, set_context
from onecat.runtime.distributed.parallel_state import all_reduce_add_rms_norm
from onecat.runtime.engine import graph_capture
from onecat.runtime.layers import fusion
from onecat.runtime.layers.moe import FusedExperts
from onecat.runtime.models.qwen3_5 import GatedDeltaNet, Qwen3_5ForCausalLM

logger = logging.getLogger(__name__)

MIN_BUCKET = 16
FINE_FROM = 128
"""From this many tokens on, a bucket also sits halfway between two powers of two: there a
pass is compute-bound (dequantised cuBLAS GEMMs, every expert's tiles) and its time grows
with the padded count, so a power-of-two ladder wastes up to half of it. On the H200 a
27B-shaped step of 32 decodes beside a 320-token prompt ran in the 512 bucket: its GEMMs
took 36 ms where 352 rows need ~25 (``bench/profile_step.py --mixed 32:320``, 2026-12-01)."""


def supports_prompt_graphs(model: Qwen3_5ForCausalLM) -> bool:
    """True unless the model has fp16 routed experts: their graph-safe path copies every
    token's experts' weights, which only decode batches can afford."""
    return all(m.is_packed for m in model.modules() if isinstance(m, FusedExperts))


def prompt_buckets(limit: int) -> list[int]:
    """Token-count buckets up to ``limit`` (the step's token budget, itself included): powers
    of two from ``MIN_BUCKET``, with 1.5x steps between them from ``FINE_FROM`` on."""
    buckets = []
    size = MIN_BUCKET
    while size < limit:
        buckets.append(size)
        if size >= FINE_FROM and size * 3 // 2 < limit:
            buckets.append(size * 3 // 2)
        size *= 2
    return buckets + [limit]


class PromptGraphs:
    """Piecewise CUDA graphs of the model's prompt pass, one set per token-count bucket."""

    def __init__(self, model: Qwen3_5ForCausalLM, max_tokens: int, pool: object | None) -> None:
        self.model = model
        self.layers = list(model.model.layers)
        self.buckets = prompt_buckets(max_tokens)
        self.size = self.buckets[-1]
        device = model.model.embed_tokens.weight.device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.input_ids = torch.zeros(self.size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.size, dtype=torch.int64, device=device)
        self.slots = torch.full((self.size,), -1, dtype=torch.int64, device=device)  # KV slots; -1: none
        self.buffers: dict[str, torch.Tensor] = {}
        for layer in self.layers:
            mixer = layer.mixer
            if isinstance(mixer, GatedDeltaNet):
                shape = (mixer.num_v_heads, mixer.head_v_dim)
            else:
                shape = (mixer.num_heads, mixer.head_dim)
            self._buffer(f"{layer.layer_type}.core", shape, device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = pool
        self._arity: dict[str, tuple[int, int]] = {}  # layer type -> (core inputs, carried tensors)

    def _buffer(self, name: str, row_shape: tuple[int, ...], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None:
            buf = self.buffers[name] = torch.zeros(self.size, *row_shape, dtype=dtype or self.dtype, device=device)
        return buf

    def _store(self, name: str, values: tuple[torch.Tensor, ...], tokens: int) -> None:
        for i, t in enumerate(values):
            self._buffer(f"{name}{i}", tuple(t.shape[1:]), t.device, t.dtype)[:tokens].copy_(t)

    def _load(self, name: str, count: int, tokens: int) -> tuple[torch.Tensor, ...]:
        return tuple(self.buffers[f"{name}{i}"][:tokens] for i in range(count))

    def _stretch(self, index: int, tokens: int) -> None:
        """Stretch ``index`` on the buffers' first ``tokens`` rows (captured, or run once to warm up)."""
        positions = self.positions[:tokens]
        if index == 0:
            x, residual = self.model.model.embed_tokens(self.input_ids[:tokens]), None
        else:
            prev = self.layers[index - 1]
            core = self.buffers[f"{prev.layer_type}.core"][:tokens]
            carry = self._load(f"{prev.layer_type}.carry", self._arity[prev.layer_type][1], tokens)
            x, residual = prev.end(core, carry, self.buffers["residual0"][:tokens])
        if index == len(self.layers):
            norm = self.model.model.norm
            self._store("hidden", (all_reduce_add_rms_norm(x, residual, norm.weight, norm.eps)[0],), tokens)
            return
        layer = self.layers[index]
        inputs, carry, residual = layer.begin(positions, x, residual)
        self._arity[layer.layer_type] = (len(inputs), len(carry))
        self._store(f"{layer.layer_type}.input", inputs, tokens)
        self._store(f"{layer.layer_type}.carry", carry, tokens)
        self._store("residual", (residual,), tokens)

    def capture(self) -> None:
        """Capture every bucket's stretches (largest first: buffers are allocated then).
        Run on the stream the passes will use; raises if capture fails."""
        set_context(ForwardContext(slot_mapping=self.slots, capturing_graph=True))
        try:
            with fusion.compiling():
                for tokens in reversed(self.buckets):
                    graphs = []
                    for index in range(len(self.layers) + 1):
                        graph = torch.cuda.CUDAGraph()  # warm-up: buffers, kernel tuning, compilation
                        graph_capture.capture(graph, self.pool, lambda i=index, t=tokens: self._stretch(i, t))
                        self.pool = graph.pool()
                        graphs.append(graph)
                    self.graphs[tokens] = graphs
        finally:
            set_context(None)

    def bucket(self, tokens: int) -> int | None:
        """The bucket a pass of ``tokens`` tokens runs in (None: too long, run it eagerly)."""
        return next((b for b in self.buckets if b >= tokens), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """Final hidden states ``[n, hidden]`` of a pass of ``n`` tokens (decode tokens
        first, then prompt chunks) in ``context``: the stretches replayed, the cores run
        between them. Before
        :meth:`capture` (or on CPU) the stretches run as plain code on the same buffers."""
        tokens = input_ids.shape[0]
        bucket = self.bucket(tokens)
        graphs = self.graphs.get(bucket)
        stretch = (lambda i: graphs[i].replay()) if graphs else (lambda i: self._stretch(i, bucket))
        self.input_ids[:tokens].copy_(input_ids)
        self.positions[:tokens].copy_(positions)
        self.slots[:tokens].copy_(context.slot_mapping)
        self.slots[tokens:bucket].fill_(-1)
        pieces = ForwardContext(slot_mapping=self.slots)  # what the stretches see (as captured)
        try:
            for index, layer in enumerate(self.layers):
                set_context(pieces)
                stretch(index)
                set_context(context)
                inputs = self._load(f"{layer.layer_type}.input", self._arity[layer.layer_type][0], tokens)
                self.buffers[f"{layer.layer_type}.core"][:tokens].copy_(layer.mixer.core(*inputs))
            set_context(pieces)
            stretch(len(self.layers))
        finally:
            set_context(None)
        return self.buffers["hidden0"][:tokens]

    def release(self) -> None:
        """Free the graphs (NCCL cannot be torn down while graphs holding its collectives live)."""
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.reset()
        self.graphs.clear()
