"""Probes: a checkpoint someone else wrote is read confined (issue 50). A link in it, or a
stored path that is absolute or climbs out (DCP's ``relative_path``, a manifest's
names), is refused by ``tally export`` and by a resume with exit code 2 and one line
naming the file and the path, before any actor starts, and nothing it links to reaches
the export. Real checkpoints (DCP on one process), the real CLI."""

from __future__ import annotations

import json
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from rollout.adapters import write_peft_folder
from services.cli import app
from tests.trainer.test_checkpoint_metadata import sharded_checkpoint
from trainer.checkpoint import MANIFEST, SHARDS_DIR
from trainer.checkpoint_check import FOLDER_MANIFEST, _digest, escapes
from trainer.dcp_metadata import SafeFileSystemReader
from trainer.export import export_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SECRET = "the-session-key-9f3a"


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    folder = tmp_path / "home" / ".tally"
    folder.mkdir(parents=True)
    (folder / "session-key").write_text(SECRET)
    return folder / "session-key"


def step(tmp_path: Path, n: int = 0) -> Path:
    return sharded_checkpoint(tmp_path / "job" / "checkpoints" / f"step_{n:08d}")


def export(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(app, ["export", *args])
    return result.exit_code, [line for line in result.stderr.splitlines() if line.strip()]


def leaked(out: Path) -> bool:
    """Whether anything under ``out`` (or its staging folder) holds the secret."""
    return any(SECRET in path.read_text(errors="replace")
               for folder in (out, out.with_name(out.name + ".tmp")) if folder.exists()
               for path in folder.rglob("*") if path.is_file())


def test_export_refuses_a_link_in_model_config(tmp_path: Path, secret: Path) -> None:
    folder = step(tmp_path)
    (folder / "model_config" / "README.md").symlink_to(secret)
    code, lines = export(str(folder), str(tmp_path / "hf"))
    assert code == 2 and len(lines) == 1, lines
    assert "model_config/README.md" in lines[0] and "symbolic link" in lines[0]
    assert not (tmp_path / "hf").exists() and not leaked(tmp_path / "hf")


def test_the_tally_binary_refuses_a_linked_model_config_folder(tmp_path: Path,
                                                               secret: Path) -> None:
    folder = step(tmp_path)
    real = folder / "model_config"
    real.rename(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "notes.txt").symlink_to(secret)
    real.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    result = subprocess.run([str(ROOT / ".venv" / "bin" / "tally"), "export", str(folder),
                             str(tmp_path / "hf")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert "model_config: is a symbolic link" in result.stderr, result.stderr
    assert not (tmp_path / "hf").exists() and not leaked(tmp_path / "hf")


def test_export_adapter_refuses_a_linked_folder(tmp_path: Path) -> None:
    folder = step(tmp_path)
    ssh = tmp_path / "home" / ".ssh"
    ssh.mkdir(parents=True)
    (ssh / "id_ed25519").write_text(SECRET)
    write_peft_folder(folder / "adapter", {"w": (torch.zeros(1, 3), torch.zeros(4, 1))},
                      rank=1, alpha=1.0, base_model_path=str(tmp_path / "base"))
    (folder / "adapter" / "ssh").symlink_to(ssh, target_is_directory=True)
    code, lines = export(str(folder), str(tmp_path / "adapter"), "--adapter")
    assert code == 2 and len(lines) == 1 and "adapter/ssh" in lines[0], lines
    assert not (tmp_path / "adapter").exists() and not leaked(tmp_path / "adapter")


def rewrite_relative_paths(folder: Path, path: str) -> None:
    """Point every tensor of the checkpoint's DCP metadata at ``path``: loaded through
    the safe reader's unpickler, rewritten, pickled back, the sums fixed and ``path``
    listed in shards/manifest.json with its target's (whoever crafts it can)."""
    from trainer.dcp_metadata import load_metadata

    shards = folder / SHARDS_DIR
    metadata = load_metadata((shards / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = path
    (shards / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest = json.loads((shards / MANIFEST).read_text())
    manifest["files"][".metadata"] = _digest(shards / ".metadata")
    target = Path(path) if Path(path).is_absolute() else shards / path
    if target.is_file():
        manifest["files"][path] = _digest(target)
    (shards / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def other_job(tmp_path: Path) -> Path:
    """Another job's checkpoint beside this one: the shard a traversal would read."""
    return sharded_checkpoint(tmp_path / "other-job" / "checkpoints" / "step_00000000")


OTHER_SHARD = "../../../../other-job/checkpoints/step_00000000/shards/__0_0.distcp"
"""From this job's shards/ to the other job's first shard."""


@pytest.mark.parametrize("stored", [OTHER_SHARD, "ABSOLUTE"])
def test_export_refuses_dcp_metadata_that_points_out(tmp_path: Path, other_job: Path,
                                                      stored: str) -> None:
    if stored == "ABSOLUTE":
        stored = str(other_job / SHARDS_DIR / "__0_0.distcp")
    folder = step(tmp_path)
    rewrite_relative_paths(folder, stored)
    code, lines = export(str(folder), str(tmp_path / "hf"))
    assert code == 2 and len(lines) == 1, lines
    assert "shards/.metadata: relative_path" in lines[0] and stored in lines[0], lines
    assert not (tmp_path / "hf").exists()


def test_the_reader_never_opens_a_path_outside_its_folder(tmp_path: Path,
                                                          other_job: Path) -> None:
    folder = step(tmp_path)
    reader = SafeFileSystemReader(str(folder / SHARDS_DIR))

    def read(stored: str) -> bytes:  # what torch's read_data does with a relative_path
        with reader.fs.create_stream(reader.fs.concat_path(reader.path, stored), "rb") as f:
            return f.read()

    assert read("__0_0.distcp") == (folder / SHARDS_DIR / "__0_0.distcp").read_bytes()
    with pytest.raises(ValueError, match="climbs out"):
        read(OTHER_SHARD)
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        read(str(other_job / SHARDS_DIR / "__0_0.distcp"))
    (folder / SHARDS_DIR).rename(tmp_path / "moved")  # the shards folder itself a link
    (folder / SHARDS_DIR).symlink_to(tmp_path / "moved", target_is_directory=True)
    with pytest.raises(ValueError, match="symbolic link"):
        SafeFileSystemReader(str(folder / SHARDS_DIR)).read_metadata()


def test_a_manifest_name_that_climbs_out_is_refused(tmp_path: Path) -> None:
    folder = step(tmp_path)
    files = {"../../other-job/secret": {"bytes": 1, "crc32": 0}}
    (folder / FOLDER_MANIFEST).write_text(json.dumps({"files": files}))
    assert "manifest.json: names '../../other-job/secret'" in (escapes(folder) or "")
    manifest = folder / SHARDS_DIR / MANIFEST
    (folder / FOLDER_MANIFEST).unlink()
    manifest.write_text(json.dumps({"files": {"/etc/hostname": {"bytes": 1, "crc32": 0}}}))
    assert "shards/manifest.json: names the absolute path" in (escapes(folder) or "")


def resume(tmp_path: Path, *args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(app, ["train", str(ROOT / "configs" / "demo.yaml"), *args])
    return result.exit_code, [line for line in result.stderr.splitlines() if line.strip()]


def test_resume_refuses_a_checkpoint_that_points_out(tmp_path: Path,
                                                     other_job: Path) -> None:
    folder = step(tmp_path)
    rewrite_relative_paths(folder, OTHER_SHARD)  # listed, at its size and CRC
    code, lines = resume(tmp_path, "--resume", str(folder), "--output-dir",
                         str(tmp_path / "job"))
    assert code == 2 and len(lines) == 1, lines
    assert "shards/.metadata: relative_path" in lines[0] and OTHER_SHARD in lines[0], lines


def test_an_automatic_resume_refuses_a_hostile_newest_checkpoint(tmp_path: Path) -> None:
    """Not a fallback to the readable one before it: someone planted it."""
    step(tmp_path, 0)
    newer = step(tmp_path, 1)
    (newer / "driver_state.json").unlink()
    (newer / "driver_state.json").symlink_to(tmp_path / "job" / "checkpoints" /
                                             "step_00000000" / "driver_state.json")
    code, lines = resume(tmp_path, "--resume", "auto", "--output-dir", str(tmp_path / "job"))
    assert code == 2 and len(lines) == 1, lines
    assert "step_00000001/driver_state.json: is a symbolic link" in lines[0], lines
    assert (newer / "driver_state.json").is_symlink()  # refused, not set aside


def test_export_of_a_missing_step_lists_the_steps_there(tmp_path: Path) -> None:
    step(tmp_path, 0)
    step(tmp_path, 3)
    code, lines = export(str(tmp_path / "job" / "checkpoints" / "step_00000009"),
                         str(tmp_path / "hf"))
    assert code == 2 and len(lines) == 1, lines
    assert "no such checkpoint folder" in lines[0]
    assert "step_00000000, step_00000003" in lines[0], lines


def lora_checkpoint(tmp_path: Path, base: str) -> Path:
    folder = step(tmp_path)
    write_peft_folder(folder / "adapter", {"layer": (torch.ones(1, 3), torch.ones(4, 1))},
                      rank=1, alpha=1.0, base_model_path=base)
    return folder


def test_a_lora_base_is_an_absolute_folder_read_without_links(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "base"
    base.mkdir()
    save_file({"layer.weight": torch.zeros(4, 3)}, str(base / "model.safetensors"))
    merged = export_checkpoint(lora_checkpoint(tmp_path, str(base)), tmp_path / "hf")
    assert load_file(str(merged / "model.safetensors"))["layer.weight"].eq(1).all()
    relative = lora_checkpoint(tmp_path / "b", "base")  # relative to wherever it runs
    monkeypatch.chdir(tmp_path)  # where a relative base would be
    code, lines = export(str(relative), str(tmp_path / "hf2"))
    assert code == 2 and "not an absolute folder" in lines[0], lines
    code, lines = export(str(relative), str(tmp_path / "hf2"), "--base", str(base))
    assert code == 0, lines
    linked = tmp_path / "linked-base"
    linked.mkdir()
    (linked / "model.safetensors").symlink_to(base / "model.safetensors")
    code, lines = export(str(relative), str(tmp_path / "hf3"), "--base", str(linked))
    assert code == 2 and len(lines) == 1 and "symbolic link" in lines[0], lines
