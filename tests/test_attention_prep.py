"""CPU tests of the fused attention-input kernel's wrapper (``onecat.kernels.attention_prep``)
and of the runtime's choice between it and the torch path: what it refuses, that the fp64
contract the GPU tests check the kernel against is the torch path's, and that the CPU path
(torch inputs, the cache written by the core) is unchanged. The kernel's sm_70 build (no
spills, no stack) is checked by test_kernels.py over build.PROGRAMS; the kernel itself by
test_attention_prep_gpu.py."""

from __future__ import annotations

import pytest
import torch
from attention_prep_reference import assert_close_to_reference, reference_inputs

from onecat.errors import OnecatError
from onecat.kernels import attention_prep, build
from onecat.runtime.context import ForwardContext, PrefillChunk, set_context
from onecat.runtime.layers.rotary import PartialRotaryEmbedding
from onecat.runtime.models.qwen3_5 import attention_inputs

pytestmark = pytest.mark.usefixtures("one_thread")
CUDA = torch.device("cuda")


def test_supports_cuda_fp16_and_head_dims_that_fit_the_warp_mapping():
    assert attention_prep.supports(CUDA, torch.float16, 256, 64)  # both Qwen3.5 models
    assert attention_prep.supports(CUDA, torch.float16, 32, 8)  # the tiny test models
    assert attention_prep.supports(CUDA, torch.float16, 96, 24)  # half the rotary dim not a multiple of 32
    assert attention_prep.supports(CUDA, torch.float16, 128, 128)  # full rotation
    assert attention_prep.supports(CUDA, torch.float16, 64, 0)  # none
    assert not attention_prep.supports(torch.device("cpu"), torch.float16, 256, 64)
    assert not attention_prep.supports(CUDA, torch.float32, 256, 64)
    assert not attention_prep.supports(CUDA, torch.bfloat16, 256, 64)
    assert not attention_prep.supports(CUDA, torch.float16, 512, 64)  # over 8 features per lane
    assert not attention_prep.supports(CUDA, torch.float16, 80, 20)  # not a multiple of 32
    assert not attention_prep.supports(CUDA, torch.float16, 256, 63)  # odd rotary dim
    assert not attention_prep.supports(CUDA, torch.float16, 64, 96)  # rotary dim past the head


def test_kernel_program_is_built_and_named():
    assert "attention_prep" in build.PROGRAMS
    assert build.kernel_names("attention_prep") == ["attention_prep"]


def test_refuses_cpu_tensors_and_points_at_the_torch_path():
    heads, kv_heads, dim, rot = 4, 2, 32, 8
    qkv = torch.zeros(3, (2 * heads + 2 * kv_heads) * dim, dtype=torch.float16)
    w = torch.zeros(dim)
    with pytest.raises(OnecatError, match="prepare_attention_inputs.*CUDA fp16.*attention_inputs"):
        attention_prep.prepare_attention_inputs(
            qkv, torch.arange(3), w, w, torch.ones(rot // 2), 1e-6, torch.arange(3),
            torch.empty(0), torch.empty(0), heads, kv_heads, dim, rot,
        )  # fmt: skip


@pytest.mark.parametrize("heads, kv_heads, dim", [(24, 4, 256), (16, 2, 256), (4, 2, 32)])
def test_fp64_contract_is_the_torch_path(heads, kv_heads, dim):
    """The reference the GPU tests hold the kernel to agrees with the runtime's torch path
    (``attention_inputs``, fp32 math, fp16 rounding) under the same tolerance, positions up
    to 100000."""
    gen = torch.Generator().manual_seed(dim + heads)
    rotary = PartialRotaryEmbedding(dim // 4, 1e7)
    tokens = 5
    qkv = (torch.randn(tokens, (2 * heads + 2 * kv_heads) * dim, generator=gen) * 3).half()
    positions = torch.tensor([0, 1, 4097, 65535, 100000])
    q_w, k_w = torch.randn(dim, generator=gen) * 0.5, torch.randn(dim, generator=gen) * 0.5
    args = (qkv, positions, q_w, k_w, rotary.inv_freq, 1e-6, heads, kv_heads, dim, rotary.rotary_dim)
    q, k, v, gate = attention_inputs(*args)
    ref_q, ref_k, ref_v = reference_inputs(*args)
    assert_close_to_reference(q, ref_q, "q")
    assert_close_to_reference(k, ref_k, "k")
    assert torch.equal(v.double(), ref_v)
    assert gate.shape == (tokens, heads * dim)


def test_cpu_layer_keeps_the_torch_path_and_the_core_writes_the_cache():
    """On CPU the layer's inputs come from the torch path (gate ``[T, H*D]``) and the core
    writes the new keys and values; a core told they are stored already leaves the cache."""
    from onecat.runtime.models.config import ModelConfig
    from onecat.runtime.models.qwen3_5 import GatedAttention
    from onecat.runtime.quant_plan import QuantPlan
    from onecat.tiny import _text_kwargs

    cfg = ModelConfig.from_dict({"model_type": "qwen3_5", **_text_kwargs("qwen3_5", 64, 4)})
    layer = GatedAttention(cfg, "model.layers.3.self_attn", QuantPlan(), torch.float32)
    gen = torch.Generator().manual_seed(3)
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    blocks, block_size = 4, 8
    shape = (blocks, block_size, layer.num_kv_heads, layer.head_dim)
    layer.attn.k_cache, layer.attn.v_cache = torch.zeros(shape), torch.zeros(shape)
    assert not layer.attn.fuses_inputs(torch.device("cpu"), torch.float32, layer.rotary.rotary_dim)
    tokens = 5
    x = torch.randn(tokens, cfg.hidden_size, generator=gen)
    positions = torch.arange(tokens)
    slots = torch.tensor([8, 9, 10, 11, 12])  # block 1
    chunk = PrefillChunk(0, tokens, 0, torch.tensor([1]), 0)
    set_context(ForwardContext(slot_mapping=slots, prefills=[chunk]))
    try:
        (q, k, v), (gate,) = layer.project(positions, x)
        assert gate.shape == (tokens, layer.num_heads * layer.head_dim)
        layer.attn(q, k, v, stored=True)
        assert not layer.attn.k_cache.any() and not layer.attn.v_cache.any()
        out = layer.finish(layer.core(q, k, v), gate)
    finally:
        set_context(None)
    flat = (-1, layer.num_kv_heads, layer.head_dim)
    torch.testing.assert_close(layer.attn.k_cache.view(flat)[slots], k)
    torch.testing.assert_close(layer.attn.v_cache.view(flat)[slots], v)
    assert out.shape == (tokens, cfg.hidden_size) and bool(torch.isfinite(out).all())
