"""The tests' own layout: helpers live in tests/support, never in a test module or in a
conftest, so a test can be moved or deleted without breaking another."""

from __future__ import annotations

import ast

from tests.support.paths import REPO


def _imported(path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_test_module_imports_another_or_a_conftest() -> None:
    suites = [REPO / "tests", REPO / "benchmarks" / "tests", REPO / "e2e" / "tests"]
    modules = [path for suite in suites for path in suite.rglob("*.py")]
    assert len(modules) > 100
    offenders = {}
    for path in modules:
        bad = sorted(name for name in _imported(path)
                     if name.rsplit(".", 1)[-1].startswith("test_") or "conftest" in name)
        if bad:
            offenders[str(path.relative_to(REPO))] = bad
    assert offenders == {}
    assert not list((REPO / "tests").rglob("conftest.py"))
