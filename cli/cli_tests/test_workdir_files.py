"""The files of a workdir a job on any VM of a kind gets are those rsync's filter
(`--filter=':- .gitignore' --exclude=/.git`, what `tpu run VM --workdir` runs) sends:
each case builds a real tree and asks rsync itself; symlinks, modes and what is not a
regular file are the client's own choice."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tpu_cli import ignore

pytestmark = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")


def build(root: Path, files: dict[str, str]) -> Path:
    """``files``: path -> content; a path ending in "/" is an empty folder."""
    for path, content in files.items():
        target = root / path
        if path.endswith("/"):
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
    return root


def rsync_sends(root: Path, tmp: Path) -> list[str]:
    """The regular files ``rsync -a`` with the client's filter sends from ``root``."""
    dest = tmp / "rsync-dest"
    dest.mkdir(exist_ok=True)
    done = subprocess.run(
        ["rsync", "-a", "-n", "--filter=:- .gitignore", "--exclude=/.git", "--out-format=%n",
         f"{root}/", f"{dest}/"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    names = [name for name in done.stdout.splitlines() if name and name != "./"]
    return sorted(name for name in names if (root / name).is_file())


def chosen(root: Path) -> list[str]:
    return [f.path for f in ignore.walk(root).files]


TREE = {
    "train.py": "", "model/net.py": "", "model/net.pyc": "", "model/__pycache__/x.pyc": "",
    "data/big.bin": "", "data/keep/small.txt": "", "logs/run1/out.log": "", "a.log": "",
    "keep.log": "", "!keep.log": "", "top.txt": "", "sub/top.txt": "", "sub/x.txt": "",
    "sub/deep/x.txt": "", "sub/deep/sub/x.txt": "", "build/f": "", "src/build/f": "",
    "src/build.txt": "", "notes/#hash": "", "a/b.txt": "", "a/m/b.txt": "", "a/m/n/b.txt": "",
    "deep.txt": "", "x/y/deep.txt": "", "x*y": "", "xay": "", "trail ": "", "trail": "",
    ";semi": "", "file1": "", "file2": "", "fileA": "", "dir1/": "", "ckpt/step_100/w": "",
    ".git/config": "", ".git/objects/ab": "", "sub/.git/HEAD": "", ".env": "", ".hidden/x": "",
    "sub/.env": "", "Makefile": "", "ck/a/b/c/d.npy": "", "sub/inner/qq": "", "sub/qq": "",
    "sub/inner/anch": "", "sub/anch": "", "anch": "",
}  # fmt: skip


@pytest.mark.parametrize(
    "ignores",
    [
        {},
        {".gitignore": "*.pyc\n__pycache__/\n"},
        {".gitignore": "*.log\n!keep.log\n"},  # rsync: "!" is part of the name
        {".gitignore": "!keep.log\n*.log\n"},
        {".gitignore": "/top.txt\nbuild/\n"},
        {".gitignore": "sub/x.txt\n"},  # the end of the path, at any depth
        {".gitignore": "a/**/b.txt\n**/deep.txt\n"},
        {".gitignore": "ck/**\n"},
        {".gitignore": "ckpt/***\n"},
        {".gitignore": "x\\*y\n# a comment\n;semi\n\ntrail \n"},
        {".gitignore": "file[12]\n[!a-z]*.txt\n"},
        {".gitignore": "file[^12]\n[[:upper:]]akefile\n"},
        {".gitignore": "?eep.log\n*/*/out.log\n"},
        {".gitignore": "data/*\n"},
        {".gitignore": "data\n"},
        {".gitignore": "/data/\n.*\n"},
        {".gitignore": ".gitignore\n"},
        {".gitignore": "*\n"},
        {".gitignore": "**\n"},
        {".gitignore": "dir1/\nsub\n"},
        {".gitignore": "logs/run1\n"},
        {".gitignore": "/sub/deep\n"},
        {".gitignore": "/sub/deep/\n/*.txt\n"},
        {".gitignore": "**/sub/x.txt\n"},
        {".gitignore": "sub/**/x.txt\n"},
        {".gitignore": "notes/\\#hash\n"},
        {".gitignore": "*.log\n", "sub/.gitignore": "x.txt\n/top.txt\n"},
        {"sub/.gitignore": "sub/qq\n/anch\n.gitignore\n", "sub/inner/.gitignore": "q*\n"},
        {"sub/.gitignore": "deep/\n", "sub/deep/.gitignore": "*\n"},
        {"model/.gitignore": "/net.py\n", ".gitignore": "net.pyc\n"},
        {"a/.gitignore": "m/b.txt\n", "a/m/.gitignore": "/n\n"},
        {"data/.gitignore": "!keep/\n*\n"},
        {".gitignore": "*.log\r\nbuild/\r\n"},  # written on Windows
        {".gitignore": "  indented\n*.bin   \n"},
    ],
)
def test_the_files_chosen_are_those_rsyncs_filter_sends(tmp_path, ignores):
    root = build(tmp_path / "work", {**TREE, **ignores, "  indented": ""})
    assert chosen(root) == rsync_sends(root, tmp_path)


def test_random_trees_and_ignore_files_choose_as_rsync_does(tmp_path):
    names = ["a", "b", "src", "data", "x.py", "y.log", "z.txt", "build", "keep.log", ".env"]
    patterns = [
        "*.log",
        "/a",
        "a/",
        "b",
        "src/*.py",
        "**/z.txt",
        "data/**",
        "x.*",
        "/src/",
        "?.py",
        "!keep.log",
        "build/",
        "a/b",
        "*/x.py",
        "[ab]",
        ".*",
        "src/**/x.py",
    ]
    rng = random.Random(20261128)
    for case in range(30):
        root = tmp_path / f"tree{case}"
        files = {}
        for _ in range(25):
            depth = rng.randint(1, 4)
            files["/".join(rng.choice(names) for _ in range(depth))] = ""
        # A path that is both a file and a folder's name: the folder wins.
        paths = sorted(files, key=len, reverse=True)
        tree = {}
        for path in paths:
            if not any(other.startswith(path + "/") for other in tree):
                tree[path] = ""
        folders = {p.rpartition("/")[0] for p in tree} - {""}
        for folder in [""] + sorted(folders)[:4]:
            lines = rng.sample(patterns, rng.randint(1, 4))
            tree[f"{folder}/.gitignore" if folder else ".gitignore"] = "\n".join(lines) + "\n"
        build(root, tree)
        assert chosen(root) == rsync_sends(root, tmp_path), (case, tree)


def test_a_symlink_to_a_file_in_the_workdir_is_followed_and_others_are_named(tmp_path):
    root = build(tmp_path / "work", {"configs/base.yaml": "lr: 1", "lib/mod.py": "", "run.sh": ""})
    outside = build(tmp_path / "elsewhere", {"secret": "x"})
    (root / "config.yaml").symlink_to("configs/base.yaml")
    (root / "lib2").symlink_to("lib")
    (root / "secret").symlink_to(outside / "secret")
    (root / "gone").symlink_to("nothing-here")
    (root / "run.sh").chmod(0o755)
    found = ignore.walk(root)
    files = {f.path: f for f in found.files}
    assert sorted(files) == ["config.yaml", "configs/base.yaml", "lib/mod.py", "run.sh"]
    assert files["config.yaml"].source == (root / "configs/base.yaml").resolve()
    assert (files["run.sh"].mode, files["lib/mod.py"].mode) == (0o755, 0o644)
    assert sorted(found.skipped_links) == [
        ("gone", "to nothing"), ("lib2", "to a folder"), ("secret", "out of the workdir")
    ]  # fmt: skip


def test_a_socket_or_a_pipe_is_not_a_file_a_job_gets(tmp_path):
    root = build(tmp_path / "work", {"train.py": ""})
    os.mkfifo(root / "pipe")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(root / "sock"))
        assert chosen(root) == ["train.py"]
    finally:
        server.close()
