"""All-reduce of decode-sized fp16 tensors over the GPUs of one host: NCCL against onecat's
one-shot kernel (``onecat/kernels/all_reduce.cu``) (GPU, 2 / 4 / 8 GPUs).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    ONECAT_KERNEL_DIR=$PWD/.ptx ONECAT_KERNEL_ARCH=70 \\
        python bench/allreduce.py [--world 2] [--rows 1,2,4,8,16,32,64] --out allreduce.json

Spawns one process per GPU (``torch.multiprocessing``), joins them with NCCL
(``parallel_state.init_tensor_parallel``, custom all-reduce off) and sets the one-shot kernel
up beside it (``CustomAllReduce.create``; if it cannot run here, its reason is logged and
only NCCL is timed). For every ``rows x hidden`` fp16 tensor (the 27B's decode all-reduce is
``batch x 5120``), per method:

- correctness: every rank's tensor (random, a seed per rank) summed once, against the fp64
  sum of all ranks' tensors: ``ok`` when every element is within one fp16 rounding of it for
  the custom kernel (fp32 sum, one rounding), ``N - 1`` roundings of the sum of magnitudes
  for NCCL; ``identical``: the custom kernel's result is bit-identical on every rank;
- eager: ``--iters`` back-to-back calls from Python, per-call us (GPU time between events;
  the host's launch cost shows where it exceeds the kernel);
- graph: ``--calls`` back-to-back all-reduces (distinct buffers) captured in one CUDA graph,
  replayed ``--replays`` times, per-call us; its first replay's results are checked too.

Times are the largest over the ranks. Prints a table and, with ``--out``, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from onecat.runtime.distributed.custom_all_reduce import CustomAllReduce
from onecat.runtime.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel


def rank_input(rank: int, rows: int, hidden: int) -> torch.Tensor:
    """Rank ``rank``'s fp16 input (CPU), the same on every process that asks."""
    gen = torch.Generator().manual_seed(1000 * rows + rank)
    return torch.randn(rows, hidden, generator=gen).half()


def within(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, roundings: int) -> bool:
    """Whether every element of ``out`` is within ``roundings`` fp16 roundings (relative
    error 2^-11 of ``scale``) of ``ref``, plus a hair for sums near zero."""
    err = (out.double().cpu() - ref).abs()
    return bool((err <= roundings * scale * 2.0**-11 + 2.0**-16).all())


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest ``value`` over the ranks."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def sync(device: torch.device) -> None:
    """Every rank's GPU idle and every rank here."""
    torch.cuda.synchronize(device)
    max_over_ranks(0.0, device)
    torch.cuda.synchronize(device)


def time_us(fn, calls_per_run: int, runs: int, device: torch.device) -> float:
    """GPU microseconds per call of ``runs`` runs of ``fn`` (``calls_per_run`` calls each),
    after one warm run; the largest over the ranks."""
    fn()
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        fn()
    end.record()
    end.synchronize()
    return max_over_ranks(start.elapsed_time(end) * 1000.0 / (runs * calls_per_run), device)


def measure(name: str, reduce, rows: int, opts: dict, rank: int, world: int, device: torch.device) -> dict:
    """Correctness, eager and graph timing of one method at one size (every rank calls it)."""
    hidden = opts["hidden"]
    inputs = [rank_input(r, rows, hidden) for r in range(world)]
    ref = sum(t.double() for t in inputs)
    # the custom kernel rounds its fp32 sum once; NCCL's ring may round each partial sum,
    # which can be larger than the total: bound by the sum of magnitudes there
    roundings, scale = (1, ref.abs()) if name == "custom" else (world - 1, sum(t.double().abs() for t in inputs))
    x = inputs[rank].to(device)
    reduce(x)
    result = {f"{name}_ok": within(x, ref, scale, roundings)}
    if name == "custom":
        gathered = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(gathered, x)
        result["identical"] = all(torch.equal(g, gathered[0]) for g in gathered)

    x = torch.zeros(rows, hidden, dtype=torch.float16, device=device)  # zeros: no overflow over repeats
    result[f"{name}_eager_us"] = time_us(lambda: [reduce(x) for _ in range(opts["iters"])], opts["iters"], 1, device)

    calls = opts["calls"]
    buffers = [inputs[rank].to(device) for _ in range(calls)]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm up off the capture, as torch's graph docs ask
        reduce(torch.zeros_like(buffers[0]))
    torch.cuda.current_stream(device).wait_stream(side)
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for b in buffers:
            reduce(b)
    for b in buffers:  # capture does not run the calls: the buffers still hold the inputs
        b.copy_(inputs[rank])
    sync(device)
    graph.replay()
    torch.cuda.synchronize(device)
    result[f"{name}_graph_ok"] = all(within(b, ref, scale, roundings) for b in buffers)
    for b in buffers:
        b.zero_()
    result[f"{name}_graph_us"] = time_us(graph.replay, calls, opts["replays"], device)
    del graph
    return result


def rank_main(rank: int, world: int, init_method: str, opts: dict, result_path: str) -> None:
    """One rank: join the group, set the custom all-reduce up, measure every size."""
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(message)s")
    device = torch.device("cuda", rank)
    init_tensor_parallel(rank, world, init_method, device, custom_all_reduce=False)
    custom = CustomAllReduce.create(rank, world, device)
    methods = {"nccl": lambda x: dist.all_reduce(x)}
    if custom is not None:
        methods["custom"] = custom.all_reduce
    table = []
    for rows in opts["rows"]:
        row = {"rows": rows, "bytes": rows * opts["hidden"] * 2}
        probe = torch.empty(rows, opts["hidden"], dtype=torch.float16, device=device)
        for name, reduce in methods.items():
            if name == "custom" and not custom.fits(probe):
                continue  # above its size limit: NCCL only
            row.update(measure(name, reduce, rows, opts, rank, world, device))
        if "custom_graph_us" in row:
            row["graph_speedup"] = row["nccl_graph_us"] / row["custom_graph_us"]
            row["eager_speedup"] = row["nccl_eager_us"] / row["custom_eager_us"]
        table.append(row)
    if rank == 0:
        info = {
            "world": world, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "custom_available": custom is not None,
            "custom_max_bytes": custom.max_bytes if custom is not None else None,
            "hidden": opts["hidden"], "iters": opts["iters"], "calls": opts["calls"], "replays": opts["replays"],
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "ONECAT_KERNEL_ARCH", "ONECAT_KERNEL_DIR")},
        }
        Path(result_path).write_text(json.dumps({"info": info, "rows": table}, indent=2) + "\n")
    sync(device)
    if custom is not None:
        custom.close()
    destroy_tensor_parallel()


def print_table(result: dict) -> None:
    """The per-size table: per-call microseconds, NCCL against custom, and the checks."""
    info = result["info"]
    print(f"{info['world']} x {info['device']}, torch {info['torch']}, NCCL {info['nccl']}, "
          f"custom all-reduce {'up to ' + str(info['custom_max_bytes'] >> 10) + ' KB' if info['custom_available'] else 'unavailable'}")
    print(f"{'rows':>5} {'KB':>6} | {'eager NCCL':>10} {'custom':>7} | {'graph NCCL':>10} {'custom':>7} {'x':>5} | checks")
    for r in result["rows"]:
        def us(key: str, r: dict = r) -> str:
            return f"{r[key]:.2f}" if key in r else "-"
        checks = " ".join(f"{k}={r[k]}" for k in ("nccl_ok", "nccl_graph_ok", "custom_ok", "custom_graph_ok", "identical") if k in r)
        speedup = f"{r['graph_speedup']:.2f}" if "graph_speedup" in r else "-"
        print(f"{r['rows']:>5} {r['bytes'] / 1024:>6.0f} | {us('nccl_eager_us'):>10} {us('custom_eager_us'):>7} | "
              f"{us('nccl_graph_us'):>10} {us('custom_graph_us'):>7} {speedup:>5} | {checks}")


def main() -> None:
    """Spawn the ranks, collect rank 0's table, print it and write it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="GPUs (2, 4 or 8)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--iters", type=int, default=200, help="eager calls timed")
    parser.add_argument("--calls", type=int, default=64, help="all-reduces per CUDA graph")
    parser.add_argument("--replays", type=int, default=20, help="graph replays timed")
    parser.add_argument("--out", default=None, help="write the results here (JSON)")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.world:
        raise SystemExit(f"--world {args.world} needs {args.world} GPUs; torch sees {torch.cuda.device_count()}")
    opts = {"rows": [int(r) for r in args.rows.split(",")], "hidden": args.hidden, "iters": args.iters,
            "calls": args.calls, "replays": args.replays}
    with tempfile.TemporaryDirectory(prefix="onecat-allreduce-") as tmp:
        result_path = str(Path(tmp) / "result.json")
        mp.spawn(rank_main, args=(args.world, f"file://{tmp}/store", opts, result_path), nprocs=args.world, join=True)
        result = json.loads(Path(result_path).read_text())
    print_table(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
