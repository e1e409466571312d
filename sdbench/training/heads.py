"""What each head kind needs to be fitted and written: its trainee (eagle3.py, peagle.py, mtp.py, medusa.py,
dflash.py, dspark.py) built from the target, and its files in the format engines load (EAGLE-3, P-EAGLE, MTP,
DFlash, DSpark: the speculators format vLLM reads; Medusa-1: the Medusa repository's `config.json` + `medusa_lm_head.safetensors`)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import torch

from sdbench.engine.hidden import FINAL, eagle3_layers
from sdbench.models.loading.aliases import model_registry
from sdbench.models.loading.names import split_variant
from sdbench.training.data import Sequence
from sdbench.training.dflash import DFlashTrainee
from sdbench.training.dspark import DSparkTrainee
from sdbench.training.eagle3 import Eagle3Trainee
from sdbench.training.kinds import DEFAULT_DRAFT_VOCAB, head_kind
from sdbench.training.medusa import MedusaTrainee
from sdbench.training.mtp import MTPTrainee
from sdbench.training.peagle import PEagleTrainee

DFLASH_LAYERS = 2  # the draft decoder layers of a DFlash head fitted here
# A DFlash block's drafted slots start as the mask token's embedding, whose own logit dominates under tied
# embeddings, and an MTP module's random layer starts far from any state the target's head reads: their final norm
# starts at this fraction of the target's, so that their first predictions are near uniform rather than confidently
# wrong (the loss then falls from ~10 instead of ~17-90).
NORM_START = {"dflash": 0.1, "dspark": 0.1, "mtp": 0.1}


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def head_layers(kind: str, config) -> tuple[int, ...]:
    """The target states the head reads (engine/hidden.py numbering): EAGLE-3's usual three where they are
    distinct (vLLM and speculators refuse repeated ones), else three distinct ones spread over a shallow target."""
    if not head_kind(kind).draft_vocab:  # drafting through the target's head: its final-norm state (HeadKind)
        return (FINAL,)
    L = text_config(config).num_hidden_layers
    usual = eagle3_layers(L)
    if len(set(usual)) == 3 and min(usual) >= 0:
        return usual
    spread = sorted({min(L, max(0, round(L * f))) for f in (0.25, 0.5, 0.75)})
    spread += [i for i in range(L + 1) if i not in spread][: 3 - len(spread)]
    return tuple(sorted(spread))


def layer_config(config, kind: str = "eagle3"):
    """The head's decoder layers' config at the target's attention shape and rope: EAGLE-3's one Llama layer,
    DFlash's DFLASH_LAYERS Qwen3 layers, an MTP module's one Qwen3 layer (speculators' MTP layer type; its
    num_hidden_layers the target's, whose last state it reads)."""
    from transformers import LlamaConfig, Qwen3Config  # slow to import: only a fit builds one

    tc = text_config(config)
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    if "rope_type" not in rope:  # keyed per layer type (sliding/full): the full-attention layers' rope
        rope = dict(rope.get("full_attention") or {"rope_type": "default", "rope_theta": 10000.0})
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    cls, layers = {"mtp": (Qwen3Config, tc.num_hidden_layers)}.get(
        kind, (Qwen3Config, DFLASH_LAYERS) if head_kind(kind).block else (LlamaConfig, 1))
    return cls(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
               num_hidden_layers=layers, num_attention_heads=tc.num_attention_heads,
               num_key_value_heads=tc.num_key_value_heads or tc.num_attention_heads, head_dim=head_dim,
               rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
               max_position_embeddings=tc.max_position_embeddings, rope_parameters=rope,
               tie_word_embeddings=False, initializer_range=0.02)


def draft_size(asked: int | None, vocab: int) -> int:
    """The draft vocabulary's size for --draft-vocab `asked` (None: the default; 0: the target's), at most the
    target's `vocab`."""
    return min(DEFAULT_DRAFT_VOCAB if asked is None else (asked or vocab), vocab)


def draft_vocab_note(asked: int | None, vocab: int) -> str | None:
    """The one line that says --draft-vocab was capped at the target's vocabulary, or None when it was not."""
    if not asked or asked <= vocab:
        return None
    return f"note: --draft-vocab {asked} is more than the target's {vocab} tokens: the head drafts over all {vocab}"


def draft_vocabulary(seqs: list[Sequence], vocab: int, size: int) -> torch.Tensor:
    """The `size` target tokens the target chooses most often in the data (ties: lower id), ascending."""
    if size >= vocab:
        return torch.arange(vocab)
    counts = Counter()
    for s in seqs:
        counts.update(s.pred.tolist())
    ranked = sorted(range(vocab), key=lambda t: (-counts.get(t, 0), t))[:size]
    return torch.tensor(sorted(ranked))


def build(kind: str, model, seqs: list[Sequence], steps: int, draft_vocab: int | None, seed: int = 0):
    """A fresh trainee for the loaded library model `model` (its embedding and head are read, not changed), its
    random start drawn from `seed` alone (the global generator is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "medusa":
            return rebuild(kind, model, steps, None)
        vocab = text_config(model.config).vocab_size
        ids = draft_vocabulary(seqs, vocab, draft_size(draft_vocab, vocab)) if head_kind(kind).draft_vocab else None
        trainee = rebuild(kind, model, steps, ids)
    norm = getattr(model.get_decoder(), "norm", None)
    if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape == trainee.norm.shape:
        with torch.no_grad():  # its lm_head starts as the target's over the target's final norm
            trainee.norm.copy_(norm.weight.detach().float().cpu() * NORM_START.get(kind, 1))
    return trainee


def rebuild(kind: str, model, steps: int, draft_ids: torch.Tensor | None):
    """The trainee over `model`'s embedding and head with a given draft vocabulary (a checkpoint's, as saved),
    fitted over `steps` (--steps): the drafts per round its config declares (`drafts_per_round`)."""
    trainee = _trainee(kind, model, steps, draft_ids)
    trainee.drafts_per_round = steps
    return trainee


def _trainee(kind: str, model, steps: int, draft_ids: torch.Tensor | None):
    out = model.get_output_embeddings().weight.detach().float().cpu().clone()  # copies: the model's may be
    if kind == "medusa":  # inference tensors
        return MedusaTrainee(out, steps)
    emb = model.get_input_embeddings().weight.detach().float().cpu().clone()
    if kind == "mtp":
        return MTPTrainee(layer_config(model.config, kind), emb, out)
    n_states = len(head_layers(kind, model.config))
    if head_kind(kind).block:
        trainee = DSparkTrainee if kind == "dspark" else DFlashTrainee
        return trainee(layer_config(model.config, kind), emb, draft_ids, out[draft_ids], n_states,
                       mask_token_id=emb.shape[0] - 1, block_size=steps + 1)
    if kind == "peagle":
        return PEagleTrainee(layer_config(model.config), emb, draft_ids, out[draft_ids], n_states=n_states,
                             mask_token_id=emb.shape[0] - 1)
    return Eagle3Trainee(layer_config(model.config), emb, draft_ids, out[draft_ids], n_states=n_states)


def verifier_name(loaded) -> str | None:
    """The target as the head's config names it for engines and speculators, which load it by that name: a hub
    id (an alias's; an embedded GGUF's model on the hub) or the user's own model folder. None where no name
    loads the weights fitted on (a GGUF file of the user's, a @random model): never a GGUF or a cache path.
    sdbench itself finds the target from --target; the exact weights fitted on are in the record (`target_weights`)."""
    if loaded.source in ("hub", "local"):
        return loaded.ref
    if loaded.source == "embedded":
        return model_registry.entry(split_variant(loaded.name)[0]).target.repo_id
    return None


def target_weights(loaded) -> dict:
    """The exact weights a head is fitted on, for its record: a GGUF's file name, size and sha256; a folder's name
    and its weight files and their sizes; a hub model's id and revision; a @random model's name."""
    if loaded.source in ("embedded", "gguf"):
        path = Path(loaded.ref)
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
        return {"source": loaded.source, "file": path.name, "size": path.stat().st_size, "sha256": digest.hexdigest()}
    if loaded.source == "local":
        files = {p.name: p.stat().st_size for p in sorted(Path(loaded.ref).iterdir())
                 if p.suffix in (".safetensors", ".bin", ".pt")}
        return {"source": "local", "folder": Path(loaded.ref).name, "files": files}  # its name: no path of this machine
    if loaded.source == "hub":
        return {"source": "hub", "repo_id": loaded.ref, "revision": getattr(loaded.model.config, "_commit_hash", None)}
    return {"source": loaded.source, "name": loaded.name}


def write_head(folder: Path, kind: str, trainee, model, verifier: str | None, dtype: torch.dtype) -> list[Path]:
    """The head's config and weights in the format engines load, naming `verifier` (`verifier_name`) as the
    target; returns the files written."""
    from safetensors.torch import save_file

    weights = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in trainee.weights().items()}
    tc = text_config(model.config)
    if kind == "medusa":
        config = {"medusa_num_heads": trainee.n_heads, "medusa_num_layers": trainee.depth,
                  "hidden_size": tc.hidden_size, "vocab_size": tc.vocab_size,
                  "base_model_name_or_path": verifier, "architectures": [head_kind(kind).architecture]}
        name = "medusa_lm_head.safetensors"
    else:
        config = {**speculators_config(kind, trainee, model, verifier, dtype), **_own_keys(kind, trainee, model)}
        if head_kind(kind).draft_vocab and not head_kind(kind).block:  # EAGLE-3's kinds carry the embedding
            weights["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().to(dtype).cpu().contiguous()
        name = "model.safetensors"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (name + ".tmp")
    save_file(weights, str(tmp))
    tmp.replace(folder / name)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return [folder / "config.json", folder / name]


def _own_keys(kind: str, trainee, model) -> dict:
    """The speculators config keys of a head's own kind."""
    if kind == "mtp":  # the embedding and head are the target's: not written
        return {"architectures": [head_kind(kind).architecture], "num_nextn_predict_layers": 1}
    layers = list(head_layers(kind, model.config))
    if head_kind(kind).block:  # the embedding and a full-vocabulary head are the target's: not written
        keys = {"architectures": [head_kind(kind).architecture],
                "block_size": trainee.block_size, "aux_hidden_state_layer_ids": layers,
                "mask_token_id": trainee.mask_token_id, "sample_from_anchor": False, "sliding_window_non_causal": False}
        if kind == "dspark":
            keys.update({"markov_rank": trainee.rank, "markov_head_type": "vanilla", "enable_confidence_head": True,
                         "confidence_head_with_markov": True})
        return keys
    keys = {"architectures": [head_kind(kind).architecture], "norm_before_residual": False, "norm_before_fc": False,
            "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
            "eagle_aux_hidden_state_layer_ids": layers}
    return {**keys, "mask_token_id": trainee.mask_token_id} if kind == "peagle" else keys


def speculators_config(kind: str, trainee, model, verifier: str | None, dtype: torch.dtype) -> dict:
    """What every head in the speculators format records alike (its kind adds its own keys): the layers' config,
    the draft vocabulary's size, the proposal (the drafts per round it was fitted for: --steps, as speculators
    writes its training steps, P-EAGLE's depths and a block's drafts) and the verifier."""
    layer = trainee.layer_config.to_dict()
    layer.pop("transformers_version", None)
    drafts = trainee.drafts_per_round
    vocab = {"draft_vocab_size": int(len(trainee.draft_ids)), "target_hidden_size": None,
             "tie_word_embeddings": False} if head_kind(kind).draft_vocab else {}
    return {"speculators_model_type": kind, **vocab, "transformer_layer_config": layer,
            "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafts,
                                                         "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                   "verifier": {"name_or_path": verifier,
                                                "architectures": list(model.config.architectures or [])}},
            "dtype": str(dtype).removeprefix("torch.")}
