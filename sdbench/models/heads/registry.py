"""The heads sdbench fitted (`train-head`), found again by target: each head's folder holds `sdbench_head.json`
(its target, kind and the prompts it was trained on), and the user's configuration keeps an index of the folders
(`heads.json`), so that `list models` shows a target's heads and `tune` can choose among them.

A head folder written elsewhere (speculators, the EAGLE repository) has no record: it runs with --head like any
other and simply has no training prompts to warn about."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sdbench.models.loading.aliases import model_registry
from sdbench.paths import config_dir

RECORD = "sdbench_head.json"


@dataclass
class HeadRecord:
    """What train-head writes beside a head's weights."""

    target: str  # the target as the user named it
    kind: str  # a head kind train-head fits (training/kinds.py)
    trained_on: dict[str, list[str]] = field(default_factory=dict)  # data set -> the ids of its prompts used
    draft_vocab: int | None = None
    steps: int = 0
    heldout_acceptance: float | None = None  # mean accepted length τ on held-out answers, at the last evaluation
    created: str = ""
    env: dict = field(default_factory=dict)  # sdbench commit, torch, device, dtype
    target_weights: dict = field(default_factory=dict)  # fitted on: GGUF file, size, sha256 | folder files | hub rev


def read_record(folder: str | Path) -> HeadRecord | None:
    """The record of a head train-head wrote (None for a head from elsewhere, or an unreadable record)."""
    path = Path(folder).expanduser() / RECORD
    try:
        data = json.loads(path.read_text())
        return HeadRecord(**{k: v for k, v in data.items() if k in HeadRecord.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return None


def write_record(folder: str | Path, record: HeadRecord) -> None:
    path = Path(folder) / RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record), indent=1))
    tmp.replace(path)
    _remember(Path(folder), record)


def _index_path() -> Path:
    return config_dir("heads.json")


def _read_index() -> list[dict]:
    try:
        entries = json.loads(_index_path().read_text())
        return [e for e in entries if isinstance(e, dict) and "path" in e]
    except (OSError, ValueError):
        return []


def _remember(folder: Path, record: HeadRecord) -> None:
    path = str(folder.resolve())
    entries = [e for e in _read_index() if e["path"] != path]
    entries.append({"path": path, "target": record.target, "kind": record.kind})
    index = _index_path()
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        index.write_text(json.dumps(entries, indent=1))
    except OSError:
        pass  # the index only helps list and tune find heads; --head PATH works without it


def known_heads(target: str | None = None) -> list[dict]:
    """The heads train-head wrote that still exist ({path, target, kind}), those of `target` when given (as the
    user named it, an alias and its model id being the same target)."""
    want = None if target is None else same_model(target)
    return [e for e in _read_index() if (Path(e["path"]) / RECORD).is_file()
            and (want is None or same_model(e.get("target", "")) == want)]


def same_model(name: str) -> str:
    """One name per model: an alias (or a second alias of it) as its registered name, any other name as given."""
    return model_registry.entry(name).name if name in model_registry else name


def trained_on_note(head: str, prompt_ids: list[str]) -> str | None:
    """One line when a head train-head fitted is measured on prompts it was trained on (None otherwise)."""
    record = read_record(head) if head else None
    if record is None:
        return None
    seen = {i for ids in record.trained_on.values() for i in ids}
    both = [i for i in prompt_ids if i in seen]
    if not both:
        return None
    return (f"--head {head} was trained on {len(both)} of these {len(prompt_ids)} prompts (e.g. {both[0]}): its "
            f"acceptance on them overstates what unseen prompts get; measure it on another data set")
