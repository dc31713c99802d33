"""VLLM_OFFLOAD_REQUIRE_ROOT=1 turns a skip for a missing privilege into a failure.

CI runs as root and sets the switch: a run that lost its privileges (another
container, a dropped capability, no setpriv) must fail, not pass by skipping
every test only root can run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REQUIRE_ROOT, require_root

TESTS = Path(__file__).parent


def test_without_the_switch_a_missing_privilege_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REQUIRE_ROOT, raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs a thing"):
        require_root("needs a thing", granted=False)
    require_root("needs a thing", granted=True)  # granted: nothing happens


def test_under_the_switch_a_missing_privilege_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_ROOT, "1")
    with pytest.raises(pytest.fail.Exception, match=f"needs a thing .*{REQUIRE_ROOT}=1"):
        require_root("needs a thing", granted=False)
    require_root("needs a thing", granted=True)


def test_by_default_the_privilege_is_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_ROOT, "1")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.fail.Exception, match="needs root"):
        require_root("needs root")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    require_root("needs root")


_SUITE = textwrap.dedent("""
    import pytest
    from conftest import require_root

    @pytest.fixture(scope="session")
    def privileged():
        require_root("needs a privilege this run lacks", granted=False)

    def test_in_the_test():
        require_root("needs a privilege this run lacks", granted=False)

    def test_in_a_session_fixture(privileged):
        pass
""")


@pytest.mark.parametrize(("switch", "summary"), [("1", "1 failed, 1 error"),
                                                 ("0", "2 skipped")])
def test_a_real_run_reports_the_skip_as_a_failure(tmp_path: Path, switch: str,
                                                  summary: str) -> None:
    """As pytest reports it, from a test and from a session fixture (as `nobody`)."""
    (tmp_path / "test_privileged.py").write_text(_SUITE)
    path = os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path, REQUIRE_ROOT: switch})
    assert summary in proc.stdout, proc.stdout + proc.stderr
    # twice at least: the failure and the error (CI=true also prints the summary untruncated)
    assert proc.stdout.count("needs a privilege this run lacks") >= 2, proc.stdout
