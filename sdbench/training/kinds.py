"""The head kinds `train-head` fits, each registered once with what it is: its title, the kind-dependent options
it reads (`KIND_OPTIONS`) and what each sets for it, its default steps, whether it drafts a block, and the
architecture its config names. train-head's checks, its --help lines and its messages read this registry; the
trainees themselves are built in heads.py. Light: the command line imports it for its help."""

from __future__ import annotations

from dataclasses import dataclass, field

from sdbench.registry import Registry

# train-head's options whose use depends on the kind -> the TrainHeadConfig field each sets (None: not given). Every
# other option (--data, --minutes, --prompts, --max-new-tokens, --answers, --seed, --device, --dtype, --probe)
# shapes the data or the run, which every kind fits on alike.
KIND_OPTIONS = {"--steps": "steps", "--draft-vocab": "draft_vocab"}
DEFAULT_DRAFT_VOCAB = 8192
MIN_DRAFT_VOCAB = 2  # one token would be drafted every time
DRAFT_VOCAB = (f"tokens the head drafts over, the target's most chosen (0: all of them; by default "
               f"{DEFAULT_DRAFT_VOCAB} or all when the target has fewer)")
# what a kind without a draft vocabulary of its own drafts over, said when --draft-vocab is given for it
THROUGH_TARGET = "the target's vocabulary, through its own head"


@dataclass(frozen=True)
class HeadKind:
    """What one head kind is, for train-head."""

    title: str  # as help and messages name it, e.g. "EAGLE-3"
    default_steps: int
    options: dict[str, str] = field(default_factory=dict)  # KIND_OPTIONS it reads -> what each sets for it
    block: bool = False  # drafts a block in one forward (DFlash's layers): its config declares block_size
    architecture: str = ""  # the architecture its config names

    @property
    def draft_vocab(self) -> bool:
        """Drafts over a vocabulary of its own (the target's most chosen tokens) from EAGLE-3's three target states;
        else over the target's whole vocabulary through the target's own head, from its final-norm state."""
        return "--draft-vocab" in self.options


head_kinds: Registry[HeadKind] = Registry("head kind")


def _register(name: str, title: str, steps: str, default_steps: int, draft_vocab: bool, **kw) -> None:
    options = {"--steps": f"{steps} (default {default_steps})"}
    if draft_vocab:
        options["--draft-vocab"] = DRAFT_VOCAB
    head_kinds.add(name, HeadKind(title, default_steps, options, **kw), description=title)


_register("eagle3", "EAGLE-3", "unrolled training steps, the drafts per round its config declares", 3, True,
          architecture="Eagle3DraftModel")
_register("medusa", "Medusa-1", "heads, one draft each", 4, False, architecture="MedusaModel")
_register("peagle", "P-EAGLE", "parallel positions, the drafts of its one forward a round", 7, True,
          architecture="PEagleSpeculator")
_register("mtp", "MTP", "unrolled training steps, the drafts per round its config declares", 3, False,
          architecture="MTPDraftModel")
_register("dflash", "DFlash", "drafts per block, a block holding one more", 7, True, block=True,
          architecture="DFlashSpeculator")
_register("dspark", "DSpark", "drafts per block, a block holding one more", 7, True, block=True,
          architecture="DSparkSpeculator")


def head_kind(name: str) -> HeadKind:
    return head_kinds.get(name)


def users(option: str) -> list[str]:
    """The kinds that read `option` (one of KIND_OPTIONS)."""
    return [e.name for e in head_kinds if option in e.target.options]


def either(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


def kind_help() -> str:
    return "the head to fit: " + either([f"{e.name} ({e.target.title})" for e in head_kinds])


def option_help(option: str) -> str:
    """An option's --help text: what it sets for each kind that reads it, and which kinds refuse it."""
    meanings: dict[str, list[str]] = {}
    for e in head_kinds:
        if option in e.target.options:
            meanings.setdefault(e.target.options[option], []).append(e.target.title)
    said = "; ".join(f"{', '.join(titles)}: {meaning}" for meaning, titles in meanings.items())
    ignored = [e.name for e in head_kinds if option not in e.target.options]
    return said + (f"; refused for --kind {either(ignored)}" if ignored else "")


def unused_option(kind: str, given: dict[str, object]) -> str | None:
    """The one line refusing the first of `given` (KIND_OPTIONS -> value, None: not given) that `kind` does not
    read, or None."""
    declared = head_kind(kind)
    for option, value in given.items():
        if value is not None and option not in declared.options:
            why = f" ({kind} drafts over {THROUGH_TARGET})" if option == "--draft-vocab" else ""
            return f"{option} is for --kind {either(users(option))}, not {kind}{why}"
    return None
