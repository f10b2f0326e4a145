"""The sandbox layer's layout (issue 36): a small root, and families that say what they hold."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SANDBOXES = Path(__file__).resolve().parents[2] / "kernelhost" / "sandboxes"
MAX_ROOT_MODULES = 14


def test_the_sandbox_layers_root_holds_at_most_14_modules() -> None:
    root = sorted(p.name for p in SANDBOXES.glob("*.py") if p.name != "__init__.py")
    assert len(root) <= MAX_ROOT_MODULES, (
        f"{len(root)} modules at the root: {root}; put a family in a package"
    )


@pytest.mark.parametrize("family", sorted(p.parent.name for p in SANDBOXES.glob("*/__init__.py")))
def test_each_family_lists_its_modules_in_its_docstring(family: str) -> None:
    package = SANDBOXES / family
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    missing = [
        p.stem for p in sorted(package.glob("*.py")) if p.stem != "__init__" and f"``{p.stem}``" not in doc
    ]
    assert not missing, f"sandboxes/{family}/__init__.py's docstring does not list {missing}"
