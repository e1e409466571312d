"""MTP: the target's own multi-token-prediction module drafts as an EAGLE head does, from the target's final-norm
state (models/heads/mtp.py): a chain of gamma module steps, or a token tree (tree_topk, tree_shape, tree_dynamic).
The module is read from the target's own checkpoint (DeepSeek-V3, GLM-4.5 and MiMo ship one; mtp_native.py), or
from --head: a folder in the speculators format, or another checkpoint with a module of its own."""

from __future__ import annotations

from dataclasses import replace

from sdbench.errors import SdbenchError
from sdbench.strategies.eagle import HeadStrategy, check_width, eagle_head
from sdbench.strategies.spec import BuildContext, need_gamma, register


@register
class MTPStrategy(HeadStrategy):
    name = "mtp"
    help = ("the target's multi-token-prediction module (its own checkpoint's, or --head in the speculators format) "
            "drafting a chain from its final state, one module step per draft; tree_topk=K or tree_shape=... grows "
            "a token tree")
    head_kinds = ("mtp",)

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        if options.get("head"):
            return super().validate(gamma, options, drafts, sampling)
        need_gamma(cls.name, gamma)  # no --head: the target's own module, read once the target has loaded
        cls.tree(gamma, options)

    @classmethod
    def build(cls, ctx: BuildContext):
        if not ctx.options.get("head"):  # the target's own module: its checkpoint is the head's folder
            ctx = replace(ctx, options={**ctx.options, "head": own_checkpoint(ctx.target)})
        return super().build(ctx)

    @classmethod
    def drafter(cls, head, target, gamma: int, tree=None, options: dict | None = None):
        from sdbench.drafting.heads import EagleDrafter
        from sdbench.models.heads.mtp import MTPHead

        forward = eagle_head(head, target, MTPHead)
        check_width(head.name, tree, forward.vocab_size)
        return EagleDrafter(forward, head.name, head.layers, tree)


def own_checkpoint(target) -> str:
    """The folder (or hub id) the target loaded from, where its own MTP module is; one line where its config.json
    declares none (the library's config classes default num_nextn_predict_layers, so the file itself is read)."""
    source = str(getattr(getattr(target, "model", None), "name_or_path", "") or "")
    if not source or not declares_own_module(source, unknown=True):
        raise SdbenchError(f"strategy 'mtp': the target '{target.name}' has no MTP module of its own (its config "
                           "declares no num_nextn_predict_layers); give --head FOLDER (the speculators format; "
                           "train-head --kind mtp fits one)")
    return source


def declares_own_module(source: str, unknown: bool = False) -> bool:
    """Whether the model folder `source` declares an MTP module in its config.json (`unknown`: the answer for a
    source that is no local folder, such as a hub id, whose config is read when its weights are)."""
    import json
    from pathlib import Path

    from sdbench.models.heads.mtp_native import has_own_module

    path = Path(source).expanduser() / "config.json"
    if not path.is_file():
        return unknown
    try:
        return has_own_module(json.loads(path.read_text()))
    except ValueError:
        return False
