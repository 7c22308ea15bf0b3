"""The embedded Qwen3.5 runtime: model, engine, scheduler and OpenAI-compatible server."""
