"""A test that lacks its environment skips when run alone, and fails under `make test`, which promised it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LACKING = "from tests.environment import lacking\n\ndef test_it():\n    lacking('no widget here')\n"


@pytest.mark.parametrize("required, outcome", [("", "1 skipped"), ("1", "1 failed")])
def test_a_missing_environment_skips_alone_and_fails_where_promised(tmp_path, required, outcome):
    (tmp_path / "test_lacking.py").write_text(LACKING)
    env = {**os.environ, "KVFERRY_TESTS_REQUIRE_ENV": required, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert outcome in run.stdout and "no widget here" in run.stdout, run.stdout
