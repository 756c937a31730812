"""Where a tree's package root is (package root or git clone), and all-or-nothing writes."""

import shutil

import pytest

from scripts.toolchain import operations
from scripts.toolchain.errors import ToolError
from scripts.toolchain.tree import locate

from .helpers import MODEL, UPSTREAM, snapshot


def test_a_package_root_is_its_own_package_root(package_tree):
    assert package_tree.layout == "package"
    assert package_tree.package_root == package_tree.root
    assert (package_tree.root / MODEL).is_file()


def test_a_git_clone_keeps_the_package_under_python(clone_tree):
    assert clone_tree.layout == "git clone"
    assert (clone_tree.root / ".git").is_dir()
    assert clone_tree.package_root == clone_tree.root / "python"


def test_both_layouts_report_the_same_hunks(package_tree, clone_tree, lock):
    def where(tree):
        return [(r.patch, r.path, r.line, r.status) for r in operations.verify(sglang_dir=tree.root, lock=lock).state.reports]

    assert where(package_tree) == where(clone_tree)


def test_a_folder_with_both_layouts_is_ambiguous(clone_tree, cli):
    shutil.copytree(UPSTREAM / "sglang", clone_tree.root / "sglang")
    before = snapshot(clone_tree.root)
    with pytest.raises(ToolError, match="holds both python/sglang/srt/models/deepseek_v2.py and") as ambiguous:
        locate(clone_tree.root)
    assert ambiguous.value.exit_code == 2
    code, _, err = cli("apply", "--dir", clone_tree.root)
    assert code == 2
    assert "name the folder that contains `sglang/` itself" in err
    assert snapshot(clone_tree.root) == before


def test_an_unrelated_folder_is_not_an_sglang_tree(tmp_path, cli):
    unrelated = tmp_path / "vllm"
    (unrelated / "vllm" / "model_executor").mkdir(parents=True)
    (unrelated / "vllm" / "model_executor" / "models.py").write_text("# not sglang\n")
    code, out, err = cli("verify", "--dir", unrelated)
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {unrelated} is not an SGLang tree")
    assert "Traceback" not in err


def test_a_missing_folder_is_a_usage_error(tmp_path, cli):
    code, _, err = cli("verify", "--dir", tmp_path / "nowhere")
    assert code == 2
    assert "is not a directory" in err


def test_a_failed_write_restores_the_files_already_written(package_tree):
    environ = "sglang/srt/environ.py"
    old = package_tree.read([environ, f"{environ}/impossible.py"])
    new = {environ: ["# rewritten\n"], f"{environ}/impossible.py": ["# a file cannot be a folder\n"]}
    before = snapshot(package_tree.root)
    with pytest.raises(ToolError, match="the tree was left as it was"):
        package_tree.write(new, old)
    assert snapshot(package_tree.root) == before
