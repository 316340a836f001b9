"""The server with decode through the graph runner's padded static buffers (the
CPU stand-in for CUDA graphs) answers exactly like the eager server."""

import asyncio

import pytest
from server_util import start_server, stop_server, wait_drained

PROMPTS = [f"Count from {i} to {i + 4}." for i in range(5)]


@pytest.fixture(scope="module")
def graph_server(smollm2_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("graph-server") / "server.log")
    srv = start_server(
        smollm2_dir, log, "--num-kv-pages", "256", "--static-graph-replay",
        "--cuda-graph-max-bs", "8", "--cuda-graph-bs", "2,4",
    )  # fmt: skip
    yield srv
    assert stop_server(srv) == 0, srv.log()[-3000:]


async def complete_all(base_url, model):
    from openai import AsyncOpenAI

    ac = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
    try:
        rs = await asyncio.gather(*(
            ac.chat.completions.create(
                model=model, messages=[{"role": "user", "content": p}], temperature=0,
                max_tokens=12,
            )
            for p in PROMPTS
        ))  # fmt: skip
    finally:
        await ac.close()
    return [r.choices[0].message.content for r in rs]


def test_padded_static_replay_matches_eager_server(server, graph_server, model_name):
    # 5 concurrent requests decode as batches padded to 8 (and 4, 2 as they finish)
    got = asyncio.run(complete_all(graph_server.base_url, model_name))
    want = asyncio.run(complete_all(server.base_url, model_name))
    assert got == want and all(got)
    info = wait_drained(graph_server)
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"]
