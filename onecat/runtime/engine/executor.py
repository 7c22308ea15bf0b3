"""The processes of a tensor-parallel engine and the runner rank 0 drives them with.

Rank 0 is the engine's own process: it owns the scheduler, runs its shard of the model and
samples. Ranks 1..N-1 are worker processes (``torch.multiprocessing``, spawn) started by
:class:`TensorParallelRunner`; each joins the process group, builds its shard with the
same model factory, and then repeats what rank 0 does: for every
:meth:`TensorParallelRunner.run` rank 0 pickles the step (the scheduled sequences, reduced
to what the model runner reads: the pending token ids -- the tokens rank 0 sampled last
step --, positions, block tables, state slots) once and writes it to each worker's pipe,
then runs its own shard. Each rank's :class:`~onecat.runtime.engine.model_runner.ModelRunner`
builds the same batch, captures the same CUDA graphs and joins the same all-reduces and
the all-gather of the logits (``lm_head`` is split over the vocabulary: every rank computes
its slice and receives the full logits); the collectives keep the ranks in step. The
workers' logits are dropped, so whatever computes logits on rank 0 must run on every rank
(:meth:`TensorParallelRunner.hidden_logits`).

Messages are ``(method, args)`` tuples: ``("run", (scheduled,))``, ``("call", (fn, *args))``
(:meth:`TensorParallelRunner.call_all`), ``("exit", ())``. A worker that fails
while loading sends its traceback back and rank 0 raises it as an OnecatError.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from onecat.errors import OnecatError
from onecat.runtime.config import EngineConfig
from onecat.runtime.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from onecat.runtime.engine.model_runner import ModelRunner
from onecat.runtime.engine.sequence import Sequence

logger = logging.getLogger(__name__)

ModelFactory = Callable[[torch.device, torch.dtype], Any]
"""Builds this rank's model shard on a device (called in every rank after the group is up)."""
STARTUP_TIMEOUT_S = 1800.0


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` on GPUs, the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


class TokenWindow:
    """The token ids of one sequence from position ``start`` on, indexed by position."""

    __slots__ = ("start", "ids")

    def __init__(self, start: int, ids: list[int]) -> None:
        self.start, self.ids = start, ids

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self.ids[index.start - self.start : index.stop - self.start]
        return self.ids[index - self.start]


class ShippedSequence:
    """What a worker's model runner reads of a scheduled :class:`Sequence`."""

    __slots__ = ("num_computed_tokens", "num_tokens", "token_ids", "block_table", "state_slot", "fresh_slot",
                 "restore_from", "saves")

    def __init__(self, seq: Sequence, count: int, start: int | None = None) -> None:
        """The chunk of ``count`` tokens from ``start`` (default: the first not computed),
        drafts included."""
        start = seq.num_computed_tokens if start is None else start
        self.num_computed_tokens, self.num_tokens = seq.num_computed_tokens, seq.num_tokens
        self.token_ids = TokenWindow(start, seq.chunk_token_ids(start, count))
        self.block_table, self.state_slot, self.fresh_slot = seq.block_table, seq.state_slot, seq.fresh_slot
        self.restore_from, self.saves = seq.restore_from, seq.saves  # GDN state checkpoint rows

    def chunk_token_ids(self, start: int, count: int) -> list[int]:
        """The shipped chunk's token ids (``Sequence.chunk_token_ids``)."""
        offset = start - self.token_ids.start
        return self.token_ids.ids[offset : offset + count]

    def __getstate__(self) -> tuple:
        window = self.token_ids
        return (self.num_computed_tokens, self.num_tokens, window.start, window.ids,
                self.block_table, self.state_slot, self.fresh_slot, self.restore_from, self.saves)

    def __setstate__(self, state: tuple) -> None:
        (self.num_computed_tokens, self.num_tokens, start, ids,
         self.block_table, self.state_slot, self.fresh_slot, self.restore_from, self.saves) = state
        self.token_ids = TokenWindow(start, ids)


def _worker_main(
    rank: int,
    world_size: int,
    init_method: str,
    config: EngineConfig,
    factory: ModelFactory,
    device_type: str,
    dtype: torch.dtype,
    calls: Any,
    replies: Any,
) -> None:
    """A worker rank: join the group, build the shard, then run what rank 0 sends."""
    replies.send(("started", None))  # rank 0 joins the group only once every worker is up
    device = rank_device(torch.device(device_type), rank)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        init_tensor_parallel(rank, world_size, init_method, device,
                             custom_all_reduce=not config.disable_custom_all_reduce)
        model = factory(device, dtype)
    except BaseException as exc:  # report, not hang: rank 0 is waiting for this reply
        replies.send(("error", f"rank {rank}: {exc}\n{traceback.format_exc()}"))
        os._exit(1)
    replies.send(("loaded", None))
    try:
        runner = ModelRunner(config, model)
        while True:
            method, args = pickle.loads(calls.recv_bytes())
            if method == "exit":
                break
            if method == "call":
                args[0](runner, *args[1:])
            else:
                getattr(runner, method)(*args)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)  # no process-group teardown: NCCL teardown after graph capture can hang


class TensorParallelRunner:
    """Rank 0's model runner of a tensor-parallel engine (same interface as ModelRunner:
    ``run``, ``num_blocks``, ``num_slots``, ``max_model_len``, ``model_config``, ...)."""

    def __init__(self, config: EngineConfig, factory: ModelFactory, device: torch.device, dtype: torch.dtype) -> None:
        world = config.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise OnecatError(
                f"--tensor-parallel-size {world} needs {world} GPUs; torch sees "
                f"{torch.cuda.device_count()} (check CUDA_VISIBLE_DEVICES)"
            )
        self._rendezvous = Path(tempfile.mkdtemp(prefix="onecat-tp-"))
        init_method = f"file://{self._rendezvous / 'store'}"
        ctx = mp.get_context("spawn")
        self._calls, self._replies, self._workers = [], [], []
        self._closed = False
        for rank in range(1, world):
            call_recv, call_send = ctx.Pipe(duplex=False)
            reply_recv, reply_send = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=_worker_main,
                args=(rank, world, init_method, config, factory, device.type, dtype, call_recv, reply_send),
                name=f"onecat-tp-rank{rank}",
            )
            process.start()
            self._calls.append(call_send)
            self._replies.append(reply_recv)
            self._workers.append(process)
        atexit.register(self.close)
        try:
            # a worker that dies before it joins the group (a spawn that cannot import the
            # factory's module, say) would leave rank 0 waiting in the rendezvous: wait for
            # every worker's first message, watching the processes, before joining
            self._wait_for("started", "starting")
            init_tensor_parallel(0, world, init_method, rank_device(device, 0),
                                 custom_all_reduce=not config.disable_custom_all_reduce)
            model = factory(rank_device(device, 0), dtype)
            self._wait_for("loaded", "loading")
            self.local = ModelRunner(config, model)
        except BaseException:
            self.close()
            raise

    def _wait_for(self, expected: str, doing: str) -> None:
        """Receive ``expected`` from every worker, raising if one fails, exits or times out."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, (reply, process) in enumerate(zip(self._replies, self._workers, strict=True), start=1):
            while not reply.poll(0.1):
                if not process.is_alive():
                    raise OnecatError(
                        f"tensor-parallel worker rank {rank} exited (code {process.exitcode}) while "
                        f"{doing}; its traceback is above in this process's stderr"
                    )
                if time.monotonic() > deadline:
                    raise OnecatError(f"tensor-parallel worker rank {rank} did not finish {doing} in "
                                      f"{STARTUP_TIMEOUT_S:.0f} s")
            status, message = reply.recv()
            if status == "error":
                raise OnecatError(f"tensor-parallel worker failed while {doing} the model: {message}")
            assert status == expected, (status, expected)

    def _send(self, method: str, *args: Any) -> None:
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._calls:
            conn.send_bytes(payload)

    def run(
        self, scheduled: list[tuple[Sequence, int]], input_tokens: torch.Tensor | None = None
    ) -> tuple[list[Sequence], torch.Tensor]:
        """Ship the step to the workers, run rank 0's shard; returns what ModelRunner.run does.

        ``input_tokens`` (the engine's overlapped decode steps): the entries' input tokens as a
        tensor on rank 0's device, still being sampled by the step in flight. The host has
        not seen them, so they are not in the shipped step: rank 0 broadcasts them on the
        device (one collective queued before this step's pass on every rank) and every rank
        runs with them."""
        shipped = [(ShippedSequence(seq, count), count) for seq, count in scheduled]
        if input_tokens is None:
            self._send("run", shipped)
            return self.local.run(scheduled)
        self._send("call", _run_with_rank0_tokens, shipped)
        input_tokens = input_tokens.to(torch.int64).contiguous()
        dist.broadcast(input_tokens, src=0)
        return self.local.run(scheduled, input_tokens)

    def run_hidden(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """Speculative decoding: ``ModelRunner.run_hidden`` on every rank (rank 0's result)."""
        self._send("run_hidden", [(ShippedSequence(seq, count), count) for seq, count in scheduled])
        return self.local.run_hidden(scheduled)

    def hidden_logits(self, rows: list[int]) -> torch.Tensor:
        """``ModelRunner.hidden_logits`` on every rank (each computes its slice of the
        vocabulary; the all-gather pairs them up); rank 0's result."""
        self._send("hidden_logits", rows)
        return self.local.hidden_logits(rows)

    def accept_drafts(self, accepted: list[tuple[Sequence, int]]) -> None:
        """``ModelRunner.accept_drafts`` on every rank (each holds its shard of the states)."""
        self._send("accept_drafts", [(ShippedSequence(seq, 0), kept) for seq, kept in accepted])
        self.local.accept_drafts(accepted)

    def propose(self, items: list[tuple[Sequence, int, torch.Tensor, bool]], num_drafts: int) -> list[list[int]]:
        """``ModelRunner.propose`` on every rank (the MTP head's layer is split too): workers
        read the hidden states of their own last ``run_hidden``, at the same rows."""
        base = self.local.last_hidden
        shipped = []
        for seq, start, hidden, draft in items:  # views of rank 0's last hidden states: their first row
            first = (hidden.storage_offset() - base.storage_offset()) // base.stride(0)
            shipped.append((ShippedSequence(seq, hidden.shape[0] + 1, start), start, first, hidden.shape[0], draft))
        self._send("call", _propose_on_worker, shipped, num_drafts)
        return self.local.propose(items, num_drafts)

    def warmup(self) -> None:
        """Capture the decode graphs on every rank at once (their collectives pair up)."""
        self.call_all(_warm_up)

    def call_all(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(runner, *args)`` on every rank with that rank's ModelRunner (``fn`` must
        be picklable: a module-level function); returns rank 0's result. For benchmarks and
        diagnostics, e.g. to profile or re-capture graphs on all ranks at once."""
        self._send("call", fn, *args)
        return fn(self.local, *args)

    def __getattr__(self, name: str) -> Any:
        if name == "local":  # not built (yet)
            raise AttributeError(name)
        return getattr(self.local, name)

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for conn in self._calls:
            try:
                conn.send_bytes(pickle.dumps(("exit", ())))
            except OSError:
                pass
        for process in self._workers:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
        if "local" in self.__dict__:
            self.local.release_graphs()  # else tearing NCCL down hangs (pytorch#115388)
        destroy_tensor_parallel()
        shutil.rmtree(self._rendezvous, ignore_errors=True)


def _run_with_rank0_tokens(runner: ModelRunner, shipped: list[tuple[ShippedSequence, int]]) -> None:
    """A worker's side of an overlapped step (:meth:`TensorParallelRunner.run` with input
    tokens): receive the tokens rank 0 broadcasts on the device, then run the step with them."""
    tokens = torch.empty(len(shipped), dtype=torch.int64, device=runner.device)
    dist.broadcast(tokens, src=0)
    runner.run(shipped, tokens)


def _propose_on_worker(runner: ModelRunner, shipped: list[tuple], num_drafts: int) -> None:
    """A worker's side of :meth:`TensorParallelRunner.propose`."""
    hidden = runner.last_hidden
    items = [(seq, start, hidden[first : first + rows], draft) for seq, start, first, rows, draft in shipped]
    runner.propose(items, num_drafts)


def _warm_up(runner: ModelRunner) -> None:
    runner.warmup()


def create_runner(
    config: EngineConfig, factory: ModelFactory, device: torch.device, dtype: torch.dtype
) -> ModelRunner | TensorParallelRunner:
    """A ModelRunner over ``factory(device, dtype)``, or, for ``tensor_parallel_size`` > 1,
    a :class:`TensorParallelRunner` that starts the worker ranks."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, factory(device, dtype))
    return TensorParallelRunner(config, factory, device, dtype)
