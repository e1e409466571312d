"""A stand-in for an engine's server in tests: the vLLM-style OpenAI API (`--model MODEL --port P ...`) over
transformers' own greedy `generate`, so its tokens are the reference's. Unknown arguments are ignored. A request
with a temperature above 0 samples: `sample` (transformers' generate with do_sample, top-k off, after
torch.manual_seed of the request's seed).

FAKE_ENGINE_MODE: ok (default); never-ready (/health answers 503 for ever); exit (says a bind error and exits at
once); die-after:N (the process exits during its N+1-th completion).

With --enable-prefix-caching a request reuses the previous request's prompt of the same cache_salt up to their
common prefix in whole blocks of BLOCK tokens, as vLLM's cache does; every request's prefill is counted in /metrics
as vLLM counts it, with made-up seconds: STEP_S * (10 + tokens computed), so that a forward over k tokens costs
(10 + k) / 11 of a one-token forward."""

from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


BLOCK = 16
STEP_S = 0.01


def _computed(prompt: list[int], previous: list[int] | None) -> int:
    """Prompt tokens a prefix cache holding `previous` leaves to compute: at least the last one."""
    if previous is None:
        return len(prompt)
    common = next((i for i, (a, b) in enumerate(zip(prompt, previous)) if a != b), min(len(prompt), len(previous)))
    return max(len(prompt) - common // BLOCK * BLOCK, 1)


def _arg(argv: list[str], name: str, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


def sample(model, prompt: list[int], max_new: int, temperature: float, top_p: float, seed: int) -> list[int]:
    """A sampled request's new tokens: temperature and top-p alone, as vLLM samples unless asked for more."""
    import torch

    torch.manual_seed(seed)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=True,
                             temperature=temperature, top_p=top_p, top_k=0)
    return out[0, ids.shape[1]:].tolist()


def main(argv: list[str]) -> None:
    mode = os.environ.get("FAKE_ENGINE_MODE", "ok")
    port = int(_arg(argv, "--port"))
    if mode == "exit":
        print(f"error: couldn't bind to 127.0.0.1:{port}: Address already in use", flush=True)
        sys.exit(1)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_arg(argv, "--model")).eval()
    speculative = "--speculative-config" in argv
    gamma = json.loads(_arg(argv, "--speculative-config", "{}")).get("num_speculative_tokens", 0)
    caching = "--enable-prefix-caching" in argv
    state = {"completions": 0, "drafted": 0, "accepted": 0, "prefills": 0, "prefill_s": 0.0, "computed": 0,
             "cached": {}}
    die_after = int(mode.split(":")[1]) if mode.startswith("die-after:") else None

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path == "/health":
                self.send_response(503 if mode == "never-ready" else 200)
                self.end_headers()
            elif self.path == "/metrics":
                body = ("# HELP vllm:iteration_tokens_total\n"
                        f"vllm:request_prefill_time_seconds_sum{{engine=\"0\"}} {state['prefill_s']}\n"
                        f"vllm:request_prefill_time_seconds_count{{engine=\"0\"}} {state['prefills']}.0\n"
                        f"vllm:request_prefill_kv_computed_tokens_sum{{engine=\"0\"}} {state['computed']}.0\n")
                if speculative:
                    body += (f"vllm:spec_decode_num_draft_tokens_total{{engine=\"0\"}} {state['drafted']}.0\n"
                             f"vllm:spec_decode_num_accepted_tokens_total{{engine=\"0\"}} {state['accepted']}.0\n"
                             f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine=\"0\",position=\"0\"}} "
                             f"{state['accepted']}.0\n")
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body.encode())
            else:
                self.send_response(404)
                self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if die_after is not None and state["completions"] >= die_after:
                os._exit(3)
            state["completions"] += 1
            salt = body.get("cache_salt")
            computed = _computed(body["prompt"], state["cached"].get(salt) if caching else None)
            state["cached"][salt] = body["prompt"]
            ids = torch.tensor([body["prompt"]])
            if body.get("temperature", 0.0) > 0:
                out = sample(model, body["prompt"], body["max_tokens"], body["temperature"], body.get("top_p", 1.0),
                             body["seed"])
            else:
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=body["max_tokens"],
                                         do_sample=False)[0, ids.shape[1]:].tolist()
            if speculative:  # made-up counters, one round per gamma + 1 tokens, half the drafts accepted
                rounds = -(-len(out) // (gamma + 1))
                state["drafted"] += rounds * gamma
                state["accepted"] += rounds * gamma // 2
            state["prefills"] += 1
            state["prefill_s"] += STEP_S * (10 + computed)
            state["computed"] += computed
            self.send_response(200)
            if not body.get("stream"):
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                reply = {"choices": [{"index": 0, "text": "".join(f"<{t}>" for t in out), "token_ids": out}]}
                self.wfile.write(json.dumps(reply).encode())
                return
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for t in out:
                event = {"choices": [{"index": 0, "text": f"<{t}>", "token_ids": [t], "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
