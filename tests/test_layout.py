"""The run directory's layout is spelled in one place (`onboard/workspace.py`), and the README's
listing of it matches."""

import ast
import re
from pathlib import Path

import onboard
from onboard import workspace

ROOT = Path(onboard.__file__).parent.parent
# (Not .cache: the user's cache directory is spelled so too.)
PATHS = {entry.path for entry in workspace.LAYOUT} | {workspace.SPECULATOR_WORK, workspace.STAGING}
# A path join onto one of these names is a run-directory path too ("speculator" is also the
# folder of a draft inside any checkpoint, so it is not among them).
FOLDERS = {workspace.folder(path) for path in PATHS} - {"speculator"}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            found.add(id(first.value))
    return found


def spelled_paths(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            text = node.value
            if any((text == p and ("/" in p or "." in p or "-" in p)) or text.startswith(p + "/") for p in PATHS):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text!r}")
        divides = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
        if divides and isinstance(node.right, ast.Constant) and node.right.value in FOLDERS:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: / {node.right.value!r}")
    return found


def test_no_module_but_workspace_spells_a_run_directory_path() -> None:
    files = [*sorted((ROOT / "onboard").rglob("*.py")), *sorted((ROOT / "scripts").glob("*.py"))]
    spelled = [hit for f in files if f != ROOT / "onboard" / "workspace.py" for hit in spelled_paths(f)]
    assert spelled == []


def test_the_check_finds_a_spelled_path(tmp_path: Path) -> None:
    module = ROOT / "onboard" / "_layout_probe.py"
    text = 'def f(run):\n    """eval/kl.json is fine in a docstring."""\n    return run / "artifact", "eval/kl.json"\n'
    try:
        module.write_text(text)
        assert [hit.split(": ", 1)[1] for hit in spelled_paths(module)] == ["/ 'artifact'", "'eval/kl.json'"]
    finally:
        module.unlink()


def test_the_readme_lists_every_run_directory_path() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Run directory", 1)[1].split("```", 2)[1]
    listed = {m.rstrip("/") for m in re.findall(r"^RUN_DIR/(\S+)", block, re.M)}
    expected = {entry.path for entry in workspace.LAYOUT}
    # The README names a folder's files where the table names the folder.
    named = {p for p in listed if p in expected} | {p.split("/")[0] for p in listed if p.split("/")[0] in expected}
    assert named == expected
    assert all(any(p == e or p.startswith(e + "/") for e in expected) for p in listed), listed - expected
