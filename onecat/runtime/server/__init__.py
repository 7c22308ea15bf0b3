"""onecat's OpenAI-compatible HTTP server (FastAPI + uvicorn) around the embedded engine.

- ``protocol``: pydantic request models of the OpenAI API (what is validated, what is refused).
- ``api_errors``: OpenAI-style error bodies and the exception the handlers raise.
- ``prompts``: chat template rendering and prompt tokenisation.
- ``async_engine``: a background thread that owns the single-threaded ``LLMEngine`` and
  exchanges requests and outputs with asyncio handlers.
- ``openai_serving``: turns requests into engine calls and engine outputs into OpenAI
  responses or SSE streams.
- ``metrics``: the Prometheus registry behind /metrics.
- ``app``: the FastAPI application factory; ``launcher``: ``onecat serve`` and a background
  server for tests and the demo.

FastAPI, uvicorn and pydantic are imported only by the modules that need them, never by
this package's ``__init__``: the engine must import on machines without them.
"""
