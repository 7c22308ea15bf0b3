"""Client-side benchmarks of an OpenAI-compatible server (``onecat bench serve``).

A client only: nothing here imports the runtime. ``datasets`` builds the prompts,
``client`` sends one streamed request and times it, ``metrics`` turns the timings into
vLLM's figures (pure functions), ``report`` prints and saves them, ``serve`` drives a run.
"""
