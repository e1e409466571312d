"""Records the replies of the real engine servers that tests/test_engines.py parses (tests/data/engines/): run once
where `make engines` installed them, `python -m tests.record_engines [llama.cpp|vllm]`. Each file holds a streamed
reply's events, their arrival times, and the token ids the server's own non-streamed reply to the same request gave
(what the adapter must read from the stream)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sdbench.data.tasks import encode_prompt, load_prompts
from sdbench.models.loading.loader import load_tokenizer
from sdbench.servers.client import get, post_stream
from sdbench.servers.engines import EngineRole
from sdbench.servers.known import engine
from sdbench.servers.process import Server

OUT = Path(__file__).parent / "data" / "engines"
TARGET = "smollm2-135m"


def _record(eng, role: EngineRole, name: str, prompt: list[int], metrics: bool = False) -> None:
    argv = eng.command(TARGET, role, "float32", 1024, 2)
    with Server(name, argv, Path("/tmp") / f"record-{name}.log", eng.health, env=eng.server_env(2)).start() as server:
        path, body = eng.request(prompt, 24)
        streamed = post_stream(server.url, path, body)
        whole = json.loads(_post(server.url, path, {**body, "stream": False}))
        expected = (whole.get("tokens") if "tokens" in whole
                    else [t for c in whole["choices"] for t in c.get("token_ids") or []])
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"{name}.json").write_text(json.dumps({"events": streamed.events, "times": streamed.times,
                                                      "seconds": streamed.seconds, "expected_tokens": expected},
                                                     indent=1))
        if metrics:
            (OUT / f"{name}-metrics.txt").write_text(get(server.url, "/metrics"))


def _post(url: str, path: str, body: dict) -> str:
    import urllib.request

    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return resp.read().decode()


def main(which: list[str]) -> None:
    prompt = encode_prompt(load_prompts("mt-bench", limit=1, seed=0)[0], load_tokenizer(TARGET))
    for name in which or ["llama.cpp", "vllm"]:
        eng = engine(name)
        tag = "llamacpp" if name == "llama.cpp" else name
        _record(eng, EngineRole("autoregressive"), f"{tag}-plain", prompt)
        _record(eng, EngineRole("draft", 4, TARGET), f"{tag}-draft", prompt, metrics=name == "vllm")


if __name__ == "__main__":
    main(sys.argv[1:])
