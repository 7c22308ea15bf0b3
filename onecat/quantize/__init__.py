"""Calibration, AWQ search and the streaming quantizer that writes AutoAWQ GEMM checkpoints.

- ``recipe``: recipes/*.yaml (model-family facts) and their schema;
- ``calibration``: calibration text sources cut into token samples;
- ``quantizer``, ``auto_scale``, ``auto_clip``, ``smoothing``: the AWQ math, pure functions;
- ``shards``, ``layer_build``, ``moe``: one decoder layer at a time from safetensors shards;
- ``layer_search``: AWQ for one layer; ``pipeline``: ``quantize_model`` / ``quantize_rtn``;
- ``writer``, ``summary``: the AWQ GEMM artifact and the end-of-run table;
- ``evaluate``: perplexity of fp checkpoints and AWQ artifacts.
"""
