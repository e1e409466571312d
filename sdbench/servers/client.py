"""An engine's HTTP API from the standard library: a streamed POST whose server-sent events are timed as they
arrive, a plain POST, and plain GETs (health, metrics)."""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from sdbench.errors import SdbenchError


class EngineReplyError(SdbenchError):
    """The engine answered a request with an error, or the connection broke."""

    exit_code = 1


@dataclass
class Streamed:
    """One streamed request: the events' JSON payloads, and when each arrived (seconds after the request was sent)."""

    events: list[dict]
    times: list[float]
    seconds: float  # request sent -> the stream's end


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SdbenchError(f"engine URL '{url}': give http://HOST:PORT")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return kind(parts.hostname, parts.port, timeout=timeout), parts.path.rstrip("/")


def reachable(url: str, path: str, timeout: float = 2.0) -> bool:
    """GET url+path answers 200."""
    try:
        conn, base = _connection(url, timeout)
        try:
            conn.request("GET", base + path)
            return conn.getresponse().status == 200
        finally:
            conn.close()
    except (OSError, http.client.HTTPException):
        return False


def _request(method: str, url: str, path: str, body: dict | None, timeout: float) -> str:
    """One request's reply body as text, read whole; EngineReplyError on a failure or a status other than 200."""
    try:
        conn, base = _connection(url, timeout)
        try:
            if body is None:
                conn.request(method, base + path)
            else:
                conn.request(method, base + path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            text = resp.read().decode("utf-8", errors="replace")
        finally:
            conn.close()
    except (OSError, http.client.HTTPException) as err:
        raise EngineReplyError(f"{method} {url}{path}: the connection broke: {err or type(err).__name__}") from None
    if resp.status != 200:
        raise EngineReplyError(f"{method} {url}{path}: HTTP {resp.status}: {_error_text(text)}")
    return text


def get(url: str, path: str, timeout: float = 30.0) -> str:
    """GET url+path's body as text; EngineReplyError on a failure."""
    return _request("GET", url, path, None, timeout)


def post_json(url: str, path: str, body: dict, timeout: float = 600.0) -> dict:
    """POST body as JSON and return the reply's JSON object (a request that is not streamed)."""
    return _json(_request("POST", url, path, body, timeout), url, path)


def post_stream(url: str, path: str, body: dict, timeout: float = 600.0) -> Streamed:
    """POST body as JSON and read the reply's server-sent events (`data: {...}` lines, up to `data: [DONE]` or the
    stream's end), timing each event on arrival."""
    events, times = [], []
    try:
        conn, base = _connection(url, timeout)
        try:
            t0 = time.perf_counter()
            conn.request("POST", base + path, body=json.dumps(body),
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise EngineReplyError(f"POST {url}{path}: HTTP {resp.status}: "
                                       f"{_error_text(resp.read().decode('utf-8', errors='replace'))}")
            for raw in resp:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith(("data:", "error:")):
                    continue
                payload = line.split(":", 1)[1].strip()
                if payload == "[DONE]":
                    break
                event = _json(payload, url, path)
                if line.startswith("error:") or "error" in event and not event.get("choices"):
                    raise EngineReplyError(f"POST {url}{path}: {_error_text(payload)}")
                events.append(event)
                times.append(time.perf_counter() - t0)
            seconds = time.perf_counter() - t0
        finally:
            conn.close()
    except (OSError, http.client.HTTPException) as err:
        raise EngineReplyError(f"POST {url}{path}: the connection broke: {err or type(err).__name__}") from None
    return Streamed(events, times, seconds)


def _json(payload: str, url: str, path: str) -> dict:
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        raise EngineReplyError(f"POST {url}{path}: an event that is not JSON: {payload[:120]}") from None
    if not isinstance(event, dict):
        raise EngineReplyError(f"POST {url}{path}: an event that is not a JSON object: {payload[:120]}")
    return event


def _error_text(body: str) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the body's first line."""
    try:
        err = json.loads(body).get("error")
    except (json.JSONDecodeError, AttributeError):
        return body.strip().splitlines()[0][:300] if body.strip() else "no body"
    if isinstance(err, dict):
        return str(err.get("message", err))[:300]
    return str(err)[:300]
