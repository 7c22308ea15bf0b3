"""Engine cores in their own processes (issue #41): the API server process talks to one
engine-core process per data-parallel replica over ZMQ with msgspec messages.

- ``messages``: what crosses the sockets (requests in; token ids, finish reasons and stats out).
- ``process``: the engine-core process (``python -m onecat.runtime.core.process``): it
  schedules, runs and samples; it never detokenises.
- ``client``: one engine-core process seen from the API process (start, send, receive, death).
- ``routing``: which replica a request goes to (least loaded, prefix affinity).
- ``placement``: which GPUs and what memory share each replica gets.
- ``replicas``: ``ReplicaSet``, the server's engine: N cores behind one interface, with
  detokenisation and stop strings in the API process, failover and restarts.
"""
