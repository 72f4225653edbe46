"""A client generated from docs/openapi.json (openapi-python-client, as a user would run it)
registers an instance and routes a prompt against a real kvroute, with typed answers."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from kvroute.app.config import Settings
from kvroute.app.server import BackgroundServer
from kvroute.sim.cluster import SimCluster
from tests.support.paths import REPO
from tests.support.waiting import HTTP_TIMEOUT, scaled, wait_for

DOCUMENT = REPO / "docs" / "openapi.json"
PACKAGE = "kvroute_generated_client"


@pytest.fixture
def generated(tmp_path: Path) -> Iterator[ModuleType]:
    """The generated package, importable for the test and forgotten after it."""
    # Its post-generation hook formats with ruff, which sits beside this interpreter.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    made = subprocess.run(
        [Path(sys.executable).parent / "openapi-python-client", "generate", "--path",
         str(DOCUMENT), "--meta", "none", "--output-path", str(tmp_path / PACKAGE),
         "--fail-on-warning"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=scaled(120))
    assert made.returncode == 0, made.stdout + made.stderr
    assert "Warning" not in made.stdout + made.stderr, made.stdout + made.stderr
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [name for name in sys.modules if name.split(".")[0] == PACKAGE]:
            del sys.modules[name]


def test_a_generated_client_registers_an_instance_and_routes_a_prompt(generated: ModuleType):
    api = importlib.import_module(f"{PACKAGE}.api")
    models = importlib.import_module(f"{PACKAGE}.models")
    instances = importlib.import_module(f"{PACKAGE}.api.instances")
    for name in ("add_instance", "get_instance", "delete_instance"):
        importlib.import_module(f"{PACKAGE}.api.instances.{name}")
    route = importlib.import_module(f"{PACKAGE}.api.routing.route")
    assert api is not None

    token = "client-test-token"
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", tokenizer="instance",
                        api_token=token, placement_ttl=0.0)
    with SimCluster(n=1, block_size=16, num_blocks=64) as sim, \
            BackgroundServer(settings) as server, \
            generated.AuthenticatedClient(base_url=server.url, token=token,
                                          timeout=HTTP_TIMEOUT) as client:
        added = instances.add_instance.sync(
            client=client, body=models.InstanceConfig(url=sim.urls[0], id="gpu-a"))
        assert isinstance(added, models.InstanceDetail), added
        assert added.id == "gpu-a" and added.models == ["sim-model"]

        def live() -> bool:
            detail = instances.get_instance.sync(client=client, instance_id="gpu-a")
            return isinstance(detail, models.InstanceDetail) and detail.state == "live"

        wait_for(live, "the instance to go live")
        answer = route.sync(client=client, body=models.RouteRequest(
            prompt="the quick brown fox", model="sim-model", probe=True))
        assert isinstance(answer, models.RouteAnswer), answer
        assert (answer.instance, answer.url, answer.dp_rank) == ("gpu-a", sim.urls[0], 0)
        assert answer.prompt_tokens == len(b"the quick brown fox")  # a byte per token
        assert [score.instance for score in answer.scores] == ["gpu-a"]
        # Refusals come back typed too, with the field at fault.
        refused = route.sync(client=client, body=models.RouteRequest(
            token_ids=[1, 2, 3], candidates=["nope"]))
        assert isinstance(refused, models.Error), refused
        assert refused.field == "candidates" and refused.unknown == ["nope"]
        deleted = instances.delete_instance.sync(client=client, instance_id="gpu-a")
        assert isinstance(deleted, models.Deleted) and deleted.deleted == "gpu-a"
        wrong = generated.AuthenticatedClient(base_url=server.url, token="wrong",
                                              timeout=HTTP_TIMEOUT)
        with wrong:
            unauthorized = instances.get_instance.sync(client=wrong, instance_id="gpu-a")
        assert isinstance(unauthorized, models.Error)
        assert unauthorized.field == "authorization"
