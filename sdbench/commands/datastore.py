"""`sdbench datastore build|list`: REST datastores, a corpus in the target's token ids with its suffix array.

The corpus is a data set's prompts with their own replies (`Prompt.reference`: ShareGPT's answers, GSM8K's
solutions, HumanEval's bodies), a book data set's excerpts, a prompt file (its reply column too), or a plain
text file. The prompts it holds are recorded, so that a run measured on them is told (drafting/datastore.py).
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sdbench.data import Prompt
from sdbench.data.books import plain_ids
from sdbench.data.files import SUFFIXES, is_prompt_file
from sdbench.data.specs import task_registry
from sdbench.data.tasks import load_prompts
from sdbench.drafting import datastore as D
from sdbench.errors import SdbenchError
from sdbench.models.loading import loader

TEXT_CHUNK = 4000  # characters: a text file is read as documents of about this size, cut between paragraphs


def documents(source: str, limit: int | None) -> tuple[list[str], list[str]]:
    """The texts to index from what --from names, and the ids of the data set prompts among them."""
    path = Path(source).expanduser()
    if source not in task_registry and path.is_file() and path.suffix.lower() not in SUFFIXES:
        return text_documents(path, limit), []
    if source not in task_registry and not path.exists() and is_prompt_file(source):
        raise SdbenchError(f"--from {source}: no such file")
    if source in task_registry and task_registry.get(source).kind == "retrieval":
        raise SdbenchError(f"--from {source}: a retrieval task's prompts are made per run; name its books instead")
    prompts = load_prompts(source, limit=limit)
    return [conversation(p) for p in prompts], [p.id for p in prompts]


def conversation(prompt: Prompt) -> str:
    """A prompt's text as the datastore holds it: its turns, then the data set's own reply when it has one."""
    return "\n\n".join([*prompt.turns, *([prompt.reference] if prompt.reference else [])])


def text_documents(path: Path, limit: int | None) -> list[str]:
    """A text file as documents of about TEXT_CHUNK characters, whole paragraphs each (`limit`: the first ones)."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise SdbenchError(f"--from {path}: cannot read it as UTF-8 text ({err})") from None
    docs, part = [], ""
    for para in text.split("\n\n"):
        part = f"{part}\n\n{para}" if part else para
        if len(part) >= TEXT_CHUNK:
            docs.append(part)
            part = ""
    docs += [part] if part.strip() else []
    if not docs:
        raise SdbenchError(f"--from {path}: holds no text")
    return docs[:limit] if limit is not None else docs


def build(name: str, source: str, target: str, limit: int | None, console: Console) -> Path:
    """Tokenize the corpus with the target's tokenizer, index it, and save it as datastore `name`."""
    D.check_name(name)
    if limit is not None and limit < 1:
        raise SdbenchError(f"--limit must be at least 1 (got {limit})")
    texts, prompt_ids = documents(source, limit)
    tokenizer = loader.load_tokenizer(target)
    ids = []
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        task = bar.add_task(f"tokenizing {source}", total=len(texts))
        for text in texts:
            ids.append(plain_ids(tokenizer, text))
            bar.advance(task)
    with console.status("indexing"):
        tokens, suffixes = D.index(ids)
    meta = D.DatastoreMeta(name, target, str(getattr(tokenizer, "name_or_path", "") or target),
                           D.vocab_hash(tokenizer), source, len(ids), sum(map(len, ids)), prompt_ids,
                           datetime.now(timezone.utc).isoformat(timespec="seconds"))
    folder = D.save(meta, tokens, suffixes)
    console.print(f"datastore {name}: {meta.documents} documents, {meta.tokens} tokens of {target}'s tokenizer "
                  f"-> {folder}\nuse it with `sdbench run --strategy rest --set datastore={name} --target {target}`",
                  highlight=False, soft_wrap=True)
    return folder


def show(console: Console) -> None:
    stores = D.known()
    if not stores:
        console.print(f"no datastores yet; build one with `{D.build_command('NAME', 'MODEL')}`", highlight=False)
        return
    table = Table(title="REST datastores")
    for col in ("name", "target", "from", "documents", "tokens", "prompts held", "built"):
        table.add_column(col)
    for m in stores:
        table.add_row(m.name, m.target, m.source, str(m.documents), str(m.tokens), str(len(m.prompt_ids)), m.created)
    console.print(table)
