"""The residual add + RMSNorm of a decode step: onecat's one-launch kernel against the compiled
torch (Triton) kernel it replaces, alone and right after a W4A16 projection (GPU).

    cd bench && ONECAT_KERNEL_DIR=../.ptx ONECAT_KERNEL_ARCH=70 python norm.py [--hidden 2048,5120]

For each hidden size (35B-A3B: 2048, 27B: 5120) and row count, times in the same run (median
of CUDA-graph replays, ``onecat.kernels.timing``): the compiled torch function
(``norm._add_rms_norm_compiled``), onecat's kernel at 1, 2 and 4 vectors a thread, and each of
them after the row-parallel projection that precedes the norm in the model (``down_proj``,
weights rotated past L2), reported as the pair's time minus the projection's: what the norm
adds to a step. Sets ``rms_norm.VECTORS_PER_THREAD`` and ``norm.KERNEL_MIN_HIDDEN``.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from onecat.kernels import rms_norm, tuning
from onecat.kernels.timing import graph_time_us
from onecat.kernels.tuning import random_packed_weights
from onecat.kernels.variants import run_variant
from onecat.runtime.layers import fusion, norm

DOWN = {2048: 4096, 5120: 17408}  # K of the projection before the norm: out_proj / o_proj (35B-A3B), down_proj (27B)


def main() -> None:
    """Print one JSON row per (hidden, rows)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="2048,5120")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for hidden in map(int, args.hidden.split(",")):
        k = DOWN[hidden]
        qweight, scales = random_packed_weights(hidden, k, 128, gen)
        weights = tuning.weight_copies(qweight, scales)
        weight = torch.randn(hidden, device="cuda", generator=gen) * 0.1
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", generator=gen).half() * 0.1
            y = torch.empty(rows, hidden, device="cuda", dtype=torch.float16)
            residual = torch.randn(rows, hidden, device="cuda", generator=gen).half()
            project = [functools.partial(_project, x, qw, sz, y) for qw, sz in weights]
            norms = {"compiled": functools.partial(norm._add_rms_norm_compiled, y, residual, weight, 1e-6)}
            for vpt in (1, 2, 4):
                norms[f"kernel_v{vpt}"] = functools.partial(
                    rms_norm.add_rms_norm, y, residual, weight, 1e-6, vectors_per_thread=vpt
                )
            row = {"hidden": hidden, "rows": rows}
            with fusion.compiling():
                alone_projection = graph_time_us(project)
                for name, fn in norms.items():
                    row[f"{name}_us"] = graph_time_us([fn])
                    pairs = [functools.partial(_pair, p, fn) for p in project]
                    row[f"{name}_after_projection_us"] = graph_time_us(pairs) - alone_projection
            row["projection_us"] = alone_projection
            results.append(row)
            print(json.dumps({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def _project(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, y: torch.Tensor) -> None:
    """The projection into ``y`` on the variant the op would run (tuned on first use)."""
    run_variant(tuning.choose_variant(x.shape[0], qweight, scales, 128), x, qweight, scales, 128, None, y)


def _pair(project, fn) -> None:
    project()
    fn()


if __name__ == "__main__":
    main()
