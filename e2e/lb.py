"""nginx and HAProxy running kvroute's shipped configurations (deploy/), on loopback.

The files in deploy/nginx and deploy/haproxy are used as they are, except for the values
a deployment changes anyway: the listening port, the instances' and kvroute's addresses,
HAProxy's internal kvroute-api socket name, and (when asked) the deadline for kvroute's
answer. Each of those is an exact replacement of the example value in the shipped file that
must be found exactly where expected, so a change to the files that the harness does not
know about fails loudly instead of testing something else. ``routing=False`` turns the same
configuration into a plain round-robin balancer (the routing hook replaced by the upstream
group), the baseline the benchmark measures beside it.

Used by ``make e2e-lb`` (e2e/lb_run.py) and by benchmarks/real_hitrate.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from e2e.ports import free_port
from e2e.processes import ManagedProcess, ProcessSet

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KINDS = ("nginx", "haproxy")
NGINX_JS_MODULE = Path("/usr/lib/nginx/modules/ngx_http_js_module.so")
PACKAGES = {"nginx": "nginx", "njs": "libnginx-mod-http-js", "haproxy": "haproxy"}
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])

# The example values in the shipped files.
EXAMPLE_LISTEN = "127.0.0.1:8080"
EXAMPLE_INSTANCES = ("10.0.0.5:8000", "10.0.0.6:8000")
EXAMPLE_KVROUTE = "127.0.0.1:8000"
EXAMPLE_DEADLINE_MS = 50
EXAMPLE_API_SOCKET = "abns@kvroute-api"


class BalancerError(RuntimeError):
    """A balancer could not be installed, configured or started."""


def binary(name: str) -> str | None:
    return shutil.which(name, path=SBIN_PATH)


def missing_packages() -> list[str]:
    """The Debian packages the balancers need and this machine lacks."""
    missing = []
    if binary("nginx") is None:
        missing.append(PACKAGES["nginx"])
    if not NGINX_JS_MODULE.exists():
        missing.append(PACKAGES["njs"])
    if binary("haproxy") is None:
        missing.append(PACKAGES["haproxy"])
    return missing


def ensure_installed(say: Callable[[str], None]) -> None:
    """Install nginx, its njs module and HAProxy with apt-get when any is missing."""
    missing = missing_packages()
    if not missing:
        return
    if os.geteuid() != 0:
        raise BalancerError(f"missing {', '.join(missing)}, and installing them with apt-get "
                            "needs root: run `apt-get install -y nginx libnginx-mod-http-js "
                            "haproxy` first")
    apt = binary("apt-get")
    if apt is None:
        raise BalancerError(f"missing {', '.join(missing)}, and there is no apt-get here")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = [apt, "install", "-y", "-q", "--no-install-recommends", *missing]
    say(f"installing {' '.join(missing)} with apt-get")
    if subprocess.run(install, env=env, check=False).returncode != 0:
        say("apt-get install failed; updating the package lists and trying again")
        subprocess.run([apt, "update", "-q"], env=env, check=False)
        if subprocess.run(install, env=env, check=False).returncode != 0:
            raise BalancerError(f"apt-get could not install {', '.join(missing)}")
    still = missing_packages()
    if still:
        raise BalancerError(f"still missing after apt-get: {', '.join(still)}")


def versions() -> dict[str, str]:
    """The first line each balancer prints about its version."""
    out = {}
    for kind, argv in (("nginx", ["-v"]), ("haproxy", ["-v"])):
        path = binary(kind)
        if path is None:
            out[kind] = "missing"
            continue
        result = subprocess.run([path, *argv], capture_output=True, text=True, check=False)
        text = (result.stdout + result.stderr).strip().splitlines()
        out[kind] = text[0] if text else "?"
    return out


# --- the configurations -------------------------------------------------------------------------


def _replace(text: str, old: str, new: str, count: int, where: str) -> str:
    found = text.count(old)
    if found != count:
        raise BalancerError(f"{where}: expected {count} x {old!r} in the shipped file, "
                            f"found {found}: the harness no longer matches deploy/")
    return text.replace(old, new)


def _host_port(url: str) -> str:
    rest = url.split("://", 1)[-1].rstrip("/")
    if "/" in rest:
        raise BalancerError(f"not an origin URL: {url}")
    return rest


def render_nginx(port: int, instances: Sequence[str], kvroute: str, deadline_ms: int | None,
                 routing: bool) -> str:
    where = "deploy/nginx/nginx.conf"
    text = (DEPLOY / "nginx" / "nginx.conf").read_text()
    text = _replace(text, f"listen {EXAMPLE_LISTEN};", f"listen 127.0.0.1:{port};", 1, where)
    servers = "".join(f"        server {EXAMPLE_INSTANCES[i]};\n" for i in range(2))
    ours = "".join(f"        server {_host_port(url)};\n" for url in instances)
    text = _replace(text, servers, ours, 1, where)
    text = _replace(text, f"js_var $kvroute_url http://{EXAMPLE_KVROUTE};",
                    f"js_var $kvroute_url {kvroute.rstrip('/')};", 1, where)
    example_deadline = f"js_fetch_timeout {EXAMPLE_DEADLINE_MS}ms;"
    if deadline_ms is not None:
        text = _replace(text, example_deadline, f"js_fetch_timeout {deadline_ms}ms;", 1, where)
    else:
        _replace(text, example_deadline, example_deadline, 1, where)
    if not routing:
        text = _replace(text, "js_content kvroute.route;", "proxy_pass http://vllm;", 2, where)
    return text


def render_haproxy(port: int, instances: Sequence[str], kvroute: str, deadline_ms: int | None,
                   routing: bool) -> str:
    where = "deploy/haproxy/haproxy.cfg"
    text = (DEPLOY / "haproxy" / "haproxy.cfg").read_text()
    text = _replace(text, f"bind {EXAMPLE_LISTEN}\n", f"bind 127.0.0.1:{port}\n", 1, where)
    servers = "".join(f"    server vllm-{i} {EXAMPLE_INSTANCES[i]}\n" for i in range(2))
    ours = "".join(f"    server vllm-{i} {_host_port(url)}\n" for i, url in enumerate(instances))
    text = _replace(text, servers, ours, 1, where)
    text = _replace(text, EXAMPLE_KVROUTE, _host_port(kvroute), 2, where)
    # abstract socket names are shared by the whole host: one per balancer
    text = _replace(text, EXAMPLE_API_SOCKET, f"{EXAMPLE_API_SOCKET}-{port}", 2, where)
    example = (f"    timeout connect {EXAMPLE_DEADLINE_MS}ms\n"
               f"    timeout server {EXAMPLE_DEADLINE_MS}ms\n")
    if deadline_ms is not None:
        text = _replace(text, example, f"    timeout connect {deadline_ms}ms\n"
                        f"    timeout server {deadline_ms}ms\n", 1, where)
    else:
        _replace(text, example, example, 1, where)
    if not routing:
        hook = next((line for line in text.splitlines(keepends=True)
                     if line.strip().startswith("http-request lua.kvroute_route ")), None)
        if hook is None:
            raise BalancerError(f"{where}: no `http-request lua.kvroute_route` line")
        text = _replace(text, hook, "", 1, where)
    return text


# --- running them -------------------------------------------------------------------------------


@dataclass
class Balancer:
    """One running nginx or HAProxy."""

    kind: str
    routing: bool
    port: int
    directory: Path
    proc: ManagedProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return self.kind if self.routing else f"{self.kind} (round robin)"

    def log_tail(self, lines: int = 30) -> str:
        return self.proc.log_tail(lines)

    def stop(self) -> None:
        self.proc.stop()


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def start_balancer(kind: str, procs: ProcessSet, work: Path, *, instances: Sequence[str],
                   kvroute: str, deadline_ms: int | None = None, routing: bool = True,
                   env: dict[str, str] | None = None, label: str = "",
                   timeout: float = 30.0, attempts: int = 5) -> Balancer:
    """Start ``kind`` ("nginx" or "haproxy") with the shipped files in a directory of its
    own under ``work``, in front of ``instances`` (base URLs) asking ``kvroute`` (base URL).
    ``env`` is added to the process's environment (KVROUTE_API_TOKEN, say). The port is
    picked just before starting; a port taken in between is retried with another one."""
    if kind not in KINDS:
        raise ValueError(f"unknown balancer {kind!r}")
    path = binary(kind)
    if path is None:
        raise BalancerError(f"{kind} is not installed")
    last = ""
    for _attempt in range(attempts):
        port = free_port()
        directory = work / f"{kind}{'-' + label if label else ''}-{port}"
        directory.mkdir(parents=True, exist_ok=True)
        if kind == "nginx":
            conf = directory / "nginx.conf"
            conf.write_text(render_nginx(port, instances, kvroute, deadline_ms, routing))
            shutil.copy(DEPLOY / "nginx" / "kvroute.js", directory / "kvroute.js")
            argv = [path, "-p", str(directory), "-c", str(conf), "-e", "stderr",
                    "-g", "daemon off;"]
        else:
            conf = directory / "haproxy.cfg"
            conf.write_text(render_haproxy(port, instances, kvroute, deadline_ms, routing))
            shutil.copy(DEPLOY / "haproxy" / "kvroute.lua", directory / "kvroute.lua")
            argv = [path, "-f", str(conf), "-db"]
        proc_env = {k: v for k, v in os.environ.items() if k != "KVROUTE_API_TOKEN"}
        proc_env.update(env or {})
        name = f"{kind}{'-' + label if label else ''}"
        proc = procs.start(ManagedProcess(name, argv, proc_env, directory / f"{kind}.log"))
        deadline = time.monotonic() + timeout
        while True:
            code = proc.exited()
            if code is not None:
                last = proc.log_tail(20)
                break
            if _listening(port):
                return Balancer(kind, routing, port, directory, proc)
            if time.monotonic() > deadline:
                proc.stop()
                raise BalancerError(f"{name} did not listen on 127.0.0.1:{port} within "
                                    f"{timeout:.0f}s; log:\n{proc.log_tail(20)}")
            time.sleep(0.05)
        proc.stop()
        if "in use" not in last.lower():  # only a port taken in between is worth a retry
            raise BalancerError(f"{name} exited with code {code}; log:\n{last}")
    raise BalancerError(f"{kind}: no free port after {attempts} attempts; last log:\n{last}")
