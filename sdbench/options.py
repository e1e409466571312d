"""Parsing the command line's list and key=value options: every bad value is one line naming the option typed."""

from __future__ import annotations

from sdbench.errors import SdbenchError


def split_list(text: str, option: str) -> list[str]:
    """The stripped items of 'a' or 'a,b,c' ('' has none); an empty item is one line naming `option`."""
    return _named(option, lambda: _items(text))


def _items(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",")] if text.strip() else []
    if not all(items):
        raise SdbenchError(f"{text}: an empty item in the list (two commas in a row, or one at an end)")
    return items


def _numbers(text: str, kind, what: str) -> tuple:
    """Numbers of `kind` from 'a' or 'a,b,c'; a value that does not parse is one line naming `what` was expected."""
    items = _items(text)
    try:
        return tuple(kind(x) for x in items)
    except ValueError:
        raise SdbenchError(f"{text}: expected {what}, or a comma-separated list") from None


def parse_counts(text: str | None, option: str = "--gamma", low: int | None = None) -> tuple[int, ...]:
    """Whole numbers from '4' or '1,2,4', distinct, each at least `low` when given; errors name `option`, the
    option the user typed."""
    if text is None:
        return ()
    values = _named(option, lambda: _numbers(text, int, "a whole number"))
    if not values or len(set(values)) != len(values):
        raise SdbenchError(f"{option} {text}: expected distinct whole numbers")
    if low is not None and min(values) < low:
        raise SdbenchError(f"{option} {text}: every value must be at least {low}")
    return values


def parse_tokens(text: str) -> int:
    """A number of tokens, '2048' or '2k' (a k is 1024 tokens): --prompt-len's value."""
    value = text.strip().lower()
    digits = value[:-1] if value.endswith("k") else value
    if not digits.isdigit():
        raise SdbenchError(f"--prompt-len {text}: expected a number of tokens, such as 2048 or 2k")
    return int(digits) * (1024 if value.endswith("k") else 1)


def parse_lengths(text: str | None, option: str = "--prompt-len") -> tuple[int, ...]:
    """Prompt lengths from '1024' or '1k,8k' (a k is 1024 tokens, as parse_tokens), distinct, each at least 1."""
    if text is None:
        return ()
    words = split_list(text, option)
    try:
        values = tuple(parse_tokens(w) for w in words)
    except SdbenchError:
        values = ()
    if not values or len(set(values)) != len(values) or min(values) < 1:
        raise SdbenchError(f"{option} {text}: expected distinct numbers of tokens, such as 1024,4096 or 1k,8k")
    return values


def parse_depths(text: str | None) -> tuple[float, ...]:
    return _named("--depth", lambda: _numbers(text or "", float, "a number from 0 to 1"))


def parse_rates(text: str | None) -> tuple[float, ...]:
    """Request rates from '2' or '0.5,1,inf': each positive, or inf."""
    if text is None:
        return ()
    values = _named("--request-rate", lambda: _numbers(text, float, "a number of requests/s, inf"))
    if not values or len(set(values)) != len(values) or not all(v > 0 for v in values):  # NaN fails too
        raise SdbenchError(f"--request-rate {text}: expected distinct rates above 0 (requests/s), or inf")
    return values


PROBE_MODES = ("auto", "always", "never")  # --probe: reuse a kept verdict, probe again, or skip the probe


def probe_mode(probe: str, no_probe: bool = False) -> str:
    """--probe's mode; --no-probe is --probe never."""
    if probe not in PROBE_MODES:
        raise SdbenchError(f"--probe {probe}: use one of {', '.join(PROBE_MODES)}")
    if no_probe and probe not in ("auto", "never"):
        raise SdbenchError(f"--no-probe and --probe {probe} contradict each other: give one")
    return "never" if no_probe else probe


def _named(option: str, parse):
    """parse(), its error prefixed with the option the user typed."""
    try:
        return parse()
    except SdbenchError as e:
        raise SdbenchError(f"{option} {e}") from None


def parse_sets(items: list[str] | None) -> dict:
    options = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SdbenchError(f"--set {item}: expected key=value")
        options[key.strip()] = value.strip()
    return options
