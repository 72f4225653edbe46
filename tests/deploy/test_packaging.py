"""The distribution: one import package, `kvroute`, whatever the folders are called."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.paths import REPO

ROOT = REPO


def _built_wheel(tmp_path: Path, env: dict[str, str] | None = None) -> list[str]:
    """The names in a wheel built from a copy of the sources (setuptools leaves a build/
    folder beside them; an in-place build of the compiled index loops is left out)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("app", "index", "sim"):
        shutil.copytree(ROOT / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path),
         str(source)], capture_output=True, text=True, timeout=600,
        env=None if env is None else {**os.environ, **env})
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("kvroute-*.whl")
    return zipfile.ZipFile(wheel).namelist()


def _compiled_loops(names: list[str]) -> list[str]:
    """The compiled modules in a wheel: the index's loops, the route's token reader, the
    live drain."""
    return [n for n in names if n.endswith(".so") and n.startswith(
        ("kvroute/index/_fast.", "kvroute/app/api/_token_scan.",
         "kvroute/app/ingest/_live_drain."))]


# A wheel build compiles every extension: about 40 s alone, far more on a loaded machine.
WHEEL_BUILD_LIMIT = pytest.mark.timeout(600)


@WHEEL_BUILD_LIMIT
def test_the_wheel_holds_only_the_kvroute_package(tmp_path: Path) -> None:
    names = _built_wheel(tmp_path)
    wheel = next(tmp_path.glob("kvroute-*.whl"))
    # The machine's C compiler built the compiled modules into the wheel (the container
    # image's build stage checks the same).
    assert len(_compiled_loops(names)) == 3, names
    tops = {name.split("/", 1)[0] for name in names}
    assert tops == {"kvroute", next(t for t in tops if t.endswith(".dist-info"))}
    for module in ("kvroute/app/service.py", "kvroute/index/prefix_index.py",
                   "kvroute/sim/engine.py", "kvroute/sim/demo.py",
                   # GET /dashboard serves these from the installed package
                   "kvroute/app/http/dashboard_static/index.html",
                   "kvroute/app/http/dashboard_static/app.js",
                   "kvroute/app/http/dashboard_static/style.css"):
        assert module in names
    assert not any("/tests/" in n or "/benchmarks/" in n for n in names)
    info = next(t for t in tops if t.endswith(".dist-info"))
    entry_points = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert "kvroute = kvroute.app.cli:main" in entry_points


@WHEEL_BUILD_LIMIT
def test_without_a_c_compiler_the_wheel_builds_with_the_pure_loops(tmp_path: Path) -> None:
    """The slim container image has no compiler: the build still succeeds, without the
    compiled loops (the index then reports IMPLEMENTATION "pure")."""
    names = _built_wheel(tmp_path, env={"CC": "false"})
    assert "kvroute/index/prefix_index.py" in names
    assert _compiled_loops(names) == []


def test_the_service_never_imports_the_simulator() -> None:
    """`kvroute demo` loads the simulator when asked; nothing else in the service does."""
    code = ("import sys, kvroute.app.http.app, kvroute.app.cli, kvroute.app.http.proxy; "
            "print(sorted(m for m in sys.modules if m.startswith('kvroute.sim')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT.parent, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def _module_imports(prefix: str = "kvroute.") -> dict[str, set[str]]:
    """kvroute module -> the modules starting with `prefix` it imports at module level."""
    graph: dict[str, set[str]] = {}
    for package, folder in (("kvroute.app", "app"), ("kvroute.index", "index"),
                            ("kvroute.sim", "sim")):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))
            targets = set()
            for node in ast.parse(path.read_text()).body:  # module level only
                if isinstance(node, ast.ImportFrom) and node.module:
                    targets.add(node.module)
                elif isinstance(node, ast.Import):
                    targets.update(alias.name for alias in node.names)
            graph[name] = {t for t in targets if t.startswith(prefix)}
    return graph


def test_no_module_imports_itself_through_others() -> None:
    graph = _module_imports()
    assert ("kvroute.app.http.app" in graph
            and "kvroute.app.http.proxy" in graph["kvroute.app.http.app"])
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> None:
        if module in done or module not in graph:
            return
        assert module not in visiting, " -> ".join([*visiting, module])
        visiting.append(module)
        for target in graph[module]:
            visit(target)
        visiting.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_every_refusal_has_one_status() -> None:
    from kvroute.app.errors import RequestError
    from kvroute.app.http.app import STATUS_OF

    kinds = set(RequestError.__subclasses__())
    assert kinds == set(STATUS_OF), sorted(k.__name__ for k in kinds ^ set(STATUS_OF))
    assert all(400 <= status < 600 for status in STATUS_OF.values())


def test_every_subscriber_counter_is_listed_on_the_metrics_page() -> None:
    from kvroute.app.workers import COUNTERS

    readme = (REPO / "docs" / "metrics.md").read_text()
    metrics = readme.split("## Metrics")[1].split("\n## ")[0]
    missing = [f"{name}_total" for name, _ in COUNTERS.values()
               if f"`{name}_total`" not in metrics]
    assert not missing
