"""A live `gyrfalcon serve` (SmolLM2, float32, CPU) shared by the e2e tests.

After every test the scheduler must report no leaked KV page and nothing running.
"""

from __future__ import annotations

import pytest
from server_util import start_server, stop_server, wait_drained


@pytest.fixture(scope="session")
def server(smollm2_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    # small pool on purpose: 64 concurrent streams must still all finish
    srv = start_server(smollm2_dir, log, "--num-kv-pages", "512", "--page-size", "16")
    yield srv
    code = stop_server(srv)
    assert code == 0, f"server exit code {code}:\n{srv.log()[-4000:]}"


@pytest.fixture
def client(server):
    from openai import OpenAI

    c = OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=300)
    yield c
    info = wait_drained(server)
    assert info["num_running"] == 0 and info["num_waiting"] == 0, info
    assert info["integrity_ok"], info
    assert info["num_free_pages"] == info["num_total_pages"], f"leaked KV pages: {info}"


@pytest.fixture
def model_name(client):
    return client.models.list().data[0].id
