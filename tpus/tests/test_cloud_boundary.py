"""Only tpus.cloud talks to the Cloud TPU API; the emulator and tests may use its types,
and a benchmark may stand in for a tool outside the portal (``gcloud``'s create loop in
``bench/vms.py``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = [ROOT / "tpus" / "cloud", ROOT / "tpus" / "emulator", ROOT / "bench" / "vms.py"]
SKIPPED_DIRS = {".venv", ".git", "node_modules", "var", "__pycache__"}


def _python_files():
    for path in ROOT.rglob("*.py"):
        parts = set(path.relative_to(ROOT).parts)
        if parts & SKIPPED_DIRS or "tests" in parts:
            continue
        if any(path.is_relative_to(allowed) for allowed in ALLOWED):
            continue
        yield path


def _imported_modules(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_nothing_outside_tpus_cloud_imports_the_tpu_api():
    offenders = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in _python_files()
        for module in _imported_modules(path)
        if module.startswith("google.cloud.tpu")
    ]

    assert offenders == []


def test_the_boundary_check_would_notice_an_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from google.cloud import tpu_v2\nimport google.cloud.tpu\n")

    assert list(_imported_modules(sample)) == [
        "google.cloud",
        "google.cloud.tpu_v2",
        "google.cloud.tpu",
    ]


def test_the_settings_refuse_an_insecure_channel_without_an_endpoint():
    result = subprocess.run(
        [sys.executable, "-c", "import portal.settings.base"],
        cwd=ROOT,
        env={"TPU_API_INSECURE": "true", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode != 0
    assert "TPU_API_ENDPOINT" in result.stderr
