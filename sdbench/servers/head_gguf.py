"""A block drafter's head folder as the GGUF llama.cpp's `draft-dflash` and `draft-dspark` load, and a model folder as the
GGUF its server loads (`model_gguf`: an MTP module's layers kept, for `draft-mtp`), written by llama.cpp's
own converter (`convert_hf_to_gguf.py` in the source `make engine-llama.cpp` unpacks) and kept in sdbench's cache by
the head's and the target's files.

The converter reads z-lab's folders (`DFlashDraftModel`, `DFlash2DraftModel`) as they are, and speculators' DSpark
folders (`DSparkSpeculator`); a speculators DFlash or DFlash 2 folder holds the same tensors under the same names
and is given to it as a DSpark folder without a Markov head, its layer ids and mask token (and DFlash 2's settings)
in the `dflash_config` the converter reads. The target's own folder (config and tokenizer: a GGUF target's
de-quantised copy, a local folder, a hub snapshot) gives the vocabulary, as `--target-model-dir`."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from sdbench.errors import SdbenchError
from sdbench.paths import cache_dir

SPECULATORS = ("dflash", "dflash2", "dspark")  # speculators_model_type values the converter is given
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def staged_config(config: dict) -> dict:
    """The config the converter is given for a head folder's config.json (z-lab's: as it is)."""
    kind = config.get("speculators_model_type")
    if kind not in SPECULATORS:
        return config
    layer = {k: v for k, v in (config.get("transformer_layer_config") or {}).items() if k != "architectures"}
    extra = {"mask_token_id": config.get("mask_token_id"),
             "target_layer_ids": [i - 1 for i in config.get("aux_hidden_state_layer_ids") or []],
             **{k: config[k] for k in DFLASH2_KEYS if kind == "dflash2" and k in config}}
    return {**config, "architectures": ["DSparkSpeculator"], "transformer_layer_config": layer,
            "dflash_config": extra, "sample_from_anchor": bool(config.get("sample_from_anchor", kind == "dspark"))}


def refusal(folder: str | Path) -> str | None:
    """Why llama.cpp cannot run the head in `folder` (a config.json and safetensors its converter reads), or None."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return f"a head for llama.cpp is a local folder with its config.json (--head DIR), got {str(folder)!r}"
    if not any(folder.glob("*.safetensors")):
        return f"{folder} holds no *.safetensors (llama.cpp's converter reads those)"
    try:
        config = json.loads((folder / "config.json").read_text())
    except ValueError as err:
        return f"{folder}/config.json is not JSON ({err})"
    if config.get("speculators_model_type") == "dspark" and config.get("markov_head_type", "vanilla") != "vanilla":
        return (f"llama.cpp's converter reads DSpark heads with a vanilla Markov head only (this one's is "
                f"{config['markov_head_type']})")
    return None


def head_gguf(head: str | Path, target_dir: str | Path, source: Path) -> Path:
    """The head folder's GGUF (float32), converted once; `source`: llama.cpp's unpacked source, `target_dir` the
    target's folder (config and tokenizer)."""
    head, target_dir = Path(head), Path(target_dir)
    weights = _weights(head)
    config = json.loads((head / "config.json").read_text())
    out = cache_dir("engines", "heads") / f"{head.name}-{_key(config, weights, str(target_dir.resolve()))}.gguf"
    if out.is_file():
        return out
    stage = out.with_suffix(".stage")
    stage.mkdir(parents=True, exist_ok=True)
    (stage / "config.json").write_text(json.dumps(staged_config(config)))
    for w in weights:
        (stage / w.name).unlink(missing_ok=True)
        (stage / w.name).symlink_to(w.resolve())
    return _converted(stage, out, source, ["--target-model-dir", str(target_dir)], f"the head {head}")


def model_gguf(folder: str | Path, source: Path) -> Path:
    """A model folder (config, safetensors, tokenizer) as the float32 GGUF llama.cpp serves, converted once by its
    own converter; the layers of an MTP module the checkpoint ships are kept (`draft-mtp` reads them)."""
    folder = Path(folder)
    weights = _weights(folder)
    out = cache_dir("engines", "gguf") / \
        f"{folder.name}-{_key(json.loads((folder / 'config.json').read_text()), weights, '')}-F32.gguf"
    return out if out.is_file() else _converted(folder, out, source, [], f"the model {folder}")


def _weights(folder: Path) -> list[Path]:
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise SdbenchError(f"llama.cpp: {folder} holds no *.safetensors (its converter reads those)")
    return weights


def _key(config: dict, weights: list[Path], more: str) -> str:
    """A folder's cache key: its config and its weight files' sizes and times."""
    return hashlib.sha256(json.dumps([config, [(w.name, w.stat().st_size, w.stat().st_mtime_ns) for w in weights],
                                      more], sort_keys=True).encode()).hexdigest()[:16]


def _converted(folder: Path, out: Path, source: Path, extra: list[str], what: str) -> Path:
    """`folder` converted by llama.cpp's convert_hf_to_gguf.py (float32) into `out`, written under another name and
    renamed into place; its last line of complaint where it fails."""
    part = out.with_suffix(".part")
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    done = subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder), *extra, "--outtype",
                           "f32", "--outfile", str(part)], capture_output=True, text=True, env=env)
    if done.returncode != 0 or not part.is_file():
        said = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()]
        part.unlink(missing_ok=True)
        raise SdbenchError(f"llama.cpp's convert_hf_to_gguf.py could not convert {what}: "
                           f"{said[-1] if said else done.returncode}")
    part.rename(out)
    return out
