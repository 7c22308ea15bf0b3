"""The linear shapes (N = out, K = in) of Qwen3.5-27B and 35B-A3B, full and tensor-parallel.

Used by the GPU tests, ``onecat tune`` and bench/kernels.py (volta.md section 8, qwen3_5.md).
Column-parallel layers split N across ranks, row-parallel layers split K.
"""

from __future__ import annotations

# (model, layer, N, K, parallel style): "col" splits N, "row" splits K under TP.
LAYERS: tuple[tuple[str, str, int, int, str], ...] = (
    ("27B", "in_proj_qkv", 10240, 5120, "col"),
    ("27B", "in_proj_z", 6144, 5120, "col"),
    ("27B", "out_proj", 5120, 6144, "row"),
    ("27B", "q_proj", 12288, 5120, "col"),
    ("27B", "k_proj/v_proj", 1024, 5120, "col"),
    ("27B", "o_proj", 5120, 6144, "row"),
    ("27B", "gate_proj/up_proj", 17408, 5120, "col"),
    ("27B", "gate_up merged", 34816, 5120, "col"),
    ("27B", "down_proj", 5120, 17408, "row"),
    ("35B-A3B", "in_proj_qkv", 8192, 2048, "col"),
    ("35B-A3B", "in_proj_z", 4096, 2048, "col"),
    ("35B-A3B", "out_proj", 2048, 4096, "row"),
    ("35B-A3B", "q_proj", 8192, 2048, "col"),
    ("35B-A3B", "k_proj/v_proj", 512, 2048, "col"),
    ("35B-A3B", "o_proj", 2048, 4096, "row"),
    ("35B-A3B", "expert gate/up", 512, 2048, "col"),
    ("35B-A3B", "expert down", 2048, 512, "row"),
)


def sliced_shapes(tp_sizes: tuple[int, ...] = (1, 2, 4)) -> list[tuple[str, int, int]]:
    """Unique ``(label, N, K)`` over every layer and TP size, in the order first seen."""
    seen: dict[tuple[int, int], str] = {}
    for model, layer, n, k, style in LAYERS:
        for tp in tp_sizes:
            shape = (n // tp, k) if style == "col" else (n, k // tp)
            label = f"{model} {layer}" + (f" TP{tp}" if tp > 1 else "")
            seen.setdefault(shape, label)
    return [(label, n, k) for (n, k), label in seen.items()]


BENCH_SHAPES: tuple[tuple[str, int, int], ...] = (
    ("27B gate_up merged", 34816, 5120),
    ("27B gate/up", 17408, 5120),
    ("27B down", 5120, 17408),
    ("27B q_proj", 12288, 5120),
    ("27B in_proj_qkv", 10240, 5120),
    ("27B o_proj/out_proj", 5120, 6144),
    ("27B k/v_proj", 1024, 5120),
    ("27B gate/up TP4", 4352, 5120),
    ("27B down TP4", 5120, 4352),
    ("35B in_proj_qkv", 8192, 2048),
    ("35B o_proj", 2048, 4096),
    ("35B expert gate/up", 512, 2048),
    ("35B expert down", 2048, 512),
)
"""The shapes bench/kernels.py times (a subset of :func:`sliced_shapes`)."""
