"""The engine: scheduler, KV blocks and state slots, model runner (and the tensor-parallel
executor), the step kinds (plain, overlapped, speculative), sampling, detokenisation."""

from onecat.runtime.engine.llm_engine import LLMEngine, RequestOutput

__all__ = ["LLMEngine", "RequestOutput"]
