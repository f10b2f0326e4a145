"""The house rules on size: no module of the product over 500 lines, no function over 80; no
test or benchmark module over 500 lines either (a newcomer reads a test file whole)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("kernelhost", "hypervisor", "guest-image")
CHECKS = ("tests", "bench")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 80


def _modules(tops: tuple[str, ...] = PRODUCT) -> list[Path]:
    return sorted(p for top in tops for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("tops", [PRODUCT, CHECKS], ids=["product", "tests and benchmarks"])
def test_no_module_is_over_500_lines(tops: tuple[str, ...]) -> None:
    long = {
        str(p.relative_to(REPO)): n
        for p in _modules(tops)
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"split these modules (at most {MAX_MODULE_LINES} lines): {long}"


def test_no_function_is_over_80_lines() -> None:
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = n
    assert not long, f"split these functions (at most {MAX_FUNCTION_LINES} lines): {long}"
