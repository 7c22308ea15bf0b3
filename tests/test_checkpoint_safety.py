"""Fault tests of the formats layer: file references that leave the checkpoint, and outputs
that overlap their source.

Every file a checkpoint names (a packed artifact's manifest entries, an index's weight_map,
shards found by glob, side files) must resolve inside the checkpoint directory; every tool
that reads checkpoints (pack, the runtime loader behind generate/serve, eval, quantize and
the vLLM plugin's header scan) refuses one that does not, naming the file and the entry.
quantize / pack / unpack refuse an output that is, lies inside or contains the source,
with or without --overwrite, before touching anything; --overwrite (and build-kernels)
replaces only a directory that holds nothing but what onecat wrote there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from onecat.cli import main
from onecat.errors import OnecatError
from onecat.formats.checkpoint import Checkpoint
from onecat.formats.staging import OUTPUT_MARKER
from onecat.pack.artifact import open_packed
from onecat.pack.unpack import unpack_artifact
from onecat.pack.writer import MANIFEST_NAME, pack_checkpoint
from onecat.quantize.evaluate import load_eval_model
from onecat.quantize.pipeline import quantize_rtn
from onecat.runtime.loader import load_model
from onecat.tiny import build_tiny_model
from onecat.vllm_plugin.quantized_modules import checkpoint_tensor_names

pytestmark = pytest.mark.usefixtures("one_thread")

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """A tiny fp Qwen3.5, its RTN AutoAWQ checkpoint and the packed artifact of that."""
    root = tmp_path_factory.mktemp("safety")
    fp = build_tiny_model("qwen3_5", root / "fp", num_layers=2, max_shard_size="200KB")
    awq = quantize_rtn(fp, root / "awq", group_size=32, show_progress=False)
    packed = pack_checkpoint(awq, root / "packed", show_progress=False)
    return {"fp": fp, "awq": awq, "packed": packed}


@pytest.fixture
def work(built, tmp_path) -> dict[str, Path]:
    """Private copies each test may damage, in ``tmp_path/ckpt``; ``tmp_path/outside`` holds
    files that are not part of any checkpoint."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "outside").mkdir()
    return {k: Path(shutil.copytree(v, tmp_path / "ckpt" / k)) for k, v in built.items()}


def digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (relative names)."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def move_out(ckpt: Path, shard: str, outside: Path) -> Path:
    """Move ``shard`` of ``ckpt`` into ``outside`` (its content unchanged); returns the new path."""
    target = outside / shard
    shutil.move(ckpt / shard, target)
    return target


# --- packed artifact: manifest entries --------------------------------------------------------


def redirect_manifest(artifact: Path, make_ref) -> tuple[str, str]:
    """Point every manifest entry of one shard at ``make_ref(shard)``; returns (shard, ref)."""
    path = artifact / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    shard = sorted({e["file"] for e in manifest["tensors"].values()})[0]
    ref = make_ref(shard)
    for entry in manifest["tensors"].values():
        if entry["file"] == shard:
            entry["file"] = ref
    path.write_text(json.dumps(manifest))
    return shard, ref


@pytest.mark.parametrize("kind", ["dotdot", "absolute"])
def test_manifest_entry_outside_the_artifact_is_refused(work, tmp_path, kind):
    artifact = work["packed"]
    outside = tmp_path / "outside"
    if kind == "dotdot":
        shard, ref = redirect_manifest(artifact, lambda s: f"../../outside/{s}")
        expected = "climbs out with '..'"
    else:
        shard, ref = redirect_manifest(artifact, lambda s: str(outside / s))
        expected = "absolute path"
    move_out(artifact, shard, outside)  # a complete, valid shard: only its place is wrong
    for reader in (open_packed, lambda p: load_model(p, torch.device("cpu"), torch.float32)):
        with pytest.raises(OnecatError) as err:
            reader(artifact)
        message = str(err.value)
        assert expected in message and MANIFEST_NAME in message, message
        assert "tensors['" in message and ref in message, message  # names the entry
        assert "re-create the checkpoint" in message, message  # and the fix
    result = CliRunner().invoke(main, ["generate", str(artifact), "--prompt", "hi", "--max-tokens",
                                       "1", "--device", "cpu"])
    assert result.exit_code == 1 and expected in result.output, result.output


def test_manifest_shard_symlinked_outside_is_refused(work, tmp_path):
    artifact = work["packed"]
    manifest = json.loads((artifact / MANIFEST_NAME).read_text())
    shard = sorted({e["file"] for e in manifest["tensors"].values()})[0]
    target = move_out(artifact, shard, tmp_path / "outside")
    os.symlink(target, artifact / shard)
    with pytest.raises(OnecatError, match=r"symlink that leads outside .*re-create the checkpoint"):
        open_packed(artifact)
    with pytest.raises(OnecatError, match="symlink that leads outside"):
        load_model(artifact, torch.device("cpu"), torch.float32)


def test_symlinks_inside_the_artifact_are_fine(work):
    artifact = work["packed"]
    manifest = json.loads((artifact / MANIFEST_NAME).read_text())
    shard = sorted({e["file"] for e in manifest["tensors"].values()})[0]
    (artifact / "blobs").mkdir()
    shutil.move(artifact / shard, artifact / "blobs" / shard)
    os.symlink(Path("blobs") / shard, artifact / shard)
    open_packed(artifact).verify()


# --- safetensors checkpoints: index.json weight_map, globbed shards, side files --------------


def escape_index(ckpt: Path, outside: Path, kind: str) -> None:
    """Move one shard of ``ckpt`` into ``outside`` and make the index reach it there: through
    a ``..`` path, an absolute path or a symlink left in the shard's place."""
    index = json.loads((ckpt / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    target = move_out(ckpt, shard, outside)
    if kind == "symlink":
        os.symlink(target, ckpt / shard)
        return
    ref = str(target) if kind == "absolute" else f"../../outside/{ckpt.name}/{shard}"
    index["weight_map"] = {k: (ref if v == shard else v) for k, v in index["weight_map"].items()}
    (ckpt / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_index_weight_map_escaping_is_refused_by_every_reader(work, tmp_path, kind):
    expected = {"dotdot": "climbs out with '..'", "absolute": "absolute path",
                "symlink": "symlink that leads outside"}[kind]
    for name in ("awq", "fp"):
        (tmp_path / "outside" / name).mkdir()
        escape_index(work[name], tmp_path / "outside" / name, kind)
        with pytest.raises(OnecatError) as err:
            Checkpoint(work[name])
        message = str(err.value)
        assert expected in message and INDEX in message and "weight_map['" in message, message
    awq, fp = work["awq"], work["fp"]
    readers = {
        "pack": lambda: pack_checkpoint(awq, tmp_path / "packed", show_progress=False),
        "loader (generate/serve)": lambda: load_model(awq, torch.device("cpu"), torch.float32),
        "eval": lambda: load_eval_model(awq),
        "eval fp": lambda: load_eval_model(fp),
        "quantize": lambda: quantize_rtn(fp, tmp_path / "q", group_size=32, show_progress=False),
        "vllm plugin": lambda: checkpoint_tensor_names(awq),
    }
    for what, read in readers.items():
        with pytest.raises(OnecatError, match=expected):
            read()
        assert not (tmp_path / "packed").exists() and not (tmp_path / "q").exists(), what
    code, output = run("pack", str(awq), "--out", str(tmp_path / "p2"))
    assert code == 1 and expected in output, output


def test_globbed_shard_symlinked_outside_is_refused(work, tmp_path):
    ckpt = work["fp"]
    (ckpt / INDEX).unlink()  # no index: the shards are found by glob
    shard = sorted(p.name for p in ckpt.glob("*.safetensors"))[0]
    os.symlink(move_out(ckpt, shard, tmp_path / "outside"), ckpt / shard)
    with pytest.raises(OnecatError, match=rf"shard {shard!r} is a symlink that leads outside"):
        Checkpoint(ckpt)


def test_side_file_symlinked_outside_is_not_copied(work, tmp_path):
    secret = tmp_path / "outside" / "secret.txt"
    secret.write_text("not part of the model")
    os.symlink(secret, work["awq"] / "notes.txt")
    with pytest.raises(OnecatError, match="side file 'notes.txt' is a symlink that leads outside"):
        pack_checkpoint(work["awq"], tmp_path / "packed", show_progress=False)
    assert not (tmp_path / "packed").exists()


def test_config_json_symlinked_outside_is_refused(work, tmp_path):
    config = work["awq"] / "config.json"
    target = tmp_path / "outside" / "config.json"
    shutil.move(config, target)
    os.symlink(target, config)
    with pytest.raises(OnecatError, match="'config.json' is a symlink that leads outside"):
        pack_checkpoint(work["awq"], tmp_path / "packed", show_progress=False)
    with pytest.raises(OnecatError, match="symlink that leads outside"):
        load_model(work["awq"], torch.device("cpu"), torch.float32)


def test_hub_cache_snapshot_symlinks_are_followed(built, tmp_path):
    """A Hugging Face cache snapshot links its files into the repository's blobs/."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for item in built["awq"].iterdir():
        blob = repo / "blobs" / hashlib.sha256(item.name.encode()).hexdigest()
        shutil.copy(item, blob)
        os.symlink(Path("../../blobs") / blob.name, snapshot / item.name)
    assert Checkpoint(snapshot).names() == Checkpoint(built["awq"]).names()
    pack_checkpoint(snapshot, tmp_path / "packed", show_progress=False)
    open_packed(tmp_path / "packed").verify()


# --- outputs that overlap their source -------------------------------------------------------


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def quantize_args(src: Path, out: Path, *extra: str) -> list[str]:
    return ["quantize", str(src), "--out", str(out), "--rtn", "--group-size", "32", *extra]


@pytest.mark.parametrize("overwrite", [False, True])
def test_quantize_refuses_outputs_overlapping_the_source(work, tmp_path, overwrite):
    src = work["fp"]
    (tmp_path / "ckpt" / "unrelated.txt").write_text("mine")
    before, parent_before = digest(src), digest(tmp_path / "ckpt")
    flag = ["--overwrite"] if overwrite else []
    for out in (src, src / "sub", src / "sub" / "deeper", tmp_path / "ckpt", tmp_path):
        code, output = run(*quantize_args(src, out, *flag))
        assert code == 1, (out, output)
        assert "must not be, lie inside or contain the source" in output, output
        assert digest(src) == before and digest(tmp_path / "ckpt") == parent_before
        assert not (src / "sub").exists()
        assert not out.with_name(out.name + ".partial").exists()


def test_quantize_refuses_a_work_directory_that_is_the_source(built, tmp_path):
    src = Path(shutil.copytree(built["fp"], tmp_path / "model.partial"))
    before = digest(src)
    code, output = run(*quantize_args(src, tmp_path / "model", "--overwrite"))
    assert code == 1 and "the work directory" in output and "source" in output, output
    assert digest(src) == before


def test_quantize_refuses_a_symlinked_output_into_the_source(work, tmp_path):
    src = work["fp"]
    before = digest(src)
    os.symlink(src, tmp_path / "link")
    code, output = run(*quantize_args(src, tmp_path / "link", "--overwrite"))
    assert code == 1 and "must not be, lie inside or contain the source" in output, output
    assert digest(src) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_pack_refuses_outputs_overlapping_the_source(work, tmp_path, overwrite):
    src = work["awq"]
    (tmp_path / "ckpt" / "unrelated.txt").write_text("mine")
    before, parent_before = digest(src), digest(tmp_path / "ckpt")
    flag = ["--overwrite"] if overwrite else []
    for out in (tmp_path / "ckpt", tmp_path, src, src / "inside"):
        code, output = run("pack", str(src), "--out", str(out), *flag)
        assert code == 1, (out, output)
        assert "must not be, lie inside or contain the source" in output, output
        assert digest(src) == before and digest(tmp_path / "ckpt") == parent_before
        assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_unpack_refuses_outputs_overlapping_the_artifact(work, tmp_path):
    artifact = work["packed"]
    before = digest(tmp_path / "ckpt")
    for out in (tmp_path / "ckpt", artifact, artifact / "awq"):
        with pytest.raises(OnecatError, match="must not be, lie inside or contain the source"):
            unpack_artifact(artifact, out, overwrite=True)
        assert digest(tmp_path / "ckpt") == before


# --- --overwrite deletes only what onecat wrote (issue 40, item 5) ------------------------------


def add_foreign_files(out: Path) -> None:
    """What a careless user keeps in an output directory: notes and another artifact."""
    (out / "keep").mkdir()
    (out / "keep" / "notes.txt").write_text("mine")
    (out / "other-artifact.safetensors").write_bytes(b"not onecat's")


def assert_refused_naming_a_foreign_file(code: int, output: str, out: Path, before: dict) -> None:
    assert code == 1, output
    assert "was not written by onecat" in output and "Nothing was changed" in output, output
    assert str(out / "keep" / "notes.txt") in output or str(out / "other-artifact.safetensors") in output, output
    assert digest(out) == before
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name or
                p.name.endswith(".partial")]


def test_quantize_overwrite_replaces_its_own_output_and_nothing_else(built, tmp_path):
    out = tmp_path / "awq"
    assert run(*quantize_args(built["fp"], out))[0] == 0
    marker = json.loads((out / OUTPUT_MARKER).read_text())
    assert marker["command"] == "onecat quantize" and marker["files"] == sorted(
        p.name for p in out.iterdir() if p.name != OUTPUT_MARKER)
    code, output = run(*quantize_args(built["fp"], out, "--overwrite"))
    assert code == 0, output
    add_foreign_files(out)
    before = digest(out)
    code, output = run(*quantize_args(built["fp"], out, "--overwrite"))
    assert_refused_naming_a_foreign_file(code, output, out, before)


def test_pack_overwrite_replaces_its_own_output_and_nothing_else(built, tmp_path):
    out = tmp_path / "packed"
    assert run("pack", str(built["awq"]), "--out", str(out), "--no-progress")[0] == 0
    assert OUTPUT_MARKER not in open_packed(out).manifest["copied_files"]  # the source's is not copied
    code, output = run("pack", str(built["awq"]), "--out", str(out), "--overwrite", "--no-progress")
    assert code == 0, output
    open_packed(out).verify()
    add_foreign_files(out)
    before = digest(out)
    code, output = run("pack", str(built["awq"]), "--out", str(out), "--overwrite", "--no-progress")
    assert_refused_naming_a_foreign_file(code, output, out, before)


def test_unpack_overwrite_refuses_foreign_files(built, tmp_path):
    out = unpack_artifact(built["packed"], tmp_path / "awq")
    unpack_artifact(built["packed"], out, overwrite=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OnecatError, match="notes.txt was not written by onecat"):
        unpack_artifact(built["packed"], out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("command", ["quantize", "pack"])
def test_overwrite_refuses_a_directory_without_the_marker(built, tmp_path, command):
    """A directory onecat did not write, or an artifact of an onecat older than the marker: no
    --overwrite can know what in it is onecat's, so it is refused."""
    out = Path(shutil.copytree(built["awq" if command == "quantize" else "packed"], tmp_path / "out"))
    (out / OUTPUT_MARKER).unlink()
    before = digest(out)
    args = quantize_args(built["fp"], out) if command == "quantize" else ["pack", str(built["awq"]), "--out", str(out)]
    code, output = run(*args, "--overwrite")
    assert code == 1 and f"no onecat output marker {OUTPUT_MARKER}" in output, output
    assert str(out / sorted(before)[0]) in output, output
    assert digest(out) == before


def test_quantize_overwrite_of_an_interrupted_run(built, tmp_path):
    """OUT.partial has no marker yet: --overwrite removes it when it holds only what the
    pipeline writes there, and refuses it when it holds anything else."""
    out = tmp_path / "awq"
    partial = tmp_path / "awq.partial"
    partial.mkdir()
    (partial / "progress.json").write_text(json.dumps({"fingerprint": {}, "layers": {}}))
    (partial / "model-00002-of-00003.safetensors").write_bytes(b"x")
    (partial / "notes.txt").write_text("mine")
    before = digest(partial)
    code, output = run(*quantize_args(built["fp"], out, "--overwrite"))
    assert code == 1 and f"{partial / 'notes.txt'} was not written by onecat" in output, output
    assert digest(partial) == before and not out.exists()
    (partial / "notes.txt").unlink()
    code, output = run(*quantize_args(built["fp"], out, "--overwrite"))
    assert code == 0, output
    assert not partial.exists() and (out / OUTPUT_MARKER).is_file()


def test_build_kernels_replaces_only_a_kernel_directory(tmp_path):
    from onecat.kernels.build import MANIFEST, check_kernel_dir

    out = tmp_path / "kernels"
    check_kernel_dir(out)
    out.mkdir()
    check_kernel_dir(out)
    (out / MANIFEST).write_text("{}")
    (out / "w4a16_gemv.sm_70.cubin").write_bytes(b"x")
    (out / "w4a16_gemv.compute_70.ptx").write_bytes(b"x")
    check_kernel_dir(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OnecatError, match="notes.txt was not written by onecat build-kernels"):
        check_kernel_dir(out)
    (out / MANIFEST).unlink()
    with pytest.raises(OnecatError, match=f"has no {MANIFEST}"):
        check_kernel_dir(out)


def test_generation_config_symlink_out_of_the_checkpoint_is_refused(tmp_path):
    """The engine reads generation_config.json's eos ids only from inside the checkpoint."""
    from onecat.errors import OnecatError
    from onecat.runtime.engine.llm_engine import _generation_eos
    from onecat.tiny import build_tiny_model

    model = build_tiny_model("qwen3_5", tmp_path / "model")
    outside = tmp_path / "elsewhere.json"
    outside.write_text('{"eos_token_id": 7}')
    (model / "generation_config.json").unlink(missing_ok=True)
    (model / "generation_config.json").symlink_to(outside)
    with pytest.raises(OnecatError, match="outside"):
        _generation_eos(model)
