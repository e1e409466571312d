"""Independent references for the tests: transformers' own `generate` (plain, assisted, prompt lookup), tiny
models whose 1-D weights (norms, biases) are perturbed so that a runner that ignored them would differ, and the
kernel's own account of what a process's memory holds (`session_memory`)."""

from __future__ import annotations

import os

import torch

from tests.conftest import tiny_model


def perturbed(model, seed: int = 0, scale: float = 0.2):
    """Every 1-D weight moved off its initial value (norms from 1, biases from 0), in place; returns the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def tiny_pair(arch: str, seed: int = 0):
    """(target, draft) of one family, both perturbed; the draft is smaller and mostly disagrees."""
    return (perturbed(tiny_model(seed, arch=arch), seed + 100),
            perturbed(tiny_model(seed + 1, arch=arch, layers=1, hidden=32, heads=2, kv=1), seed + 101))


def hf_generate(model, prompt: list[int], max_new: int, eos: list[int] | tuple = (), **kwargs) -> list[int]:
    """transformers' greedy `generate` on one prompt (batch 1, no padding): the new token ids. kwargs pass on:
    `assistant_model=` (with `num_assistant_tokens=`) for assisted generation, `prompt_lookup_num_tokens=`."""
    ids = torch.tensor([prompt], device=model.device)
    eos = list(eos) or None
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                             eos_token_id=eos, pad_token_id=(eos or [0])[0], **kwargs)
    return out[0, len(prompt):].tolist()


def hf_assisted(model, assistant, prompt: list[int], max_new: int, gamma: int, eos=()) -> list[int]:
    """Assisted generation with a fixed lookahead of gamma drafted tokens (no schedule, no early stop)."""
    return hf_generate(model, prompt, max_new, eos, assistant_model=assistant, num_assistant_tokens=gamma,
                       num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)


def hf_lookup(model, prompt: list[int], max_new: int, gamma: int, eos=()) -> list[int]:
    return hf_generate(model, prompt, max_new, eos, prompt_lookup_num_tokens=gamma)


def tiny_model_dir(folder, arch: str = "llama", seed: int = 0, model=None):
    """A loadable model folder (`--target FOLDER`): a perturbed tiny model (or `model`, VOCAB tokens) and a
    word-level tokenizer whose words are w0, w1, ... (w-prefixed text encodes to known ids: id = 3 + the
    number; 0-2 are specials)."""
    model = perturbed(tiny_model(seed, arch=arch), seed + 100) if model is None else model
    model.generation_config.eos_token_id = 2
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


def word_tokenizer(size: int = 0, eos: bool = True):
    """A word-level tokenizer of `size` tokens (default VOCAB): the specials <unk>, <s>, </s>, then w0, w1, ...
    (eos False: </s> is no end-of-sequence token, so that decoding runs to its budget)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import VOCAB

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range((size or VOCAB) - len(specials))])}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>" if eos else None,
                                   unk_token="<unk>")


def tiny_text_model_dir(folder, seed: int = 0, **shape):
    """A loadable model folder whose tokenizer reads real text one character at a time (the specials, then space,
    newline, letters, digits and punctuation; other characters are <unk>), so the built-in data sets (MT-Bench,
    GSM8K, PG-19) encode to varied ids. `shape` passes on to tiny_model (layers, hidden, heads, kv)."""
    import string

    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import VOCAB

    specials = ["<unk>", "<s>", "</s>"]
    chars = list(" \n" + string.ascii_letters + string.digits + string.punctuation)[: VOCAB - len(specials)]
    backend = Tokenizer(BPE({t: i for i, t in enumerate(specials + chars)}, [], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()  # characters join back without spaces between them
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    model = perturbed(tiny_model(seed, **shape), seed + 100)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def tiny_cli_files(tmp_path, monkeypatch, prompts: list[str]) -> list[str]:
    """A tiny model folder and a CSV of `prompts` under tmp_path, the cache and the user's presets there too:
    the CLI's `--target FOLDER --dataset CSV`."""
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SDBENCH_CONFIG", str(tmp_path / "home"))
    tiny_model_dir(tmp_path / "tiny")
    (tmp_path / "p.csv").write_text("prompt\n" + "".join(f'"{p}"\n' for p in prompts))
    return ["--target", str(tmp_path / "tiny"), "--dataset", str(tmp_path / "p.csv")]


def session_memory(leader: int, kind: str = "Pss") -> int:
    """Bytes of memory the processes of a session hold, as the kernel counts them: PSS (shared pages split among the
    processes mapping them, here or elsewhere) or Rss (every page mapped, per process)."""
    found = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
            if int(stat[stat.rfind(")") + 2:].split()[3]) != leader:
                continue
            found += sum(int(line.split()[1]) * 1024 for line in open(f"/proc/{pid}/smaps_rollup")
                         if line.startswith(f"{kind}:"))
        except (OSError, ValueError, IndexError):
            continue
    return found
