"""Benchmark `onecat quantize` at Qwen3.5's real widths: time per layer, peak memory vs depth.

Writes synthetic checkpoints (random bf16 weights, real config.json keys of model_type
``qwen3_5`` / ``qwen3_5_moe`` with ``text_config``, real tensor names and shapes taken from
transformers' own model classes on the meta device, one safetensors shard per decoder
layer plus shards for embeddings and lm_head), then quantizes each in a fresh child process
and measures:

- wall time and the per-layer times of the quantizer's report;
- peak host RSS (``/proc/self/status`` sampled every 20 ms in a thread, and ``ru_maxrss``);
- peak GPU memory (``torch.cuda.max_memory_allocated``) on CUDA.

Dense: Qwen3.5-27B widths (hidden 5120, intermediate 17408, vocab 248320, Gated DeltaNet
16 key heads / 48 value heads x 128, attention 24 heads / 4 kv heads x 256 with gated
q_proj), 2 layers [linear, full] and 4 layers [linear, full, linear, full]: memory must not
grow with depth. MoE: one Qwen3.5-35B-A3B layer (hidden 2048, 256 experts, top-8, expert
and shared-expert intermediate 512, attention 16 / 2 x 256, Gated DeltaNet 16 / 32 x 128).
The projection for the full models uses the measured per-layer-type times (27B: 48 linear-
attention + 16 full-attention layers) plus the run's fixed cost (calibration, embeddings,
lm_head copy).

The tokenizer is onecat.tiny's (512 tokens; calibration ids are < 512 < vocab), so
calibration text tokenises differently from the real model: shapes, not text, matter here.

Usage::

    python bench/quantize.py --device cpu --samples 16 --seqlen 256 --json out.json
    python bench/quantize.py --device cuda --samples 128 --seqlen 512
    python bench/quantize.py --device cuda --samples 128 --seqlen 512 --method awq awq+gptq
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

DENSE_27B = dict(
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
)
MOE_35B = dict(
    vocab_size=248320,
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
)
FULL_MODEL_LAYERS = {"qwen3_5": (48, 16), "qwen3_5_moe": (30, 10)}  # (linear, full) layers


# --- synthetic checkpoints --------------------------------------------------------------


def _config(family: str, layer_types: list[str]):
    import transformers as tf

    text = dict(DENSE_27B if family == "qwen3_5" else MOE_35B)
    text.update(num_hidden_layers=len(layer_types), layer_types=layer_types, eos_token_id=2)
    if family == "qwen3_5":
        return tf.Qwen3_5Config(text_config=text), tf.Qwen3_5ForConditionalGeneration
    return tf.Qwen3_5MoeConfig(text_config=text), tf.Qwen3_5MoeForConditionalGeneration


_NOISE: torch.Tensor | None = None
_NOISE_SIZE = 1 << 24


def _normal_bf16(count: int, std: float, gen: torch.Generator) -> torch.Tensor:
    """``count`` bf16 values ~ N(0, std^2). On a GPU machine they are drawn there; on a CPU
    they are windows of one random block at random offsets (drawing billions of fresh
    normals costs minutes on a small CPU, and the benchmark measures shapes, not values)."""
    global _NOISE
    if torch.cuda.is_available():
        return (torch.randn(count, device="cuda") * std).to(torch.bfloat16).cpu()
    if _NOISE is None:
        _NOISE = torch.randn(2 * _NOISE_SIZE, generator=gen).to(torch.bfloat16)
    out = torch.empty(count, dtype=torch.bfloat16)
    for start in range(0, count, _NOISE_SIZE):
        n = min(_NOISE_SIZE, count - start)
        offset = int(torch.randint(0, _NOISE_SIZE, (1,), generator=gen))
        out[start : start + n] = _NOISE[offset : offset + n]
    return out.mul_(std)


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bf16 values of a plausible scale for the tensor ``name``."""
    if name.endswith("A_log"):
        return torch.log(torch.empty(shape).uniform_(1, 16, generator=gen)).to(torch.bfloat16)
    if name.endswith("dt_bias"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith("linear_attn.norm.weight"):  # gated norm: weight * x_hat
        return (1 + 0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    if "norm" in name:  # (1 + weight) norms
        return (0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    count = 1
    for dim in shape:
        count *= dim
    return _normal_bf16(count, 0.1 if "conv1d" in name else 0.02, gen).view(shape)


def write_synthetic(family: str, layer_types: list[str], out: Path, seed: int = 0) -> Path:
    """Write a random-weight checkpoint of ``family`` with the given layer types to ``out``.

    Shards: embeddings, lm_head, then one per decoder layer (multimodal tower left out).
    """
    from safetensors.torch import save_file

    from onecat.tiny import build_tokenizer

    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config, model_cls = _config(family, layer_types)
    with torch.device("meta"):
        meta = model_cls(config)
    shapes = {n: tuple(p.shape) for n, p in meta.named_parameters() if ".visual." not in n}
    del meta
    groups: dict[str, list[str]] = {}
    for name in shapes:
        if ".layers." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            groups.setdefault(f"layer{layer:03d}", []).append(name)
        elif name.startswith("lm_head"):
            groups.setdefault("lm_head", []).append(name)
        else:
            groups.setdefault("embed", []).append(name)
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, (_group, names) in enumerate(sorted(groups.items())):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: _random_tensor(n, shapes[n], gen) for n in sorted(names)}
        save_file(tensors, tmp / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in tensors})
        del tensors
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp)
    build_tokenizer(tmp)
    os.replace(tmp, out)
    return out


def truncate(src: Path, num_layers: int, out: Path) -> Path:
    """The first ``num_layers`` layers of the synthetic checkpoint ``src`` as a checkpoint at
    ``out``: its shards are hard links (one shard per layer), config and index rewritten."""
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    keep = {}
    for name, shard in index["weight_map"].items():
        if ".layers." in name and int(name.split(".layers.")[1].split(".")[0]) >= num_layers:
            continue
        keep[name] = shard
    for shard in sorted(set(keep.values())):
        if not (out / shard).exists():
            os.link(src / shard, out / shard)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": keep})
    )
    for side in src.iterdir():
        if side.suffix in (".json", ".jinja") and not side.name.startswith("model."):
            shutil.copy(side, out / side.name)
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = num_layers
    config["text_config"]["layer_types"] = config["text_config"]["layer_types"][:num_layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


# --- one measured run (child process) -----------------------------------------------------


class PeakRss:
    """Samples this process's resident set size (and allocated GPU memory) in a thread.

    ``peak`` is the overall peak in bytes; when ``work_dir`` is given (the quantizer's
    ``OUT.partial``), ``per_layer`` holds the peaks while layer 0, 1, ... was being
    quantized (the layer whose shard is not yet written), so growth with depth shows.
    """

    def __init__(self, work_dir: Path | None = None, interval: float = 0.02) -> None:
        self.peak = 0
        self.per_layer: dict[int, int] = {}
        self.per_layer_gpu: dict[int, int] = {}
        self._work_dir = work_dir
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def current() -> int:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _layer_in_progress(self) -> int | None:
        progress = self._work_dir / "progress.json" if self._work_dir else None
        if progress is None or not progress.is_file():
            return None
        try:
            return len(json.loads(progress.read_text()).get("layers", {}))
        except (OSError, ValueError):
            return None

    def _run(self) -> None:
        tick = 0
        layer = None
        while not self._stop.is_set():
            rss = self.current()
            self.peak = max(self.peak, rss)
            if tick % 25 == 0:
                layer = self._layer_in_progress()
            if layer is not None:
                self.per_layer[layer] = max(self.per_layer.get(layer, 0), rss)
                if torch.cuda.is_initialized():
                    gpu = torch.cuda.memory_allocated()
                    self.per_layer_gpu[layer] = max(self.per_layer_gpu.get(layer, 0), gpu)
            tick += 1
            time.sleep(self._interval)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current())


def _gib_list(per_layer: dict[int, int], layers: int) -> list[float | None]:
    return [round(per_layer[i] / 2**30, 2) if i in per_layer else None for i in range(layers)]


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_one(
    model: Path, out: Path, device: str, samples: int, seqlen: int, method: str = "awq"
) -> dict:
    """Quantize ``model`` into ``out`` once and return times and peak memory."""
    from onecat.quantize.pipeline import REPORT_NAME, quantize_model

    start_rss = PeakRss.current()
    cpu_start = _cpu_seconds()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    with PeakRss(out.with_name(out.name + ".partial")) as rss:
        started = time.perf_counter()
        quantize_model(
            model,
            out,
            calib="builtin:pydoc",
            samples=samples,
            seqlen=seqlen,
            method=method,
            device=device,
            overwrite=True,
            show_progress=False,
        )
        wall = time.perf_counter() - started
    report = json.loads((out / REPORT_NAME).read_text())
    config = json.loads((model / "config.json").read_text())
    types = config["text_config"]["layer_types"]
    layer_s = [float(layer.get("time_s", 0.0)) for layer in report["layers"]]
    return {
        "model": model.name,
        "device": device,
        "method": method,
        "layers": len(types),
        "layer_types": types,
        "calibration": f"builtin:pydoc {samples} x {seqlen}",
        "wall_s": round(wall, 1),
        "cpu_s": round(_cpu_seconds() - cpu_start, 1),
        "layer_s": [round(t, 1) for t in layer_s],
        "fixed_s": round(wall - sum(layer_s), 1),
        "rss_start_gib": round(start_rss / 2**30, 2),
        "peak_rss_gib": round(rss.peak / 2**30, 2),
        "peak_rss_per_layer_gib": _gib_list(rss.per_layer, len(types)),
        "peak_gpu_sampled_per_layer_gib": _gib_list(rss.per_layer_gpu, len(types))
        if device.startswith("cuda")
        else None,
        "ru_maxrss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if device.startswith("cuda")
        else None,
    }


def run_child(
    model: Path, out: Path, device: str, samples: int, seqlen: int, method: str = "awq"
) -> dict:
    """Run :func:`measure_one` in a fresh interpreter so that its peak RSS is its own."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        str(model),
        str(out),
        device,
        str(samples),
        str(seqlen),
        method,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"quantizing {model} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    shutil.rmtree(out, ignore_errors=True)
    return result


def project(results: list[dict], family: str) -> dict:
    """Projected time of the full model from per-layer-type means and the fixed cost."""
    by_type: dict[str, list[float]] = {}
    for r in results:
        for kind, t in zip(r["layer_types"], r["layer_s"], strict=True):
            by_type.setdefault(kind, []).append(t)
    mean = {k: sum(v) / len(v) for k, v in by_type.items()}
    linear, full = FULL_MODEL_LAYERS[family]
    linear_s = mean.get("linear_attention", mean.get("full_attention", 0.0))
    full_s = mean.get("full_attention", linear_s)
    fixed = max(r["fixed_s"] for r in results)
    total = linear * linear_s + full * full_s + fixed
    return {
        "family": family,
        "mean_linear_attention_layer_s": round(linear_s, 1),
        "mean_full_attention_layer_s": round(full_s, 1),
        "fixed_s": fixed,
        "layers": linear + full,
        "projected_s": round(total, 0),
        "projected_min": round(total / 60, 1),
    }


def main() -> None:
    """Parse flags, write the checkpoints, run the measurements and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/onecat-bench-quantize"))
    parser.add_argument("--dense-layers", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--no-moe", action="store_true", help="skip the 35B-A3B MoE layer")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--method",
        nargs="+",
        default=["awq"],
        choices=["awq", "awq+gptq"],
        help="one or more methods, each run on the same checkpoints",
    )
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints")
    args = parser.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    runs = []
    if args.dense_layers:
        deepest = max(args.dense_layers)
        types = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(deepest)]
        t0 = time.perf_counter()
        full = write_synthetic("qwen3_5", types, args.workdir / f"qwen3_5-27b-{deepest}layers")
        print(f"wrote {full} in {time.perf_counter() - t0:.0f} s", flush=True)
        for n in sorted(args.dense_layers):
            ckpt = (
                full
                if n == deepest
                else truncate(full, n, full.with_name(f"qwen3_5-27b-{n}layers"))
            )
            runs.append(("qwen3_5", ckpt))
    if not args.no_moe:
        t0 = time.perf_counter()
        ckpt = write_synthetic(
            "qwen3_5_moe", ["linear_attention"], args.workdir / "qwen3_5_moe-35b-a3b-1layer"
        )
        print(f"wrote {ckpt} in {time.perf_counter() - t0:.0f} s", flush=True)
        runs.append(("qwen3_5_moe", ckpt))

    results: dict[tuple[str, str], list[dict]] = {}
    for family, ckpt in runs:
        for method in args.method:
            r = run_child(
                ckpt,
                args.workdir / f"{ckpt.name}-quantized",
                args.device,
                args.samples,
                args.seqlen,
                method,
            )
            results.setdefault((family, method), []).append(r)
            print(json.dumps(r), flush=True)
            if args.json:
                with args.json.with_suffix(".runs.jsonl").open("a") as fh:
                    fh.write(json.dumps(r) + "\n")
    if not args.keep:
        for _, ckpt in runs:
            shutil.rmtree(ckpt, ignore_errors=True)

    summary = {
        "device": args.device,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "cpus": os.cpu_count(),
        "runs": [r for rs in results.values() for r in rs],
        "projections": [
            {"method": method, **project(rs, fam)} for (fam, method), rs in results.items()
        ],
    }
    print(
        "\nmodel                          method    dev   layers  wall s  per-layer s          "
        "peak RSS GiB  peak GPU GiB"
    )
    for r in summary["runs"]:
        print(
            f"{r['model']:<30} {r['method']:<9} {r['device']:<5} {r['layers']:>6}  {r['wall_s']:>6}  "
            f"{' '.join(str(t) for t in r['layer_s']):<20} {r['peak_rss_gib']:>12}  {r['peak_gpu_gib']}"
        )
    for p in summary["projections"]:
        print(
            f"projection {p['family']} {p['method']}: {p['layers']} layers ~ "
            f"{p['projected_min']} min ({p})"
        )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--child":
        model, out, device, samples, seqlen, method = sys.argv[2:]
        print(
            json.dumps(
                measure_one(Path(model), Path(out), device, int(samples), int(seqlen), method)
            )
        )
    else:
        main()
