"""Quantization recipes: YAML files that hold every model-family fact the quantizer needs.

A recipe names transformers' decoder-layer and rotary classes, where the layers sit in the
checkpoint, which linears are quantized, the AWQ smoothing mappings, the search settings and
the calibration defaults. Recipes ship in the repository's ``recipes/`` directory, installed
as the package data of ``onecat.recipes``; one is chosen by config.json's ``model_type``.

Validation is strict: an error names the file, the field, what was found and what is allowed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from onecat.errors import OnecatError

RECIPE_VERSION = 1
NORM_STYLES = ("one_plus", "plain")
METHODS = ("awq", "awq+gptq")
INDIVISIBLE_POLICIES = ("keep_fp16", "fail")


@dataclass(frozen=True)
class Experts:
    """Where fused 3-D experts sit in a layer and how they split into per-expert linears."""

    module: str
    gate_up_proj: str
    down_proj: str


@dataclass(frozen=True)
class GptqSettings:
    """The GPTQ stage of ``method: awq+gptq`` (onecat/quantize/gptq.py): ``damp`` is the
    fraction of the Hessian's mean diagonal added to its diagonal, ``block_size`` the columns
    updated together before the lazy update of the rest, ``act_order`` rounds columns by
    decreasing Hessian diagonal with static groups (same output format), ``sequential``
    quantizes a layer's linears input by input in execution order, each against its inputs
    recomputed through the linears before it already quantized, its target corrected for
    their error (gptq.py, "Sequential inputs")."""

    damp: float = 0.5
    block_size: int = 128
    act_order: bool = False
    sequential: bool = True


@dataclass(frozen=True)
class Mapping:
    """One AWQ smoothing: ``smooth`` (a norm or linear) feeds every layer in ``balance``.

    ``scored`` is the module whose output the search compares; ``*`` in the names stands for
    an expert index and expands per expert. ``gated_query`` names a q_proj whose rows are
    ``[query | gate]`` per head: only its query rows are quantized while scoring.
    """

    smooth: str
    balance: tuple[str, ...]
    scored: str
    gated_query: str | None = None


@dataclass(frozen=True)
class Recipe:
    """A validated recipe (see ``recipes/*.yaml`` for the commented originals)."""

    path: Path
    name: str
    model_types: tuple[str, ...]
    decoder_layer: str
    rotary_embedding: str
    layer_prefixes: tuple[str, ...]
    norm_style: str
    experts: Experts | None
    bits: int
    group_size: int
    zero_point: bool
    quantize: tuple[str, ...]
    ignore: tuple[str, ...]
    indivisible: str
    modules_to_not_convert: tuple[str, ...]
    mappings: tuple[Mapping, ...]
    grid: int
    duo_scaling: bool
    clip: bool
    clip_grid: int
    clip_max_shrink: float
    clip_skip: tuple[str, ...]
    clip_tokens: int
    loss_tokens: int
    calib_source: str
    calib_samples: int
    calib_seqlen: int
    method: str = "awq"
    gptq: GptqSettings = field(default_factory=GptqSettings)
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    def is_quantized(self, name: str) -> bool:
        """Whether the layer-relative module ``name`` is quantized by this recipe."""
        if any(re.fullmatch(p, name) for p in self.ignore):
            return False
        return any(re.fullmatch(p, name) for p in self.quantize)

    def skips_clip(self, name: str) -> bool:
        """Whether the clip search is skipped for ``name`` (q/k projections)."""
        return any(re.fullmatch(p, name) for p in self.clip_skip)


def recipes_dir() -> Path:
    """The directory holding the shipped recipes.

    Installed, that is the package data directory ``onecat/recipes``; in the repository
    ``onecat/recipes`` is a symlink to the top-level ``recipes/`` (used directly as a
    fallback where symlinks are not checked out).
    """
    package_data = Path(__file__).resolve().parents[1] / "recipes"
    if package_data.is_dir():
        return package_data
    return Path(__file__).resolve().parents[2] / "recipes"


def shipped_recipes() -> dict[str, Path]:
    """Map each recipe name (file stem) to its path."""
    return {p.stem: p for p in sorted(recipes_dir().glob("*.yaml"))}


def recipe_for_model_type(model_type: str, config_path: Path | str = "config.json") -> Recipe:
    """Load the shipped recipe that lists ``model_type``; the error lists every recipe."""
    available = []
    for path in shipped_recipes().values():
        recipe = load_recipe(path)
        available.append(f"{path.name} ({', '.join(recipe.model_types)})")
        if model_type in recipe.model_types:
            return recipe
    raise OnecatError(
        f"{config_path}: no recipe for model_type {model_type!r}. Shipped recipes: "
        f"{'; '.join(available) or 'none'}. Pass --recipe FILE with a recipe for this family "
        f"(copy one of {recipes_dir()} and adapt it)."
    )


class _Fields:
    """Typed access to one YAML mapping, with errors naming the file and the field path."""

    def __init__(self, path: Path, data: Any, where: str) -> None:
        self.path, self.where = path, where
        if not isinstance(data, dict):
            self.fail(where or "top level", f"must be a mapping, found {type(data).__name__}")
        self.data: dict[str, Any] = data
        self.used: set[str] = set()

    def fail(self, name: str, why: str) -> None:
        raise OnecatError(f"recipe {self.path}: field {name!r} {why}")

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, kind: type | tuple[type, ...], *, default: Any = ..., allowed=None):
        self.used.add(key)
        if key not in self.data:
            if default is ...:
                self.fail(self._name(key), "is missing")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # bool is an int subclass: refuse true/false where a number is expected
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(k.__name__ for k in kinds)
            self.fail(self._name(key), f"must be {names}, found {value!r}")
        if allowed is not None and value not in allowed:
            self.fail(
                self._name(key), f"is {value!r}; allowed values: {', '.join(map(str, allowed))}"
            )
        return value

    def strings(self, key: str, *, default: Any = ..., regex: bool = False) -> tuple[str, ...]:
        value = self.get(key, list, default=default)
        if value is None:
            return ()
        for item in value:
            if not isinstance(item, str):
                self.fail(self._name(key), f"must be a list of strings, found item {item!r}")
            if regex:
                try:
                    re.compile(item)
                except re.error as exc:
                    self.fail(self._name(key), f"has an invalid regex {item!r}: {exc}")
        return tuple(value)

    def section(self, key: str, *, optional: bool = False) -> _Fields | None:
        value = self.get(key, (dict, type(None)) if optional else dict, default=None if optional else ...)
        return None if value is None else _Fields(self.path, value, self._name(key))

    def positive(self, key: str, *, default: Any = ...) -> int:
        value = self.get(key, int, default=default)
        if value <= 0:
            self.fail(self._name(key), f"must be a positive integer, found {value}")
        return value

    def finish(self) -> None:
        extra = sorted(set(self.data) - self.used)
        if extra:
            self.fail(
                self._name(extra[0]),
                f"is not a known field; known fields here: {', '.join(sorted(self.used))}",
            )


def _mapping(path: Path, data: Any, index: int) -> Mapping:
    f = _Fields(path, data, f"smoothing[{index}]")
    smooth = f.get("smooth", str)
    balance = f.strings("balance")
    if not balance:
        f.fail(f"smoothing[{index}].balance", "must list at least one layer")
    scored = f.get("scored", str)
    gated = f.get("gated_query", (str, type(None)), default=None)
    f.finish()
    stars = [n.count("*") for n in (smooth, *balance, scored)]
    if any(c > 1 for c in stars):
        f.fail(f"smoothing[{index}]", "may use '*' (an expert index) at most once per name")
    if "*" in smooth and not all("*" in n for n in (*balance, scored)):
        f.fail(
            f"smoothing[{index}]",
            "uses '*' in smooth, so every balance layer and scored must use it too",
        )
    if gated is not None and gated not in balance:
        f.fail(f"smoothing[{index}].gated_query", f"is {gated!r}, which is not in balance")
    return Mapping(smooth, balance, scored, gated)


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe file; any problem raises OnecatError naming file and field."""
    path = Path(path)
    if not path.is_file():
        raise OnecatError(
            f"recipe {path} does not exist; shipped recipes: {', '.join(shipped_recipes())}"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise OnecatError(f"recipe {path} is not valid YAML: {exc}") from exc
    top = _Fields(path, data, "")
    top.get("recipe_version", int, allowed=(RECIPE_VERSION,))
    name = top.get("name", str)
    model_types = top.strings("model_types")

    arch = top.section("architecture")
    decoder_layer = arch.get("decoder_layer", str)
    rotary = arch.get("rotary_embedding", str)
    prefixes = arch.strings("layer_prefixes")
    if not prefixes:
        arch.fail("architecture.layer_prefixes", "must list at least one prefix")
    norm_style = arch.get("norm_style", str, allowed=NORM_STYLES)
    experts_f = arch.section("experts", optional=True)
    experts = None
    if experts_f is not None:
        experts = Experts(
            experts_f.get("module", str),
            experts_f.get("gate_up_proj", str),
            experts_f.get("down_proj", str),
        )
        experts_f.finish()
    arch.finish()

    quant = top.section("quantization")
    bits = quant.get("bits", int, allowed=(4,))
    group_size = quant.positive("group_size")
    if group_size % 8:
        quant.fail("quantization.group_size", f"must be a multiple of 8, found {group_size}")
    zero_point = quant.get("zero_point", bool, allowed=(True,))
    quantize = quant.strings("quantize", regex=True)
    ignore = quant.strings("ignore", default=[], regex=True)
    indivisible = quant.get("indivisible", str, allowed=INDIVISIBLE_POLICIES)
    not_convert = quant.strings("modules_to_not_convert", default=[])
    quant.finish()

    smoothing = top.get("smoothing", list, default=[])
    mappings = tuple(_mapping(path, m, i) for i, m in enumerate(smoothing))

    search = top.section("search")
    grid = search.positive("grid")
    duo = search.get("duo_scaling", bool)
    clip = search.get("clip", bool)
    clip_grid = search.positive("clip_grid")
    shrink = search.get("clip_max_shrink", (float, int))
    if not 0 <= shrink < 1:
        search.fail("search.clip_max_shrink", f"must be in [0, 1), found {shrink}")
    clip_skip = search.strings("clip_skip", default=[], regex=True)
    clip_tokens = search.positive("clip_tokens")
    loss_tokens = search.positive("loss_tokens")
    search.finish()

    calib = top.section("calibration")
    source = calib.get("source", str)
    samples = calib.positive("samples")
    seqlen = calib.positive("seqlen")
    calib.finish()

    method = top.get("method", str, default="awq", allowed=METHODS)
    gptq_f = top.section("gptq", optional=True)
    gptq = GptqSettings()
    if gptq_f is not None:
        damp = gptq_f.get("damp", (float, int), default=gptq.damp)
        if not 0 < damp < 1:
            gptq_f.fail("gptq.damp", f"must be in (0, 1) (a fraction of the mean Hessian diagonal), found {damp}")
        gptq = GptqSettings(float(damp), gptq_f.positive("block_size", default=gptq.block_size),
                            gptq_f.get("act_order", bool, default=gptq.act_order),
                            gptq_f.get("sequential", bool, default=gptq.sequential))
        gptq_f.finish()
    top.finish()

    return Recipe(
        path=path, name=name, model_types=model_types, decoder_layer=decoder_layer,
        rotary_embedding=rotary, layer_prefixes=prefixes, norm_style=norm_style,
        experts=experts, bits=bits, group_size=group_size, zero_point=zero_point,
        quantize=quantize, ignore=ignore, indivisible=indivisible,
        modules_to_not_convert=not_convert, mappings=mappings, grid=grid, duo_scaling=duo,
        clip=clip, clip_grid=clip_grid, clip_max_shrink=float(shrink), clip_skip=clip_skip,
        clip_tokens=clip_tokens, loss_tokens=loss_tokens, calib_source=source,
        calib_samples=samples, calib_seqlen=seqlen, method=method, gptq=gptq, raw=data,
    )


def import_class(dotted: str, recipe: Recipe, field_name: str) -> type:
    """Import ``package.module.Class`` named by a recipe field, with a clear error."""
    import importlib

    module_name, _, cls_name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise OnecatError(
            f"recipe {recipe.path}: field {field_name!r} names {dotted!r}, which this "
            f"transformers cannot provide ({exc}); upgrade transformers or fix the recipe"
        ) from exc
