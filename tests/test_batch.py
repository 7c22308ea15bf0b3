"""`onecat batch` (onecat.runtime.server.batch): OpenAI Batch lines through the server's app on
the trained tiny Qwen3.5 on CPU: answers, error lines, --resume, the partial last line a kill
leaves, and the refusals."""

from __future__ import annotations

import json
import os
from io import StringIO

import pytest
from click.testing import CliRunner
from rich.console import Console
from server_helpers import LaunchStopped, capture_launches

from onecat.cli import main
from onecat.errors import OnecatError
from onecat.runtime.sampling_params import SamplingParams
from onecat.runtime.server import batch as batch_module
from onecat.runtime.server.batch import prepare_batch
from onecat.runtime.server.batch_lines import parse_line
from onecat.runtime.server.batch_output import open_output
from onecat.tiny_train import fixture_dir

pytest.importorskip("fastapi")
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

MODEL = "tiny"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def request(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def chat(custom_id, text="Hello, who are you?", **fields) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 6,
            "temperature": 0, **fields}
    return request(custom_id, CHAT, body)


def completion(custom_id, prompt="The list", **fields) -> str:
    return request(custom_id, COMPLETIONS, {"prompt": prompt, "max_tokens": 6, "temperature": 0, **fields})


def read_output(path) -> list[dict]:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), "the output must end with a whole line"
    return [json.loads(line) for line in data.decode().splitlines()]


def by_id(records: list[dict]) -> dict:
    ids = [r["custom_id"] for r in records]
    assert len(ids) == len(set(ids)), f"a custom_id is answered twice: {ids}"
    return {r["custom_id"]: r for r in records}


@pytest.fixture(scope="module")
def engine():
    from onecat.runtime.config import EngineConfig
    from onecat.runtime.engine import LLMEngine

    llm = LLMEngine(EngineConfig(model=str(fixture_dir("qwen3_5")), device="cpu", max_model_len=256,
                                 served_model_name=MODEL, max_num_seqs=8))
    yield llm
    llm.close()


def run(engine, lines: list[str], tmp_path, *, resume=False, name="out.jsonl", **options):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(line + "\n" for line in lines))
    job = prepare_batch(source, tmp_path / name, resume=resume)
    summary = job.run(engine, show_progress=False, **options)
    return summary, read_output(tmp_path / name)


# ----- input lines (no engine) ---------------------------------------------------------------


@pytest.mark.parametrize(("raw", "code", "custom_id"), [
    (b"{not json", "invalid_json", None),
    (b'{"custom_id": "a", "body": "\xff"}', "invalid_json", None),
    (b"[1, 2]", "invalid_request", None),
    (request(None, CHAT, {}).encode(), "missing_custom_id", None),
    (request(7, CHAT, {}).encode(), "missing_custom_id", None),
    (request("a", CHAT, {}, method="GET").encode(), "invalid_method", "a"),
    (request("a", "/v1/embeddings", {}).encode(), "invalid_url", "a"),
    (request("a", CHAT, ["x"]).encode(), "invalid_request", "a"),
    (request("a", CHAT, {"messages": [], "stream": True}).encode(), "stream_not_supported", "a"),
])
def test_refused_lines(raw, code, custom_id):
    line = parse_line(3, raw, set())
    assert line.error is not None and line.error.code == code, line
    assert line.custom_id == custom_id and line.number == 3


def test_a_repeated_custom_id_is_refused_and_the_first_line_runs():
    seen: set[str] = set()
    first = parse_line(1, request("a", "/v1/bad", {}).encode(), seen)
    second = parse_line(2, completion("a").encode(), seen)
    assert first.error.code == "invalid_url"  # the id is taken even by a refused line
    assert second.error.code == "duplicate_custom_id" and second.custom_id == "a"
    ok = parse_line(3, completion("b", stream=False).encode(), seen)
    assert ok.error is None and ok.url == COMPLETIONS and ok.body["prompt"] == "The list"


# ----- the output file (no engine) -----------------------------------------------------------


def test_an_existing_output_is_refused_without_resume(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "a", "response": {"status_code": 200}, "error": null}\n')
    with pytest.raises(OnecatError, match="--resume") as info:
        open_output(out, resume=False)
    assert str(out) in str(info.value)
    assert out.read_text().count("\n") == 1  # untouched
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    open_output(empty, resume=False)[0].close()  # an empty file is fine


def test_the_cli_refuses_an_existing_output_before_loading_the_model(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(completion("a") + "\n")
    out.write_text("something\n")
    result = CliRunner().invoke(main, ["batch", str(source), "-o", str(out), str(tmp_path)])
    assert result.exit_code == 1
    assert str(out) in result.output and "--resume" in result.output and "another -o" in result.output
    assert out.read_text() == "something\n"


def test_resume_refuses_a_file_it_did_not_write(tmp_path):
    out = tmp_path / "notes.jsonl"
    out.write_text('{"custom_id": "a", "response": null, "error": null}\n{"x": 1}\n')
    with pytest.raises(OnecatError, match=r"notes.jsonl:1 is not an onecat batch output line"):
        open_output(out, resume=True)


def test_a_second_job_on_the_same_output_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    first, _ = open_output(out, resume=False)
    try:
        with pytest.raises(OnecatError, match="another onecat batch is writing"):
            open_output(out, resume=True)
    finally:
        first.close()


def test_resume_cuts_off_a_partial_last_line(tmp_path):
    whole = b'{"id":"batch_req_1","custom_id":"a","response":{"status_code":200,"body":{}},"error":null}\n'
    out = tmp_path / "out.jsonl"
    out.write_bytes(whole + b'{"id":"batch_req_2","custom_id":"b","respon')
    output, done = open_output(out, resume=True)
    output.append(b'{"custom_id":"b"}\n')
    output.close()
    assert done.custom_ids == {"a"} and done.lines == 1
    assert out.read_bytes() == whole + b'{"custom_id":"b"}\n'


# ----- runs on the trained tiny model --------------------------------------------------------


def test_a_batch_answers_every_line_once(engine, tmp_path):
    lines = [
        chat("chat-1"),
        completion("cmpl-1"),
        "{this is not json",
        completion("cmpl-1", prompt="again"),  # duplicate id
        request("emb-1", "/v1/embeddings", {"input": "x"}),
        completion("stream-1", stream=True),
        completion("hot-1", temperature=-1),  # the server's validation: 400
        json.dumps({"method": "POST", "url": COMPLETIONS, "body": {"prompt": "x"}}),  # no custom_id
        "",
        chat("wrong-model", model="another-model"),
        completion("cmpl-2", prompt="A class"),
    ]
    summary, records = run(engine, lines, tmp_path, max_concurrency=4)
    assert len(records) == 10 == summary.written == summary.lines  # the blank line is no request
    assert summary.ok == 3 and summary.failed == 7 and summary.stopped is None
    for record in records:
        assert record["id"].startswith("batch_req_") and set(record) == {"id", "custom_id", "response", "error"}
    answered = by_id([r for r in records if r["response"] is not None])
    refused = [r for r in records if r["response"] is None]
    assert {r["error"]["line"]: r["error"]["code"] for r in refused} == {
        3: "invalid_json", 4: "duplicate_custom_id", 5: "invalid_url", 6: "stream_not_supported",
        8: "missing_custom_id",
    }
    assert all(r["error"]["message"] for r in refused)
    ok = answered["chat-1"]["response"]
    assert ok["status_code"] == 200 and ok["request_id"] == ok["body"]["id"]
    assert ok["body"]["object"] == "chat.completion" and ok["body"]["choices"][0]["message"]["content"]
    assert answered["cmpl-1"]["response"]["body"]["choices"][0]["text"]
    hot = answered["hot-1"]["response"]
    assert hot["status_code"] == 400 and hot["body"]["error"]["param"] == "temperature"
    assert answered["wrong-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    usage = [answered[i]["response"]["body"]["usage"] for i in ("chat-1", "cmpl-1", "cmpl-2")]
    assert summary.completion_tokens == sum(u["completion_tokens"] for u in usage) > 0
    assert summary.prompt_tokens == sum(u["prompt_tokens"] for u in usage)
    # the same answer as the engine gives the same greedy request
    expected = engine.generate(["A class"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert answered["cmpl-2"]["response"]["body"]["choices"][0]["text"] == expected


def test_resume_runs_only_what_is_missing(engine, tmp_path):
    lines = [completion(f"r{i}", prompt=f"Item {i} is") for i in range(6)]
    lines += ["not json", completion("r0", prompt="dup"), chat("c0")]
    summary, first = run(engine, lines[:3], tmp_path, max_concurrency=3)
    assert summary.ok == 3 and {r["custom_id"] for r in first} == {"r0", "r1", "r2"}
    summary, records = run(engine, lines, tmp_path, resume=True, max_concurrency=3)
    assert summary.skipped == 3 and summary.written == 6 and records[:3] == first  # appended only
    assert sorted(r["custom_id"] for r in records if r["error"] is None) == sorted(
        [f"r{i}" for i in range(6)] + ["c0"])
    assert sorted(r["error"]["code"] for r in records if r["error"]) == ["duplicate_custom_id", "invalid_json"]
    # everything is done: a third run writes nothing, also not the refused lines again
    summary, again = run(engine, lines, tmp_path, resume=True)
    assert summary.skipped == len(lines) and summary.written == 0 and again == records


def test_resume_after_a_kill_mid_write(engine, tmp_path):
    lines = [completion(f"k{i}", prompt=f"Number {i} and") for i in range(4)]
    run(engine, lines[:2], tmp_path)
    out = tmp_path / "out.jsonl"
    whole = out.read_bytes()
    kept, cut = whole.splitlines(keepends=True)
    out.write_bytes(kept + cut[:40])  # the second line's write cut short by a kill ...
    summary, records = run(engine, lines, tmp_path, resume=True)
    assert summary.skipped == 1 and summary.written == 3  # ... so its request runs again
    assert set(by_id(records)) == {"k0", "k1", "k2", "k3"}
    assert all(r["response"]["status_code"] == 200 for r in records)


def test_a_stopped_engine_ends_the_job_without_writing_its_lines(engine, tmp_path, monkeypatch):
    real = batch_module.post_json

    async def engine_stops_at_s2(app, path, body):
        if b'"s2 is"' in body:
            return 503, json.dumps({"error": {"message": "the engine stopped", "code": "engine_unavailable"}}).encode()
        return await real(app, path, body)

    monkeypatch.setattr(batch_module, "post_json", engine_stops_at_s2)
    lines = [completion(f"s{i}", prompt=f"s{i} is") for i in range(8)]
    summary, records = run(engine, lines, tmp_path, max_concurrency=1)
    assert summary.stopped == "the engine stopped"
    assert [r["custom_id"] for r in records] == ["s0", "s1"]  # s2 has no line: --resume runs it


def test_the_cli_runs_a_batch(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(chat("a", model=None) + "\n" + completion("b") + "\n")
    result = CliRunner().invoke(main, [
        "batch", str(source), "-o", str(out), str(fixture_dir("qwen3_5")), "--device", "cpu",
        "--max-model-len", "128", "--no-progress", "--max-concurrency", "2",
    ])
    assert result.exit_code == 0, result.output
    assert "Batch Result" in result.output and "wrote 2 lines" in result.output
    records = by_id(read_output(out))
    assert {k: r["response"]["status_code"] for k, r in records.items()} == {"a": 200, "b": 200}
    os.remove(out)


def test_the_cli_passes_the_engine_flags(tmp_path, monkeypatch):
    configs, _ = capture_launches(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(completion("a") + "\n")
    result = CliRunner().invoke(main, [
        "batch", str(source), "-o", str(out), str(tmp_path), "--device", "cpu", "--max-num-seqs", "3",
        "--served-model-name", "m", "--no-enable-prefix-caching",
    ])
    assert isinstance(result.exception, LaunchStopped)
    (config,) = configs
    assert (config.model, config.device, config.max_num_seqs) == (str(tmp_path), "cpu", 3)
    assert config.served_model_name == "m" and not config.enable_prefix_caching
    open_output(out, resume=False)[0].close()  # the job released its output (and lock)


def test_the_progress_bar_shows_lines_errors_and_tokens(engine, tmp_path):
    screen = StringIO()
    source = tmp_path / "in.jsonl"
    source.write_text(completion("a") + "\nnot json\n")
    job = prepare_batch(source, tmp_path / "out.jsonl")
    job.run(engine, console=Console(file=screen, width=120))
    shown = screen.getvalue()
    assert "2/2" in shown and "1 failed" in shown and "tok/s" in shown, shown


def test_a_failed_output_write_ends_the_job_with_its_error(engine, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(completion(f"w{i}", prompt=f"w{i} is") + "\n" for i in range(8)))
    job = prepare_batch(source, tmp_path / "out.jsonl")
    real, calls = job.output.append, []

    def full_disk(line: bytes) -> None:
        calls.append(line)
        if len(calls) > 2:
            raise OnecatError("disk full")
        real(line)

    job.output.append = full_disk
    with pytest.raises(OnecatError, match="disk full"):
        job.run(engine, show_progress=False, max_concurrency=2)
    assert len(calls) < 8  # no more lines were sent once a write failed
    assert len(read_output(tmp_path / "out.jsonl")) == 2
