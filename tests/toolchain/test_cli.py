"""The command line as `make` runs it: `python -m scripts ...` in a subprocess, from the repository root."""

import re
import subprocess
import sys

from scripts.paths import REPO_ROOT

from .helpers import MODEL, PATCH_NAMES, replace_in


def run_scripts(*args):
    return subprocess.run([sys.executable, "-m", "scripts", *map(str, args)],
                          cwd=REPO_ROOT, capture_output=True, text=True)


def test_verify_exits_0_on_a_clean_tree_and_1_on_drift_naming_file_and_line(package_tree, project):
    lock = project / "sglang.lock"
    clean = run_scripts("verify", "--dir", package_tree.root, "--lock", lock)
    assert clean.returncode == 0, clean.stderr
    assert f"against {package_tree.root} (package layout)" in clean.stdout
    assert "upstream files match the locked release 0.1.0" in clean.stdout
    assert re.search(rf"^{re.escape(PATCH_NAMES[1])}\s+{re.escape(MODEL)}:62\s+applies$", clean.stdout, re.MULTILINE)
    assert clean.stdout.endswith("state: clean: the whole series applies\n")

    replace_in(package_tree.package_root / MODEL, "if self.capture_aux_hidden_states:", "if self.capture_aux:")
    drifted = run_scripts("verify", "--dir", package_tree.root, "--lock", lock)
    assert drifted.returncode == 1
    assert re.search(rf"^{re.escape(PATCH_NAMES[1])}\s+{re.escape(MODEL)}:62\s+drift$", drifted.stdout, re.MULTILINE)
    assert "found:    '        if self.capture_aux:\\n'" in drifted.stdout
    assert "state: drift" in drifted.stdout


def test_usage_errors_exit_2_with_one_clear_line(tmp_path, project, package_tree):
    lock = project / "sglang.lock"
    (tmp_path / "unrelated").mkdir()
    unrelated = run_scripts("verify", "--dir", tmp_path / "unrelated", "--lock", lock)
    assert unrelated.returncode == 2
    assert unrelated.stderr.startswith(f"error: {tmp_path / 'unrelated'} is not an SGLang tree")
    assert "Traceback" not in unrelated.stderr

    unknown_version = run_scripts("verify", "--version", "9.9.9", "--dir", package_tree.root, "--lock", lock)
    assert unknown_version.returncode == 2
    assert "SGLang 9.9.9 is not in sglang.lock (supported: 0.1.0)" in unknown_version.stderr

    assert run_scripts("frobnicate").returncode == 2
