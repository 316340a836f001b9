"""gyrfalcon.bench.server_proc.running_server: a benchmark's server process is up once
/health answers, gone after the block, and a server that dies at start-up is an error
with its log's tail."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gyrfalcon.bench.server_proc import healthy, running_server
from gyrfalcon.utils import free_port

# NOTE: answers /health after a moment, as a server does once it has loaded
HEALTH_SERVER = """
import http.server, os, sys, time
time.sleep(0.3)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(os.environ["PYTHONPATH"].split(os.pathsep)[0].encode())
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_running_server_waits_for_health_and_stops_the_process(tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-c", HEALTH_SERVER, str(port)]
    with running_server(cmd, port, tmp_path / "log", 30.0, tmp_path / "tree", 0.05) as url:
        assert healthy(url) and url == f"http://127.0.0.1:{port}"
        import urllib.request

        with urllib.request.urlopen(f"{url}/health") as response:  # NOTE: the tree first
            assert response.read().decode() == str(tmp_path / "tree")
    assert not healthy(url)


def test_a_server_that_dies_at_start_up_is_an_error_with_its_log(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3:\nno model here"):
        with running_server(cmd, free_port(), tmp_path / "log", 30.0, poll_s=0.05):
            pass
