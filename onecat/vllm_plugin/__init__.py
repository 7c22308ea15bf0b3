"""onecat's vLLM plugin: serve onecat artifacts (and plain AWQ on V100) through vLLM.

vLLM finds :func:`register` through the ``vllm.general_plugins`` entry point and calls it in
every process (API server, engine core, each worker), possibly more than once. It checks
the vLLM version and registers two quantization methods (docs/VLLM.md):

- ``onecat``: packed artifacts from ``onecat pack`` (``quant_method: onecat``);
- ``onecat_awq``: plain AutoAWQ GEMM checkpoints, claimed automatically on sm_70 GPUs.

This package imports vLLM only inside :func:`register`; ``launcher`` (``onecat serve
--engine vllm``), ``version`` and ``tp_slicing`` work without it.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """Register onecat's quantization methods with vLLM (idempotent).

    Raises OnecatError when the installed vLLM is outside the supported range.
    """
    global _registered
    if _registered:
        return
    from onecat.vllm_plugin.version import check_vllm_version

    check_vllm_version()
    from vllm.model_executor.layers.quantization import register_quantization_config

    from onecat.vllm_plugin.config import ONECAT, ONECAT_AWQ, OnecatAwqConfig, OnecatConfig

    register_quantization_config(ONECAT)(OnecatConfig)
    register_quantization_config(ONECAT_AWQ)(OnecatAwqConfig)
    _registered = True
