"""The engine: scheduler, KV blocks and state slots, model runner, sampling, detokenisation."""

from onecat.runtime.engine.llm_engine import LLMEngine, RequestOutput

__all__ = ["LLMEngine", "RequestOutput"]
