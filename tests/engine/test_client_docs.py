"""docs/engine-client.md's examples run as written, in order, against a real service."""

from __future__ import annotations

import re
from pathlib import Path

from svc_thread import ServerThread

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine-client.md"


def test_engine_client_doc_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 5
    server = ServerThread().start()
    try:
        namespace: dict = {}
        for block in blocks:
            exec(compile(block.replace("127.0.0.1:50051", server.address), str(DOC), "exec"), namespace)
        assert namespace["current"].version == 1
        assert namespace["watcher"].version == 2 and namespace["watcher"].failed == 0
        assert namespace["reporter"].stats().accepted >= 2 and namespace["reporter"].stats().pending == 0
        assert namespace["phy2log"].shape == (4, 24) and namespace["published"].version == 2
    finally:
        server.stop()
