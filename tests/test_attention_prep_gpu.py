"""GPU tests of the fused attention-input kernel (``attention_prep.cu``): against the fp64
contract (``attention_prep_reference.py``) and, at layer level, against the torch path.

Outputs and the KV cache are poisoned with NaN first: an unwritten q row or a cache slot the
kernel should have written shows up as non-finite, and every slot that no row maps to must
still hold the poison afterwards. Run with ``pytest -m gpu tests/test_attention_prep_gpu.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_prep_reference import assert_close_to_reference, reference_inputs

from onecat.kernels import attention as attention_kernel
from onecat.kernels import attention_prep
from onecat.runtime.context import ForwardContext, PrefillChunk, set_context
from onecat.runtime.engine.graph_capture import capture
from onecat.runtime.layers.rotary import PartialRotaryEmbedding

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BLOCK = 16  # the runtime's kv_block_size
QWEN_27B = (24, 4, 256, 64)  # query heads, KV heads, head dim, rotary dim
QWEN_35B_A3B = (16, 2, 256, 64)


def make_case(tokens, heads, kv_heads, dim, rot, seed, weight_dtype=torch.float32):
    """Inputs of one call: qkv with strided rows, positions up to 100000 (both ends
    included), distinct random slots in a NaN-poisoned cache with spare blocks."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = (2 * heads + 2 * kv_heads) * dim
    qkv = (torch.randn(tokens, width + 24, generator=gen, device="cuda") * 3).half()[:, :width]
    positions = torch.randint(0, 100001, (tokens,), generator=gen, device="cuda")
    positions[0] = 100000
    if tokens > 1:
        positions[1] = 0
    q_w = (torch.randn(dim, generator=gen, device="cuda") * 0.5).to(weight_dtype)
    k_w = (torch.randn(dim, generator=gen, device="cuda") * 0.5).to(weight_dtype)
    inv_freq = PartialRotaryEmbedding(rot, 1e7).inv_freq.cuda()
    blocks = math.ceil(tokens / BLOCK) + 3
    shape = (blocks, BLOCK, kv_heads, dim)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")
    v_cache = torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")
    slots = torch.randperm(blocks * BLOCK, generator=gen, device="cuda")[:tokens]
    return qkv, positions, q_w, k_w, inv_freq, slots, k_cache, v_cache


def call(qkv, positions, q_w, k_w, inv_freq, slots, k_cache, v_cache, shape, fresh_kv=True):
    heads, kv_heads, dim, rot = shape
    q_out = torch.full((qkv.shape[0], heads, dim), float("nan"), dtype=torch.float16, device="cuda")
    q, k, v = attention_prep.prepare_attention_inputs(
        qkv, positions, q_w, k_w, inv_freq, 1e-6, slots, k_cache, v_cache, heads, kv_heads, dim, rot,
        fresh_kv=fresh_kv, q_out=q_out,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert q.data_ptr() == q_out.data_ptr()
    return q, k, v


def check_cache(k_cache, v_cache, slots, ref_k, ref_v, what):
    """Rows at ``slots`` (>= 0 and inside the cache) hold the reference; all others the poison."""
    kv_heads, dim = k_cache.shape[2:]
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    valid = [(t, s) for t, s in enumerate(slots.tolist()) if 0 <= s < flat_k.shape[0]]
    rows = torch.tensor([t for t, _ in valid], device="cuda", dtype=torch.int64)
    cols = torch.tensor([s for _, s in valid], device="cuda", dtype=torch.int64)
    if valid:
        assert_close_to_reference(flat_k[cols], ref_k[rows], f"{what}: k in the cache")
        assert torch.equal(flat_v[cols].double(), ref_v[rows]), f"{what}: v in the cache differs from the input"
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device="cuda")
    untouched[cols] = False
    assert bool(flat_k[untouched].isnan().all()), f"{what}: k written at a slot no row maps to"
    assert bool(flat_v[untouched].isnan().all()), f"{what}: v written at a slot no row maps to"


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("shape", [QWEN_27B, QWEN_35B_A3B], ids=["27B", "35B-A3B"])
def test_matches_fp64_and_writes_only_mapped_slots(tokens, shape):
    heads, kv_heads, dim, rot = shape
    qkv, positions, q_w, k_w, inv_freq, slots, k_cache, v_cache = make_case(tokens, *shape, seed=tokens)
    q, k, v = call(qkv, positions, q_w, k_w, inv_freq, slots, k_cache, v_cache, shape)
    ref_q, ref_k, ref_v = reference_inputs(qkv, positions, q_w, k_w, inv_freq, 1e-6, heads, kv_heads, dim, rot)
    what = f"T={tokens} H={heads} KVH={kv_heads}"
    assert_close_to_reference(q, ref_q, f"{what}: q")
    assert_close_to_reference(k, ref_k, f"{what}: fresh k")
    assert torch.equal(v.double(), ref_v), f"{what}: fresh v differs from the input"
    check_cache(k_cache, v_cache, slots, ref_k, ref_v, what)


@pytest.mark.parametrize(
    "shape, weight_dtype",
    [
        ((4, 2, 32, 8), torch.float32),  # the tiny test models
        ((6, 3, 96, 24), torch.float32),  # half the rotary dim is no multiple of the lanes' stride
        ((8, 1, 128, 128), torch.float32),  # full rotation, one KV head
        ((4, 4, 64, 0), torch.float32),  # no rotation
        (QWEN_27B, torch.float16),  # norm weights in the model's dtype
    ],
)
def test_other_head_shapes_match_fp64(shape, weight_dtype):
    heads, kv_heads, dim, rot = shape
    case = make_case(7, *shape, seed=dim, weight_dtype=weight_dtype)
    qkv, positions, q_w, k_w, inv_freq, slots, k_cache, v_cache = case
    q, k, v = call(qkv, positions, q_w, k_w, inv_freq, slots, k_cache, v_cache, shape)
    ref_q, ref_k, ref_v = reference_inputs(qkv, positions, q_w, k_w, inv_freq, 1e-6, heads, kv_heads, dim, rot)
    assert_close_to_reference(q, ref_q, f"{shape}: q")
    assert_close_to_reference(k, ref_k, f"{shape}: fresh k")
    check_cache(k_cache, v_cache, slots, ref_k, ref_v, str(shape))


def test_padding_rows():
    """Rows whose slot lies outside the cache (-1: the prompt graphs' padding) write nothing;
    rows sharing one slot (the decode graphs' padding rows share a scratch slot) leave, per
    feature, one of their values there; without ``fresh_kv`` only q comes back."""
    heads, kv_heads, dim, rot = QWEN_27B
    qkv, positions, q_w, k_w, inv_freq, slots, k_cache, v_cache = make_case(7, *QWEN_27B, seed=11)
    num_slots = k_cache.shape[0] * BLOCK
    slots[2], slots[3], slots[5] = -1, num_slots, slots[4]
    q, k, v = call(qkv, positions, q_w, k_w, inv_freq, slots, k_cache, v_cache, QWEN_27B, fresh_kv=False)
    assert k is None and v is None
    ref_q, ref_k, ref_v = reference_inputs(qkv, positions, q_w, k_w, inv_freq, 1e-6, heads, kv_heads, dim, rot)
    assert_close_to_reference(q, ref_q, "q")
    shared = int(slots[4])
    got_k = k_cache.view(-1, kv_heads, dim)[shared].double()
    got_v = v_cache.view(-1, kv_heads, dim)[shared].double()
    k_err = torch.minimum((got_k - ref_k[4]).abs(), (got_k - ref_k[5]).abs())
    assert float(k_err.max()) < 0.05, "the shared slot holds neither row's keys"
    assert bool(((got_v == ref_v[4]) | (got_v == ref_v[5])).all()), "the shared slot holds neither row's values"
    ref_k[4], ref_v[4] = got_k, got_v  # checked just above
    only = slots.clone()
    only[5] = -1
    check_cache(k_cache, v_cache, only, ref_k, ref_v, "padding rows")


def test_without_a_cache_only_the_outputs_are_written():
    """The memory-profiling pass runs before the cache exists (empty tensors)."""
    heads, kv_heads, dim, rot = QWEN_35B_A3B
    qkv, positions, q_w, k_w, inv_freq, slots, _, _ = make_case(7, *QWEN_35B_A3B, seed=5)
    q, k, v = call(qkv, positions, q_w, k_w, inv_freq, slots, torch.empty(0), torch.empty(0), QWEN_35B_A3B)
    ref_q, ref_k, ref_v = reference_inputs(qkv, positions, q_w, k_w, inv_freq, 1e-6, heads, kv_heads, dim, rot)
    assert_close_to_reference(q, ref_q, "q")
    assert_close_to_reference(k, ref_k, "k")
    assert torch.equal(v.double(), ref_v)


def test_matches_the_runtime_torch_path():
    """The kernel and the runtime's torch path (``attention_inputs``, eager, CUDA) agree."""
    from onecat.runtime.models.qwen3_5 import attention_inputs

    heads, kv_heads, dim, rot = QWEN_27B
    qkv, positions, q_w, k_w, inv_freq, slots, k_cache, v_cache = make_case(300, *QWEN_27B, seed=7)
    q, k, v = call(qkv, positions, q_w, k_w, inv_freq, slots, k_cache, v_cache, QWEN_27B)
    tq, tk, tv, _ = attention_inputs(qkv, positions, q_w, k_w, inv_freq, 1e-6, heads, kv_heads, dim, rot)
    assert_close_to_reference(q, tq.double(), "q vs torch path")
    assert_close_to_reference(k, tk.double(), "k vs torch path")
    assert torch.equal(v, tv)


# --- the layer: the fused path against the torch path --------------------------------------


def make_layer(heads, kv_heads, dim, hidden=512, seed=0):
    from onecat.runtime.models.config import ModelConfig
    from onecat.runtime.models.qwen3_5 import GatedAttention
    from onecat.runtime.quant_plan import QuantPlan
    from onecat.tiny import _text_kwargs

    raw = {"model_type": "qwen3_5", **_text_kwargs("qwen3_5", 64, 4)}
    raw.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim,
               rope_theta=1e7)  # fmt: skip
    cfg = ModelConfig.from_dict(raw)
    with torch.device("cuda"):
        layer = GatedAttention(cfg, "model.layers.3.self_attn", QuantPlan(), torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for name, param in layer.named_parameters():
        scale = 0.3 if "norm" in name else 1.0 / math.sqrt(param.shape[-1])
        param.data.copy_(torch.randn(param.shape, generator=gen, device="cuda") * scale)
    return layer, cfg


class Passes:
    """The same layer run through the torch path (cache ``torch``) and the fused path (cache
    ``fused``), both caches NaN-poisoned alike; sequences live in fixed blocks."""

    def __init__(self, layer, blocks=32):
        self.layer = layer
        shape = (blocks, BLOCK, layer.num_kv_heads, layer.head_dim)
        poison = torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")
        self.caches = {"torch": (poison.clone(), poison.clone()), "fused": (poison.clone(), poison.clone())}
        self.fused_calls = 0

    def run(self, path, x, positions, context, monkeypatch):
        layer = self.layer
        layer.attn.k_cache, layer.attn.v_cache = self.caches[path]
        def counted(original):
            def call(*args, **kwargs):
                self.fused_calls += 1
                return original(*args, **kwargs)

            return call

        with monkeypatch.context() as m:
            if path == "torch":
                m.setattr(attention_prep, "supports", lambda *args: False)
            # the input kernel, or (decode rows only) the decode kernel's form that does its work
            m.setattr(attention_prep, "prepare_attention_inputs", counted(attention_prep.prepare_attention_inputs))
            m.setattr(attention_kernel, "paged_decode_attention_prep", counted(attention_kernel.paged_decode_attention_prep))
            calls = self.fused_calls
            set_context(context())
            try:
                out = layer(positions, x)
            finally:
                set_context(None)
            assert self.fused_calls - calls == (1 if path == "fused" else 0), f"{path}: wrong input path"
        torch.cuda.synchronize()
        return out

    def compare(self, x, positions, context, monkeypatch, what):
        ref = self.run("torch", x, positions, context, monkeypatch)
        got = self.run("fused", x, positions, context, monkeypatch)
        assert_outputs_close(got, ref, what)
        for i, name in enumerate(("k", "v")):
            a, b = self.caches["torch"][i], self.caches["fused"][i]
            if a.numel() == 0:
                continue
            assert torch.equal(a.isnan(), b.isnan()), f"{what}: the paths wrote different {name} cache slots"
            a, b = a.view(-1, a.shape[-1]), b.view(-1, b.shape[-1])
            written = ~a.isnan().any(-1)
            if name == "k":
                assert_close_to_reference(b[written], a[written].double(), f"{what}: k cache")
            else:
                assert torch.equal(a[written], b[written]), f"{what}: v cache differs"
        return got


def assert_outputs_close(got, ref, what):
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite output"
    err = (got.double() - ref.double()).abs()
    rms = ref.double().pow(2).mean().sqrt()
    assert float(err.max()) <= 2e-2 * float(rms), f"{what}: max err {float(err.max()):.3e}, rms(ref) {float(rms):.3e}"


def slots_of(blocks, start, count):
    return [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + count)]


@pytest.mark.parametrize("shape", [QWEN_27B, QWEN_35B_A3B], ids=["27B", "35B-A3B"])
def test_layer_fused_path_matches_torch_path(shape, monkeypatch):
    """Prefill (fresh and after cached tokens), a mixed step (verify rows of two positions, a
    padding row on the scratch slot, a new prompt and a continued one), a decode-only step
    (one row per sequence: the decode kernel's prep form, no input launch), and a decode step
    captured in a CUDA graph whose slots and positions change before the replay: outputs and
    caches agree with the torch path."""
    heads, kv_heads, dim, _ = shape
    layer, cfg = make_layer(heads, kv_heads, dim)
    passes = Passes(layer)
    gen = torch.Generator(device="cuda").manual_seed(1)
    seq = {"A": [0, 1, 2, 9], "B": [5, 6], "C": [8], "D": [10, 11]}  # block tables
    scratch_block = 31
    scratch_slot = scratch_block * BLOCK
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device="cuda")  # noqa: E731
    hidden = lambda n: torch.randn(n, cfg.hidden_size, generator=gen, device="cuda").half()  # noqa: E731

    # pass 0: before the cache exists (memory profiling)
    for path in ("torch", "fused"):
        passes.caches[path] = (torch.empty(0, device="cuda"), torch.empty(0, device="cuda"))
    x, positions = hidden(12), torch.arange(12, device="cuda")
    chunk = [PrefillChunk(0, 12, 0, as_tensor([0]), 0)]
    profile = lambda: ForwardContext(slot_mapping=positions, prefills=chunk)  # noqa: E731
    passes.compare(x, positions, profile, monkeypatch, "profiling pass")
    passes = Passes(layer)

    # pass 1: three prompts (A 40 tokens, B 20, D 16)
    lengths = {"A": 40, "B": 20, "D": 16}
    chunks, slots, positions, start = [], [], [], 0
    for name, n in lengths.items():
        chunks.append(PrefillChunk(start, n, 0, as_tensor(seq[name]), 0))
        slots += slots_of(seq[name], 0, n)
        positions += list(range(n))
        start += n
    prefill = lambda: ForwardContext(slot_mapping=as_tensor(slots), prefills=chunks)  # noqa: E731
    passes.compare(hidden(start), as_tensor(positions), prefill, monkeypatch, "prefill")

    # pass 2: decode rows (A: 2 verify positions; B: 1 + a padding row), prompts C (new) and D (continued)
    rows = [("A", 40), ("A", 41), ("B", 20), (None, 0)]
    dec_slots = [slots_of(seq[n], p, 1)[0] if n else scratch_slot for n, p in rows]
    dec_pos = [p for _, p in rows]
    lens = [p + 1 if n else 1 for n, p in rows]
    width = 4
    tables = [(seq[n] if n else [scratch_block]) for n, _ in rows]
    tables = as_tensor([t + [scratch_block] * (width - len(t)) for t in tables])
    pre = [PrefillChunk(4, 10, 0, as_tensor(seq["C"]), 0), PrefillChunk(14, 9, 16, as_tensor(seq["D"]), 0)]
    slots = dec_slots + slots_of(seq["C"], 0, 10) + slots_of(seq["D"], 16, 9)
    positions = dec_pos + list(range(10)) + list(range(16, 25))

    def mixed():
        return ForwardContext(slot_mapping=as_tensor(slots), num_decodes=4, decode_block_tables=tables,
                              decode_context_lens=as_tensor(lens), decode_width=2, prefills=pre)

    passes.compare(hidden(23), as_tensor(positions), mixed, monkeypatch, "mixed step")

    # pass 3: decode only (A at 42, B at 21, C at 10, D at 25): no fresh keys needed
    rows = [("A", 42), ("B", 21), ("C", 10), ("D", 25)]
    dec_slots = as_tensor([slots_of(seq[n], p, 1)[0] for n, p in rows])
    dec_pos = as_tensor([p for _, p in rows])
    dec_lens = as_tensor([p + 1 for _, p in rows])
    tables = as_tensor([seq[n] + [scratch_block] * (width - len(seq[n])) for n, _ in rows])

    def decode(slot_mapping=dec_slots, lens=dec_lens):
        return lambda: ForwardContext(slot_mapping=slot_mapping, num_decodes=4, decode_block_tables=tables,
                                      decode_context_lens=lens)

    x3 = hidden(4)
    passes.compare(x3, dec_pos, decode(), monkeypatch, "decode step")

    # pass 4: the next decode step, replayed from a CUDA graph captured on scratch inputs
    x4 = hidden(4)
    next_slots = as_tensor([slots_of(seq[n], p + 1, 1)[0] for n, p in rows])
    ref = passes.run("torch", x4, dec_pos + 1, decode(next_slots, dec_lens + 1), monkeypatch)
    layer.attn.k_cache, layer.attn.v_cache = passes.caches["fused"]
    static = {"x": torch.zeros_like(x4), "pos": torch.zeros_like(dec_pos),
              "slots": torch.full_like(dec_slots, scratch_slot), "lens": torch.ones_like(dec_lens)}  # fmt: skip
    set_context(decode(static["slots"], static["lens"])())
    try:
        graph = torch.cuda.CUDAGraph()  # the warm-up writes the scratch slot only
        out = capture(graph, None, lambda: layer(static["pos"], static["x"]))
    finally:
        set_context(None)
    static["x"].copy_(x4)
    static["pos"].copy_(dec_pos + 1)
    static["slots"].copy_(next_slots)
    static["lens"].copy_(dec_lens + 1)
    graph.replay()
    torch.cuda.synchronize()
    assert_outputs_close(out, ref, "decode step replayed from a CUDA graph")
    k_t, k_f = passes.caches["torch"][0].view(-1, kv_heads, dim), passes.caches["fused"][0].view(-1, kv_heads, dim)
    assert_close_to_reference(k_f[next_slots], k_t[next_slots].double(), "keys written by the replayed graph")
