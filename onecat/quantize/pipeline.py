"""``onecat quantize``: streaming, resumable AWQ of a safetensors checkpoint into AutoAWQ GEMM.

Memory is bounded by one decoder layer plus the calibration activations: the embeddings
are read once to embed the calibration tokens, then each layer is read from the shards,
quantized (:mod:`onecat.quantize.layer_search`), written as its own shard and freed.

Work happens in ``OUT.partial`` next to OUT: one shard per finished layer plus
``progress.json`` (settings fingerprint and per-layer reports). After a crash or kill -9,
``resume=True`` recomputes the finished layers' fp outputs from the source (cheap, and bit
for bit the same) and goes on; the artifact equals an uninterrupted run's (only the
wall-clock times in the report differ). The work directory is renamed to OUT at the end.

Choices: the next layer is fed the fp layer's outputs (as AutoAWQ does); calibration
computes in float32 on CPU and on CUDA alike (Qwen activations can exceed the fp16 range,
which would turn a float16 calibration into inf; float32 on a GPU still takes seconds per
layer, and values beyond fp16 are reported per layer); unquantized tensors keep their source
dtype, except tensors changed by smoothing, which are stored as float16 when the source is
bfloat16; :func:`quantize_rtn` is plain round-to-nearest (no calibration) for comparisons.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from onecat.errors import OnecatError
from onecat.formats.awq_gemm import awq_config
from onecat.formats.checkpoint import INDEX_NAME, Checkpoint
from onecat.formats.files import read_checkpoint_json, write_json
from onecat.formats.fp16_headroom import CONFIG_KEY as HEADROOM_KEY
from onecat.formats.fp16_headroom import derive_plan, fractions
from onecat.formats.quant_config import find_quantization_config
from onecat.formats.staging import (
    check_no_overlap,
    check_replaceable,
    copy_side_files,
    publish,
    shard_name,
    side_file_names,
    write_index,
    write_shard,
)
from onecat.quantize.calibration import calibration_tokens
from onecat.quantize.fp16_sites import fraction_of_fp16, logits_peak
from onecat.quantize.layer_build import LayerFactory
from onecat.quantize.layer_search import LayerQuantizer
from onecat.quantize.recipe import METHODS, Recipe, load_recipe, recipe_for_model_type
from onecat.quantize.shard_plan import plan_rest_shards
from onecat.quantize.summary import print_summary

REPORT_NAME = "onecat_quantize_report.json"
PROGRESS_NAME = "progress.json"


def resolve_device(device: str) -> torch.device:
    """Parse ``cpu`` / ``cuda`` / ``cuda:N``; a CUDA device without a GPU is a clear error."""
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise OnecatError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OnecatError(
                f"--device {device}: no CUDA GPU is available to this torch "
                f"({torch.__version__}); use --device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise OnecatError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) present")
    elif dev.type != "cpu":
        raise OnecatError(f"--device {device}: only cpu and cuda devices are supported")
    return dev


def resolve_model(model: str | Path) -> Path:
    """A local checkpoint directory, or a hub id downloaded with huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    text = str(model)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise OnecatError(f"model {text!r} is not a checkpoint directory (nor a hub id like org/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                text,
                allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"],
            )
        )
    except Exception as exc:  # offline, unknown repo, gated repo...
        raise OnecatError(
            f"could not download {text!r} from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            f"Offline? Download the checkpoint elsewhere and pass its local directory as MODEL"
        ) from exc


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise OnecatError(f"{path} is missing: MODEL must be a transformers checkpoint directory")
    config = read_checkpoint_json(model_dir, "config.json")
    if "model_type" not in config:
        raise OnecatError(f"{path} has no model_type; pass --recipe FILE")
    if find_quantization_config(config) is not None:
        raise OnecatError(f"{path}: the model is already quantized; quantize an fp16/bf16 checkpoint")
    return config


def check_group_size(group: int, where: str) -> None:
    """OnecatError unless ``group`` is a positive multiple of 32 (the Volta layout and the
    kernels work on 32-wide tiles, so other sizes could not be packed or served)."""
    if isinstance(group, bool) or not isinstance(group, int) or group <= 0 or group % 32:
        raise OnecatError(
            f"{where} {group!r}: the group size must be a positive multiple of 32 "
            "(e.g. 32, 64 or 128, the recipes' default)"
        )


def _layer_prefix(recipe: Recipe, reader: Checkpoint) -> str:
    names = reader.names()
    for prefix in recipe.layer_prefixes:
        if any(n.startswith(f"{prefix}0.") for n in names):
            return prefix
    raise OnecatError(
        f"recipe {recipe.path}: none of architecture.layer_prefixes "
        f"({', '.join(recipe.layer_prefixes)}) matches the tensors of {reader.path}"
    )


def check_group_divisibility(rcp: Recipe, reader: Checkpoint, prefix: str,
                             num_layers: int, group: int) -> None:
    """Before any work: refuse a group size that fits none of the linears the recipe
    quantizes (the output would be a float model labelled AWQ), and under
    ``indivisible: fail`` any quantized linear whose in-features do not divide by the group
    size (or out-features by 8), naming it."""
    fitting, shapes = 0, set()
    for i in range(num_layers):
        where = f"{prefix}{i}."
        for name in reader.names():
            if not name.startswith(where):
                continue
            rel, shape = name[len(where):], reader.shapes[name]
            linears = []
            if rel.endswith(".weight") and len(shape) == 2:
                linears.append((rel[: -len(".weight")], shape[0], shape[1]))
            elif rcp.experts is not None and len(shape) == 3:
                base = rcp.experts.module
                if rel == f"{base}.{rcp.experts.gate_up_proj}":
                    linears += [(f"{base}.0.gate_proj", shape[1] // 2, shape[2]),
                                (f"{base}.0.up_proj", shape[1] // 2, shape[2])]
                elif rel == f"{base}.{rcp.experts.down_proj}":
                    linears.append((f"{base}.0.down_proj", shape[1], shape[2]))
            for module, n, k in linears:
                if not rcp.is_quantized(module):
                    continue
                shapes.add(k)
                if not (k % group or n % 8):
                    fitting += 1
                elif rcp.indivisible == "fail":
                    raise OnecatError(
                        f"{where}{module}: in-features {k} (out-features {n}) do not fit group "
                        f"size {group}; recipe {rcp.path} says quantization.indivisible: fail. "
                        f"Pick another --group-size or set indivisible: keep_fp16"
                    )
    if not fitting:
        found = (f"their in-features are {', '.join(map(str, sorted(shapes)))}" if shapes else
                 f"recipe {rcp.path} matches none of the checkpoint's linears")
        raise OnecatError(
            f"nothing would be quantized with group size {group} ({found}): the output would "
            "be a float model labelled AWQ. Pick a --group-size that divides the in-features "
            "(a multiple of 32 such as 128)"
        )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_SHARD = re.compile(r"\.?model-\d{5}-of-\d{5}\.safetensors(\.tmp)?")


def _work_file(work: Path, src: Path) -> Callable[[str], bool]:
    """Which files of an interrupted run's work directory ``work`` (``OUT.partial``, which has
    no output marker yet) this pipeline wrote: its progress file, shards (and their temporary
    names), index, config, report and the source's side files. Only when the progress file
    (with its fingerprint) or the report is there: without either the directory is not a run
    of this pipeline and nothing in it counts as written."""
    try:
        started = "fingerprint" in json.loads((work / PROGRESS_NAME).read_text())
    except (OSError, ValueError, TypeError):
        started = False
    if not (started or (work / REPORT_NAME).is_file()):
        return lambda name: False
    names = {PROGRESS_NAME, REPORT_NAME, INDEX_NAME, "config.json", *side_file_names(src)}
    return lambda name: name in names or _SHARD.fullmatch(name) is not None


def _prepare_output(out: Path, work: Path, src: Path, resume: bool, overwrite: bool) -> bool:
    """Check OUT / the work dir against the source and the flags (before anything is
    touched). Returns True when OUT is already complete."""
    if resume and overwrite:
        raise OnecatError("pass either --resume or --overwrite, not both")
    check_no_overlap(out, src, work)
    if (out.exists() or out.is_symlink()) and not overwrite:
        if resume and (out / REPORT_NAME).is_file():
            return True
        raise OnecatError(
            f"output directory {out} already exists; pass --overwrite to replace it"
            + (" (it is not a finished onecat artifact, so --resume cannot finish it)" if resume else
               " or --resume to finish an interrupted run")
        )
    if overwrite:  # refuse before anything is touched: --overwrite deletes only what onecat wrote
        check_replaceable(out)
        if work.exists() or work.is_symlink():
            check_replaceable(work, _work_file(work, src))
    if work.exists():
        if overwrite:
            shutil.rmtree(work)
        elif not resume:
            raise OnecatError(
                f"an interrupted run left {work}; pass --resume to finish it or --overwrite to start over"
            )
    return False


def quantize_model(
    model: str | Path,
    out: str | Path,
    *,
    recipe: str | Path | None = None,
    calib: str | None = "builtin:pydoc",
    samples: int | None = None,
    seqlen: int | None = None,
    group_size: int | None = None,
    method: str | None = None,
    device: str = "cpu",
    resume: bool = False,
    overwrite: bool = False,
    show_progress: bool = True,
) -> Path:
    """AWQ-quantize MODEL (directory or hub id) into an AutoAWQ GEMM checkpoint at OUT.

    ``method``: ``awq`` (plain rounding after smoothing and clipping) or ``awq+gptq``
    (GPTQ's error-compensating rounding after them; same output format). None for
    ``recipe`` / ``calib`` / ``samples`` / ``seqlen`` / ``group_size`` / ``method`` means the
    recipe's value (the recipe is chosen by config.json's model_type). Returns OUT.
    """
    if method is not None and method not in METHODS:
        raise OnecatError(f"--method {method!r} is not a method; use one of: {', '.join(METHODS)}")
    return _run(model, out, awq=True, recipe=recipe, calib=calib, samples=samples, seqlen=seqlen,
                group_size=group_size, method=method, device=device, resume=resume,
                overwrite=overwrite, show_progress=show_progress)


def quantize_rtn(
    model: str | Path,
    out: str | Path,
    *,
    group_size: int | None = None,
    recipe: str | Path | None = None,
    device: str = "cpu",
    resume: bool = False,
    overwrite: bool = False,
    show_progress: bool = True,
) -> Path:
    """Plain round-to-nearest (no calibration, no smoothing, no clipping) into the same format."""
    return _run(model, out, awq=False, recipe=recipe, calib=None, samples=None, seqlen=None,
                group_size=group_size, method=None, device=device, resume=resume, overwrite=overwrite,
                show_progress=show_progress)


def _run(model, out, *, awq, recipe, calib, samples, seqlen, group_size, method, device, resume,
         overwrite, show_progress) -> Path:
    started = time.perf_counter()
    if group_size is not None:
        check_group_size(group_size, "--group-size")
    dev = resolve_device(device)
    out = Path(out).expanduser().absolute()
    work = out.with_name(out.name + ".partial")
    model_dir = resolve_model(model)
    if _prepare_output(out, work, model_dir, resume, overwrite):
        if show_progress:
            print(f"{out} is already complete")
        return out
    config = _read_config(model_dir)
    rcp = load_recipe(recipe) if recipe is not None else recipe_for_model_type(
        config["model_type"], model_dir / "config.json")
    if config["model_type"] not in rcp.model_types and recipe is None:
        raise OnecatError(f"recipe {rcp.path} does not list model_type {config['model_type']!r}")
    reader = Checkpoint(model_dir)
    prefix = _layer_prefix(rcp, reader)
    group = rcp.group_size if group_size is None else group_size
    check_group_size(group, f"recipe {rcp.path}: quantization.group_size")
    calib = calib or rcp.calib_source
    samples = samples or rcp.calib_samples
    seqlen = seqlen or rcp.calib_seqlen
    method = (method or rcp.method) if awq else "rtn"
    gptq = method == "awq+gptq"
    dtype = torch.float32  # see the module docstring

    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    factory = LayerFactory(rcp, hf_config, dev, dtype)
    num_layers = factory.num_layers
    layer_names = {i: [n for n in reader.names() if n.startswith(f"{prefix}{i}.")] for i in range(num_layers)}
    for i, names in layer_names.items():
        if not names:
            raise OnecatError(f"{reader.path}: no tensors for layer {i} ({prefix}{i}.*); the checkpoint is incomplete")
    in_layers = {n for names in layer_names.values() for n in names}
    rest_groups = plan_rest_shards(reader, [n for n in reader.names() if n not in in_layers])
    total_shards = len(rest_groups) + num_layers

    check_group_divisibility(rcp, reader, prefix, num_layers, group)
    hidden = None
    if awq:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except Exception as exc:
            raise OnecatError(f"{model_dir}: cannot load the tokenizer for calibration ({exc})") from exc
        tokens = calibration_tokens(tokenizer, calib, samples, seqlen)
        embed_name = prefix[: -len("layers.")] + "embed_tokens.weight"
        embed = reader.get(embed_name)
        hidden = embed[tokens].to(device=dev, dtype=dtype)
        del embed

    fingerprint = {
        "method": method,
        **({"gptq": {"damp": rcp.gptq.damp, "block_size": rcp.gptq.block_size}} if gptq else {}),
        "recipe_sha256": _sha256(rcp.path.read_bytes()),
        "config_sha256": _sha256((model_dir / "config.json").read_bytes()),
        "tensors_sha256": _sha256(json.dumps([[n, reader.shapes[n], reader.dtypes[n]] for n in reader.names()]).encode()),
        "group_size": group,
        "calibration": {"source": calib, "samples": samples, "seqlen": seqlen} if awq else None,
        "device_type": dev.type,
        "dtype": str(dtype),
    }
    created = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    progress_path = work / PROGRESS_NAME
    if progress_path.is_file():
        progress = json.loads(progress_path.read_text())
        if progress.get("fingerprint") != fingerprint:
            raise OnecatError(
                f"{work} was started with other settings (model, recipe, calibration, group size "
                f"or device); pass --overwrite to start over"
            )
    else:
        progress = {"fingerprint": fingerprint, "layers": {}}
        write_json(progress_path, progress)

    quantizer = LayerQuantizer(factory, rcp, group, awq=awq, gptq=gptq)
    try:
        weight_map, hidden = _quantize_layers(
            quantizer, reader, layer_names, prefix, hidden, work, progress,
            first_shard=len(rest_groups) + 1, total_shards=total_shards, show_progress=show_progress,
        )
    except OnecatError:
        if created and not progress["layers"]:
            shutil.rmtree(work, ignore_errors=True)  # bad input, nothing worth resuming
        raise
    headroom = None
    if hidden is not None:
        headroom = _fp16_headroom(reader, prefix, rcp, hf_config, hidden,
                                  [progress["layers"][str(i)]["report"] for i in range(num_layers)])
    del hidden
    if not any(n.endswith(".qweight") for n in weight_map):
        shutil.rmtree(work, ignore_errors=True)
        raise OnecatError(
            f"no linear was quantized with group size {group} (every one was kept in floating "
            "point): the output would be a float model labelled AWQ. Pick another --group-size"
        )

    for number, names in enumerate(rest_groups, 1):
        shard = shard_name(number, total_shards)
        if not (work / shard).is_file():
            write_shard(work / shard, {n: reader.get(n) for n in names})
        weight_map.update({n: shard for n in names})
    write_index(work, weight_map)
    kept = [n for i in range(num_layers) for n in progress["layers"][str(i)]["fp16_kept"]]
    not_convert = list(rcp.modules_to_not_convert) + kept
    out_config = awq_config(config, group, not_convert)
    if headroom is not None:
        out_config[HEADROOM_KEY] = headroom["plan"]
    write_json(work / "config.json", out_config)
    copy_side_files(model_dir, work)
    layers = [progress["layers"][str(i)]["report"] for i in range(num_layers)]
    report = {
        "method": fingerprint["method"],
        "model": str(model),
        "recipe": {"name": rcp.name, "path": str(rcp.path), "sha256": fingerprint["recipe_sha256"]},
        "calibration": fingerprint["calibration"],
        "gptq": fingerprint.get("gptq"),
        "group_size": group,
        "bits": 4,
        "device": dev.type,
        "compute_dtype": str(dtype),
        "modules_to_not_convert": not_convert,
        "fp16_headroom": headroom,
        "layers": layers,
        "time_s": round(time.perf_counter() - started, 3),
    }
    write_json(work / REPORT_NAME, report)
    check_replaceable(out)  # before the progress file goes: a refusal leaves a resumable run
    (work / PROGRESS_NAME).unlink()
    publish(work, out, "onecat quantize")
    if show_progress:
        print_summary(report, out)
    return out


def _quantize_layers(quantizer: LayerQuantizer, reader: Checkpoint, layer_names: dict,
                     prefix: str, hidden: torch.Tensor | None, work: Path, progress: dict, *,
                     first_shard: int, total_shards: int,
                     show_progress: bool) -> tuple[dict[str, str], torch.Tensor | None]:
    """Quantize (or, when resuming, replay) every decoder layer; returns the weight map and
    the last layer's fp output (None without calibration)."""
    num_layers = len(layer_names)
    progress_path = work / PROGRESS_NAME
    weight_map: dict[str, str] = {}
    label = "AWQ+GPTQ" if quantizer.gptq else "AWQ" if quantizer.awq else "RTN"
    bar = _progress_bar(num_layers, show_progress, label)
    for i in range(num_layers):
        where = f"{prefix}{i}."
        shard = shard_name(first_shard + i, total_shards)
        done = progress["layers"].get(str(i))
        if done is not None and (work / shard).is_file():
            if hidden is not None:  # replay: the next layer's inputs (the logits' after the last)
                layer = quantizer.factory.build(i, _load_layer(reader, layer_names[i], where), where)
                hidden = quantizer.propagate(layer, hidden, quantizer.recipe.loss_tokens)
                del layer
            names = done["tensors"]
        else:
            tensors = _load_layer(reader, layer_names[i], where)
            outcome = quantizer.quantize_layer(i, tensors, hidden, where)
            write_shard(work / shard, {where + k: v for k, v in outcome.tensors.items()})
            names = sorted(where + k for k in outcome.tensors)
            progress["layers"][str(i)] = {"report": outcome.report, "tensors": names,
                                          "fp16_kept": [where + n for n in outcome.fp16_kept]}
            write_json(progress_path, progress)
            hidden = outcome.next_hidden
            del outcome, tensors
        weight_map.update({n: shard for n in names})
        reader.release()
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return weight_map, hidden


def _fp16_headroom(reader: Checkpoint, prefix: str, rcp: Recipe, hf_config, hidden: torch.Tensor,
                   reports: list[dict]) -> dict:
    """The report's ``fp16_headroom`` (each layer's site peaks as fractions of the fp16
    maximum are in its own report, ``fp16_headroom``): the logits' fraction and the plan
    (``onecat.formats.fp16_headroom``) written into config.json."""
    text = getattr(hf_config, "text_config", None) or hf_config
    base = prefix[: -len("layers.")]
    head_name = "lm_head.weight" if "lm_head.weight" in reader.names() else base + "embed_tokens.weight"
    logits = logits_peak(hidden, reader.get(base + "norm.weight"), reader.get(head_name),
                         float(text.rms_norm_eps), rcp.norm_style == "one_plus")
    for report in reports:
        report["fp16_headroom"] = fractions(report.get("fp16_peaks", {}))
    plan = derive_plan([{"layer": r["layer"], **r.get("fp16_peaks", {})} for r in reports], logits,
                       source="calibration")
    return {"logits": fraction_of_fp16(logits), "plan": plan.to_json()}


def _load_layer(reader: Checkpoint, names: list[str], where: str) -> dict[str, torch.Tensor]:
    """The source tensors of one layer, keyed by layer-relative names."""
    return {n[len(where):]: reader.get(n) for n in names}


def _progress_bar(total: int, show: bool, label: str):
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"onecat quantize ({label})", unit="layer")
