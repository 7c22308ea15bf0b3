"""The end-of-run summary table of ``onecat quantize`` (from the JSON report)."""

from __future__ import annotations

from pathlib import Path

KIND_LABELS = {"linear_attention": "GDN", "full_attention": "attention"}


def _ratios(layer: dict) -> str:
    ratios = [m["ratio"] for m in layer.get("mappings", [])]
    if not ratios:
        return "-"
    shown = ["id" if r is None else f"{r:.2f}" for r in ratios[:4]]
    return " ".join(shown) + (f" (+{len(ratios) - 4})" if len(ratios) > 4 else "")


def print_summary(report: dict, out: Path) -> None:
    """Print one row per layer (kind, chosen ratios, mean clip, output MSE RTN -> AWQ, time)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"onecat quantize ({report['method']}, g{report['group_size']})")
    for col in ("layer", "kind", "ratios", "clip", "MSE rtn", "MSE awq", "gain", "s"):
        table.add_column(col, justify="right" if col not in ("kind", "ratios") else "left")
    gains = []
    for layer in report["layers"]:
        clip = layer.get("clip") or {}
        mean_clip = f"{sum(clip.values()) / len(clip):.3f}" if clip else "-"
        rtn, awq = layer.get("output_mse_rtn"), layer.get("output_mse_awq")
        gain = "-"
        if rtn and awq is not None:
            gains.append(1 - awq / rtn)
            gain = f"{100 * (1 - awq / rtn):.1f}%"
        table.add_row(
            str(layer["layer"]), KIND_LABELS.get(layer["kind"], layer["kind"]), _ratios(layer), mean_clip,
            f"{rtn:.3g}" if rtn is not None else "-", f"{awq:.3g}" if awq is not None else "-",
            gain, f"{layer['time_s']:.1f}",
        )
    console = Console()
    console.print(table)
    kept = sum(len(layer.get("fp16_kept", [])) for layer in report["layers"])
    mean_gain = f"; mean layer-output error reduction vs RTN {100 * sum(gains) / len(gains):.1f}%" if gains else ""
    console.print(
        f"{len(report['layers'])} layers in {report['time_s']:.1f} s{mean_gain}; "
        f"{kept} linears kept in fp16"
    )
    console.print(f"artifact: {out}")
