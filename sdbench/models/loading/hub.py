"""The Hugging Face hub, never waited on: the local cache first, the network only after one short probe, and a
model that is in neither refused in one line that says how to get it."""

from __future__ import annotations

import difflib
import functools
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from safetensors import SafetensorError

from sdbench.errors import SdbenchError
from sdbench.models.loading import library
from sdbench.models.loading.aliases import model_registry

PROBE_TIMEOUT_S = 3.0

def from_hub(name: str, repo_id: str, load: Callable[[bool], Any]) -> Any:
    """`load(local_files_only)`: the local HF cache first, the network only if allowed and reachable."""
    label = f"'{name}'" if name == repo_id else f"'{name}' ({repo_id})"
    try:
        return load(True)
    except OSError:
        pass  # not in the local cache
    except (ValueError, KeyError, SafetensorError) as err:
        raise SdbenchError(f"model {label} could not be loaded: {library.first_line(err)}") from err
    if offline():
        _raise_unavailable(name, label, repo_id, "HF_HUB_OFFLINE is set")
    if not reachable(endpoint()):
        _raise_unavailable(name, label, repo_id, "the hub is unreachable")
    try:
        return load(False)
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        raise SdbenchError(f"model {label} could not be fetched from the hub: {library.first_line(err)}") from err


def snapshot(repo_id: str) -> Path:
    """The folder of a hub repository's newest snapshot (a trained head's): the local cache first."""
    from huggingface_hub import snapshot_download  # slow to import; only a hub head needs it

    return Path(from_hub(repo_id, repo_id, lambda local: snapshot_download(repo_id, local_files_only=local)))


def _raise_unavailable(name: str, label: str, repo_id: str, why: str) -> None:
    hint = ""
    if name not in model_registry and "/" not in name:
        close = _close_alias(name)
        hint = f" (did you mean '{close}'?)" if close else ""
    raise SdbenchError(
        f"model {label} is not available{hint}: not in the local Hugging Face cache and {why}; "
        f"on a machine with access run `hf download {repo_id}`, or pass a local folder"
    )


def _close_alias(name: str) -> str | None:
    close = difflib.get_close_matches(name.lower(), model_registry.names(), n=1)
    return close[0] if close else None


def offline() -> bool:
    # Read at call time: huggingface_hub reads HF_HUB_OFFLINE once, at import.
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(f.strip().lower() in ("1", "true", "yes", "on") for f in flags)


def endpoint() -> str:
    from huggingface_hub import constants  # huggingface_hub: slow to import, and only the hub path needs it

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


@functools.lru_cache(maxsize=8)
def reachable(endpoint: str) -> bool:
    """One short probe: a failing hub download otherwise retries for ~25-45 s before giving up."""
    request = urllib.request.Request(endpoint, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S):
            return True
    except urllib.error.HTTPError:
        return True  # it answered
    except (OSError, ValueError):
        return False


def available(repo_id: str) -> tuple[bool, str]:
    from huggingface_hub import try_to_load_from_cache  # huggingface_hub: slow to import; only a hub model needs it

    config = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(config, str):
        snapshot = Path(config).parent
        if any(snapshot.glob("*.safetensors")) or any(snapshot.glob("*.bin")):
            return True, f"in the Hugging Face cache ({repo_id})"
    return False, f"not in the Hugging Face cache: `hf download {repo_id}`"
