"""The confinement rule (rollout/confined.py) against planted links and stored paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollout.confined import (
    Escapes,
    copy_regular_files,
    create_owned,
    read_inside,
    regular_files,
    stored_path,
)


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    secret = tmp_path / "secret.txt"
    secret.write_text("the key")
    folder = tmp_path / "ckpt"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.json").write_text("{}")
    (folder / "top.txt").write_text("top line\n" * 3)
    return folder, secret


@pytest.mark.parametrize("value", ["/etc/passwd", "../other/x", "a/../../b", "", "\\x",
                                   "C:/x"])
def test_a_stored_path_that_leaves_its_folder_is_refused(value: str) -> None:
    with pytest.raises(Escapes, match=r"manifest\.json"):
        stored_path(value, "manifest.json")


def test_a_plain_relative_path_is_kept() -> None:
    assert str(stored_path("shards/__0_0.distcp", "x")) == "shards/__0_0.distcp"


def test_files_read_inside_and_tails_are_bounded(folders: tuple[Path, Path]) -> None:
    folder, _ = folders
    assert read_inside(folder, "sub/a.json") == b"{}"
    assert read_inside(folder, "top.txt", tail=5) == b"line\n"
    assert read_inside(folder, "top.txt", limit=3) == b"top"
    with pytest.raises(FileNotFoundError):
        read_inside(folder, "missing.txt")


def test_a_link_is_never_read_through(folders: tuple[Path, Path]) -> None:
    folder, secret = folders
    (folder / "driver.log").symlink_to(secret)
    (folder / "linked").symlink_to(secret.parent)
    with pytest.raises(Escapes, match=r"driver\.log is a symbolic link"):
        read_inside(folder, "driver.log")
    with pytest.raises(Escapes, match="linked is a symbolic link"):
        read_inside(folder, "linked/secret.txt")
    with pytest.raises(Escapes, match="climbs out"):
        read_inside(folder, "../secret.txt")
    with pytest.raises(Escapes, match=r"driver\.log"):
        list(regular_files(folder))


def test_a_copy_refuses_a_link_before_writing_anything(folders: tuple[Path, Path],
                                                       tmp_path: Path) -> None:
    folder, secret = folders
    copy_regular_files(folder, tmp_path / "out")
    assert (tmp_path / "out" / "sub" / "a.json").read_text() == "{}"
    (folder / "sub" / "README.md").symlink_to(secret)
    with pytest.raises(Escapes, match=r"README\.md"):
        copy_regular_files(folder, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_an_owned_file_is_never_written_through_a_link(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("unchanged")
    (tmp_path / "stdout.log").symlink_to(target)
    with pytest.raises(OSError):
        create_owned(tmp_path / "stdout.log")
    assert target.read_text() == "unchanged"
    os.close(create_owned(tmp_path / "fresh.log"))
    assert (tmp_path / "fresh.log").stat().st_mode & 0o777 == 0o600


def test_a_file_created_inside_is_the_owners_only(tmp_path: Path) -> None:
    from rollout.confined import open_inside

    os.close(open_inside(tmp_path, "events.jsonl", flags=os.O_WRONLY | os.O_CREAT))
    assert (tmp_path / "events.jsonl").stat().st_mode & 0o777 == 0o600
