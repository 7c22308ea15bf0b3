"""Calibration, AWQ search and the streaming quantizer that writes AutoAWQ GEMM checkpoints.

- ``recipe``: recipes/*.yaml (model-family facts) and their schema;
- ``calibration``: calibration text sources cut into token samples (and the pydoc text that
  ``evaluate`` also reads);
- ``quantizer``, ``auto_scale``, ``auto_clip``, ``smoothing``, ``gptq``: the AWQ and GPTQ
  math, pure functions over tensors;
- ``layer_build``, ``moe``: one decoder layer at a time, built from checkpoint tensors with
  transformers' own classes (fused MoE experts as per-expert linears);
- ``layer_search``: AWQ (and GPTQ) for one layer; ``pipeline``: ``quantize_model`` /
  ``quantize_rtn``, streaming and resumable;
- ``shard_plan``: which tensors go into which shard; the writing itself is
  :mod:`onecat.formats.staging`'s; ``summary``: the end-of-run table;
- ``evaluate``, ``awq_reader``: perplexity of fp checkpoints and AutoAWQ GEMM artifacts (read
  back as float models).
"""
