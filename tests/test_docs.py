"""The docs cannot drift from the code: every `sdbench …` line in README.md and docs/*.md (and every `make`
line, through the Makefile's own recipe) parses against the real command line without running it; every
relative link and #anchor resolves by GitHub's heading rules; and every option a command's --help lists is in
docs/commands.md under that command, with the default --help states. Reads files and parses arguments only."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer

from sdbench.cli import app

try:  # typer >= 0.2x carries its own copy of click
    from typer._click import exceptions as click_errors
except ImportError:  # older typer: click itself
    import click.exceptions as click_errors

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS_PAGE = ROOT / "docs" / "commands.md"
CLI = typer.main.get_command(app)

# a value written as a placeholder (MODEL, N, RUN_ID, SECONDS): replaced by a value of the option's type
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")
SAMPLE_VALUES = ("1", "0.5", "x")


# ------------------------------------------------------------------------------------------------ markdown
@dataclass
class Where:
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{shown(self.path)}:{self.line}"


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def fenced(text: str) -> list[tuple[str, int, list[str]]]:
    """(info string, first content line number, lines) of each fenced code block."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = re.match(r"\s*(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, start, body = m.group(1), i + 2, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append((m.group(2), start, body))
        i += 1
    return blocks


def prose(text: str) -> str:
    """The text with fenced code blocks blanked (line numbers kept)."""
    out, fence = [], None
    for line in text.split("\n"):
        m = re.match(r"\s*(```+|~~~+)", line)
        if fence is None and m:
            fence = m.group(1)
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def inline_code(text: str) -> list[tuple[int, str]]:
    """(line number, content) of each inline code span in the prose; a span may wrap across lines."""
    spans = []
    for m in re.finditer(r"(`+)(.+?)(?<!`)\1(?!`)", prose(text), re.S):
        spans.append((text.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split())))
    return spans


def shell_lines(lines: list[str], start: int) -> list[tuple[int, str]]:
    """Logical lines of a shell block: backslash continuations joined, and an indented line opening with `[` or
    `-` joined to the line before it (the layout of a synopsis that wraps)."""
    out: list[tuple[int, str]] = []
    joining = False
    for n, line in enumerate(lines, start):
        stripped = line.strip()
        if out and (joining or (line[:1].isspace() and stripped[:1] in ("[", "-"))):
            out[-1] = (out[-1][0], out[-1][1] + " " + stripped)
        else:
            out.append((n, stripped))
        joining = out[-1][1].endswith("\\")
        if joining:
            out[-1] = (out[-1][0], out[-1][1][:-1].rstrip())
    return [(n, s) for n, s in out if s]


# ------------------------------------------------------------------------------------------------ the CLI
def leaves(cmd=CLI, path: tuple[str, ...] = ()):
    """(path, command) of every command that runs (the groups' subcommands walked)."""
    subcommands = getattr(cmd, "commands", None)
    if subcommands is None:
        yield path, cmd
        return
    for name, sub in subcommands.items():
        yield from leaves(sub, path + (name,))


def options(cmd) -> list:
    return [p for p in cmd.params if p.param_type_name == "option" and not getattr(p, "hidden", False)]


def resolve(words: list[str]) -> tuple[list[tuple[tuple[str, ...], object]], list[str]]:
    """The commands the leading words name (several where a synopsis writes `show|export`) and the rest."""
    found, rest = [((), CLI)], list(words)
    while rest and getattr(found[0][1], "commands", None) is not None:
        word, rest = rest[0], rest[1:]
        names = word.split("|")
        unknown = [n for n in names if not all(n in c.commands for _, c in found)]
        if unknown:
            raise AssertionError(f"no command `sdbench {' '.join(found[0][0] + (unknown[0],))}`")
        found = [(p + (n,), c.commands[n]) for p, c in found for n in names]
    return found, rest


def option_names(cmd) -> set[str]:
    return {name for p in options(cmd) for name in p.opts + p.secondary_opts} | {"--help"}


def value_of(param, args: list[str]) -> int | None:
    """Where in args the value given to this option sits."""
    for i, arg in enumerate(args):
        if arg in param.opts + param.secondary_opts and i + 1 < len(args):
            return i + 1
    return None


def parse(path: tuple[str, ...], cmd, args: list[str], partial: bool) -> None:
    """Parse args for the command as the CLI would, running nothing; a placeholder value the option's type
    refuses is replaced by a sample value and the line parsed again. `partial`: an inline mention may leave a
    required argument out."""
    args = list(args)
    tried: dict[int, int] = {}
    while True:
        try:
            cmd.make_context("sdbench " + " ".join(path), list(args))
            return
        except click_errors.MissingParameter:
            if partial:
                return
            raise
        except click_errors.BadParameter as e:
            at = value_of(e.param, args) if e.param is not None else None
            if at is None or not (PLACEHOLDER.fullmatch(args[at]) or at in tried):
                raise
            tried[at] = tried.get(at, -1) + 1
            if tried[at] >= len(SAMPLE_VALUES):
                raise
            args[at] = SAMPLE_VALUES[tried[at]]


def check_sdbench(words: list[str], partial: bool = False) -> None:
    """One `sdbench …` line: its command must exist; a synopsis (`[...]`, `A|B`, `...`) must name only options
    the command has; a concrete line must parse."""
    found, rest = resolve(words)
    synopsis = any(("[" in w or "]" in w or "|" in w or "..." in w or "…" in w) for w in rest)
    if synopsis or len(found) > 1:
        known = set().union(*(option_names(c) for _, c in found))
        for word in rest:
            m = re.match(r"\[*(--?[A-Za-z][\w-]*)", word)
            if m and m.group(1) not in known:
                raise AssertionError(f"`sdbench {' '.join(found[0][0])}` has no option {m.group(1)}")
        return
    path, cmd = found[0]
    try:
        parse(path, cmd, rest, partial)
    except click_errors.UsageError as e:
        raise AssertionError(f"`sdbench {' '.join(path)}`: {e.format_message()}") from None


# ------------------------------------------------------------------------------------------------ make
def makefile() -> tuple[dict[str, str], dict[str, list[str]]]:
    """The Makefile's variables (their defaults) and each target's recipe lines (continuations joined)."""
    variables, recipes, target = {}, {}, None
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    for line in text.split("\n"):
        if line.startswith("\t") and target:
            if not line.strip().startswith("#"):
                recipes[target].append(line.strip())
        elif m := re.match(r"([A-Za-z_]\w*)\s*(?:\?=|:=|=)\s*(.*)$", line):
            variables[m.group(1)] = m.group(2).strip()
        elif m := re.match(r"([\w.-]+)\s*:(?!=)", line):
            target = m.group(1)
            recipes[target] = []
    return variables, recipes


MAKE_VARIABLES, MAKE_RECIPES = makefile()


def expand(line: str, given: dict[str, str]) -> str:
    values = {**MAKE_VARIABLES, **given}
    for _ in range(10):
        line = re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), ""), line)
    return line


def sdbench_words(words: list[str]) -> list[str] | None:
    """The arguments after the sdbench program in a shell command (environment assignments skipped), or None."""
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        words = words[1:]
    if words and (words[0] == "sdbench" or words[0].endswith("/sdbench")):
        return words[1:]
    if len(words) > 2 and words[1:3] == ["-m", "sdbench"] and "python" in words[0]:
        return words[3:]
    return None


def check_make(words: list[str]) -> None:
    """`make TARGET [VAR=VALUE ...]`: the target exists, and each sdbench command its recipe runs with these
    values parses."""
    given = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    targets = [w for w in words[1:] if "=" not in w] or ["setup"]
    for target in targets:
        if target not in MAKE_RECIPES:
            raise AssertionError(f"the Makefile has no target `{target}`")
        for recipe in MAKE_RECIPES[target]:
            inner = sdbench_words(shlex.split(expand(recipe, given)))
            if inner is not None:
                check_sdbench(inner)


def check_shell(line: str, partial: bool = False) -> bool:
    """Check one shell line if it runs sdbench or make; whether it did."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        words = line.split()
    inner = sdbench_words(words)
    if inner is not None:
        check_sdbench(inner, partial)
        return True
    if words[:1] == ["make"]:
        check_make(words)
        return True
    return False


def command_lines() -> list[tuple[Where, str, bool]]:
    """Every command line in the docs: shell code blocks, and inline code spans that open with sdbench or
    make (those may leave a required argument out: `sdbench report --explain`)."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for info, start, body in fenced(text):
            if info in ("", "bash", "sh", "shell", "console"):
                for n, line in shell_lines(body, start):
                    found.append((Where(path, n), line, False))
        for n, span in inline_code(text):
            if re.match(r"(sdbench|make) [a-z-]", span):
                found.append((Where(path, n), span, True))
    return found


COMMAND_LINES = command_lines()


def test_the_docs_show_commands():
    assert sum(1 for _, line, _ in COMMAND_LINES if line.startswith("sdbench ")) > 100


def test_every_sdbench_and_make_line_in_the_docs_parses():
    checked, failures = 0, []
    for where, line, partial in COMMAND_LINES:
        try:
            checked += check_shell(line, partial)
        except AssertionError as e:
            failures.append(f"{where}: {e}\n    {line}")
    assert not failures, "\n".join(failures)
    assert checked > 100


def test_the_makefile_sdbench_recipes_parse():
    ran = [t for t, lines in MAKE_RECIPES.items() for line in lines if "sdbench" in line and " run" in line]
    assert ran, "the Makefile's run target no longer runs sdbench"
    for target in MAKE_RECIPES:
        check_make(["make", target])


@pytest.mark.parametrize("line", [
    "sdbench run --no-such-option 3",
    "sdbench frobnicate --limit 2",
    "sdbench predict nothing",
    "sdbench run --limit eight",
    "sdbench compare only-one extra-argument too-many",
    "sdbench run --strategy draft [--no-such-option N]",
    "sdbench schedule show|export NAME [--no-such-option X]",
    "make run ARGS=\"--no-such-option 1\"",
    "make no-such-target",
])
def test_a_wrong_command_line_fails(line):
    with pytest.raises(AssertionError):
        check_shell(line)


def test_placeholders_and_synopses_parse():
    for line in ("sdbench run --target MODEL --limit N --temperature T --resume RUN_ID",
                 "sdbench run --target MODEL [--draft MODEL ...] --strategy NAME [--limit N]",
                 "sdbench schedule show|export NAME [--format vllm|trtllm|sglang|llama.cpp|json] [--batch B] [--out FILE]",
                 "RAY_ADDRESS=auto sdbench run --strategy dsi ...",
                 "make gpu-check PART=1 ARGS=\"--budget SECONDS\"",
                 "python3 -m sdbench gpu-check --merge --out DIR"):
        assert check_shell(line), line


# ------------------------------------------------------------------------------------------------ links
def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, `_`, `-` and spaces
    kept), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts as its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    seen: dict[str, int] = {}
    found = set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    for line in prose(text).split("\n"):
        m = re.match(r" {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(2))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline link, image and link reference definition outside code."""
    text = re.sub(r"(`+)(.+?)(?<!`)\1(?!`)", lambda m: " " * len(m.group(0)), prose(path.read_text()), flags=re.S)
    found = [(text.count("\n", 0, m.start()) + 1, m.group(1))
             for m in re.finditer(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)]
    found += [(text.count("\n", 0, m.start()) + 1, m.group(1))
              for m in re.finditer(r"^ {0,3}\[[^\]]+\]:\s*(\S+)", text, re.M)]
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for line, target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not checked offline
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{Where(path, line)}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{Where(path, line)}: {target}: no heading #{anchor} in {shown(dest)}")
    return broken


def test_every_link_and_anchor_resolves():
    broken = [b for path in DOCS for b in broken_links(path)]
    assert not broken, "\n".join(broken)


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / target.partition("#")[0]).resolve() for _, target in links(ROOT / "README.md")}
    missing = [p.name for p in DOCS[1:] if p.resolve() not in linked]
    assert not missing, f"README.md links no {missing}"


def test_slugs_follow_githubs_rules():
    assert slug("The GPU check: `make gpu-check` on a machine with no network") == \
        "the-gpu-check-make-gpu-check-on-a-machine-with-no-network"
    assert slug("Models, families, the probe and `@random`") == "models-families-the-probe-and-random"
    assert slug("Distributed speculative inference (DSI)") == "distributed-speculative-inference-dsi"
    assert slug("snake_case and dash-es") == "snake_case-and-dash-es"


def test_a_broken_link_fails(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Two words\n\n[ok](#two-words) [ok](b.md#b) "
                                   "[bad](#three-words) [bad](missing.md) [bad](b.md#nowhere)\n"
                                   "```bash\n[not a link](inside-code.md)\n```\n")
    (tmp_path / "b.md").write_text("# B\n")
    broken = broken_links(tmp_path / "a.md")
    assert [b.split(": ", 1)[1] for b in broken] == [
        "#three-words: no heading #three-words in a.md", "missing.md: no such file",
        "b.md#nowhere: no heading #nowhere in b.md"]


# ------------------------------------------------------------------------------------------------ options
def sections(text: str) -> dict[str, str]:
    """The page's `## ` sections by heading."""
    parts = re.split(r"^## +(.+)$", prose(text), flags=re.M)
    return {parts[i].strip().strip("`"): parts[i + 1] for i in range(1, len(parts), 2)}


def default_of(param, cmd) -> str | None:
    """The default the option's --help line states, if any."""
    record = param.get_help_record(cmd.context_class(cmd, info_name=cmd.name))
    found = re.findall(r"default: ([^\];]+)", record[1] if record else "")
    return found[-1].strip() if found else None


def undocumented_options(page_text: str) -> list[str]:
    page = sections(page_text)
    missing = []
    for path, cmd in leaves():
        title = "sdbench " + " ".join(path)
        if title not in page:
            missing.append(f"no section `## {title}`")
            continue
        section = page[title]
        for param in options(cmd):
            for name in param.opts + param.secondary_opts:
                if f"`{name}`" not in section:
                    missing.append(f"{title}: {name}")
            default = default_of(param, cmd)
            rows = [r for r in section.split("\n") if r.startswith("|") and f"`{param.opts[0]}`" in r]
            if default is not None and rows and f"default: {default}" not in rows[0]:
                missing.append(f"{title}: {param.opts[0]} should say `default: {default}` as --help does")
        known = option_names(cmd)
        for row in section.split("\n"):
            if row.startswith("| `-"):
                for name in re.findall(r"`(-[^`\s]+)`", row.split("|")[1]):
                    if name not in known:
                        missing.append(f"{title}: documents {name}, which the command does not have")
    return missing


def test_every_option_of_every_command_is_in_the_commands_page():
    missing = undocumented_options(COMMANDS_PAGE.read_text())
    assert not missing, "docs/commands.md:\n" + "\n".join(missing)


def test_an_undocumented_option_or_a_stale_default_fails():
    text = COMMANDS_PAGE.read_text()
    assert "| `--top-p` |" in text and "| `--out`, `-o` |" in text
    without = text.replace("| `--top-p` |", "| `--top` |", 1)
    assert any(m.endswith("--top-p") for m in undocumented_options(without))
    assert any("--top" in m and "does not have" in m for m in undocumented_options(without))
    stale = re.sub(r"(\| `--limit` \|[^\n]*default: )4", r"\g<1>5", text, count=1)
    assert any("--limit should say" in m for m in undocumented_options(stale))



# package registries' own hosts: a file that names one breaks on a machine with another index or a mirror (fetch
# by name through pip or apt instead, which honour the configured source)
REGISTRY_HOSTS = ("pypi.org", "pythonhosted.org", "pypi.python.org", "deb.debian.org", "registry.npmjs.org",
                  "download.pytorch.org")


def _naming_a_registry(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        text = path.read_text(errors="replace") if path.is_file() else ""
        found += [f"{path}: {host}" for host in REGISTRY_HOSTS if host in text]
    return found


def test_no_file_names_a_package_registrys_host(tmp_path):
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert len(tracked) > 100, "not a git checkout"
    mine = Path(__file__).resolve()
    assert _naming_a_registry([ROOT / p for p in tracked if (ROOT / p).resolve() != mine]) == []
    bad = tmp_path / "Makefile"  # the check finds the kind of line it is for
    bad.write_text(f"SDIST_FROM := {REGISTRY_HOSTS[1]}\n")
    assert _naming_a_registry([bad]) == [f"{bad}: {REGISTRY_HOSTS[1]}"]
