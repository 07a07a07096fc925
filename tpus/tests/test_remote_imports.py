"""paramiko has one door: tpus/remote. Nothing else imports it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = [ROOT / "tpus" / "remote"]


def imports_paramiko(path: Path) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(
            a.name.split(".")[0] == "paramiko" for a in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "paramiko":
            return True
    return False


def test_nothing_outside_tpus_remote_imports_paramiko():
    offenders = []
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT)
        if relative.parts[0].startswith(".") or "node_modules" in relative.parts:
            continue
        if "tests" in relative.parts or any(path.is_relative_to(a) for a in ALLOWED):
            continue
        if imports_paramiko(path):
            offenders.append(str(relative))
    assert offenders == []
