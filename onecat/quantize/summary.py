"""The end-of-run summary table of ``onecat quantize`` (from the JSON report)."""

from __future__ import annotations

from pathlib import Path

from onecat.formats.fp16_headroom import HeadroomPlan, describe_plan

KIND_LABELS = {"linear_attention": "GDN", "full_attention": "attention"}


def _ratios(layer: dict) -> str:
    ratios = [m["ratio"] for m in layer.get("mappings", [])]
    if not ratios:
        return "-"
    shown = ["id" if r is None else f"{r:.2f}" for r in ratios[:4]]
    return " ".join(shown) + (f" (+{len(ratios) - 4})" if len(ratios) > 4 else "")


def _headroom(layer: dict) -> str:
    """The layer's largest fp16 site as a fraction of 65504, and the site (``-`` unmeasured)."""
    sites = layer.get("fp16_headroom") or {}
    if not sites:
        return "-"
    site = max(sites, key=sites.get)
    return f"{sites[site]:.3g} {site}"


def _mse(value: float | None) -> str:
    return f"{value:.3g}" if value is not None else "-"


def print_summary(report: dict, out: Path) -> None:
    """Print one row per layer (kind, chosen ratios, mean clip, layer-output MSE of RTN, AWQ
    and, for ``awq+gptq``, AWQ+GPTQ, the gain of the shipped result over RTN, the largest fp16
    headroom site as a fraction of the fp16 maximum, time), then the fp16 headroom plan."""
    from rich.console import Console
    from rich.table import Table

    gptq = report["method"] == "awq+gptq"
    table = Table(title=f"onecat quantize ({report['method']}, g{report['group_size']})")
    columns = ["layer", "kind", "ratios", "clip", "MSE rtn", "MSE awq"]
    columns += ["MSE gptq", "plain"] if gptq else []
    for col in [*columns, "gain", "fp16 peak", "s"]:
        table.add_column(col, justify="right" if col not in ("kind", "ratios", "fp16 peak") else "left")
    gains, fallback = [], 0
    for layer in report["layers"]:
        clip = layer.get("clip") or {}
        mean_clip = f"{sum(clip.values()) / len(clip):.3f}" if clip else "-"
        rtn, awq = layer.get("output_mse_rtn"), layer.get("output_mse_awq")
        result = layer.get("output_mse_gptq") if gptq else awq
        gain = "-"
        if rtn and result is not None:
            gains.append(1 - result / rtn)
            gain = f"{100 * (1 - result / rtn):.1f}%"
        row = [str(layer["layer"]), KIND_LABELS.get(layer["kind"], layer["kind"]), _ratios(layer),
               mean_clip, _mse(rtn), _mse(awq)]
        if gptq:
            stage = layer.get("gptq") or {}
            fallback += len(stage.get("fallback_rtn", {}))
            row += [_mse(result), str(len(stage.get("fallback_rtn", {})))]
        table.add_row(*row, gain, _headroom(layer), f"{layer['time_s']:.1f}")
    console = Console()
    console.print(table)
    kept = sum(len(layer.get("fp16_kept", [])) for layer in report["layers"])
    mean_gain = f"; mean layer-output error reduction vs RTN {100 * sum(gains) / len(gains):.1f}%" if gains else ""
    rounded = f"; {fallback} linears rounded plainly (too few calibration rows for GPTQ)" if gptq else ""
    console.print(
        f"{len(report['layers'])} layers in {report['time_s']:.1f} s{mean_gain}; "
        f"{kept} linears kept in fp16{rounded}"
    )
    headroom = report.get("fp16_headroom")
    if headroom:
        plan = HeadroomPlan.from_json(headroom["plan"], "report")
        console.print(f"fp16 headroom (peaks as fractions of 65504; logits {headroom['logits']:.3g}): "
                      f"{describe_plan(plan)}")
    console.print(f"artifact: {out}")
