"""Module-path patterns: pick sub-modules of a ``paddle.nn.Layer`` by name or class.

A pattern is either

* a dotted path over the names ``model.named_sublayers()`` gives (relative to the
  model root), where each component is a literal name or a brace group of indices:
  ``{*}`` (any index), ``{3}``, ``{1,4,7}``, ``{0-20,22-40}`` (inclusive ranges);
  e.g. ``model.layers.{*}``, ``blocks.{0,2}.attn``, ``lm_head``; or
* a class name (one identifier starting with an upper-case letter, e.g.
  ``LlamaDecoderLayer``): every sub-module whose class has that name.

Patterns are validated up front (:func:`parse_pattern`) so a typo in a config fails at
load time, and a pattern that selects nothing in the real model fails with the nearest
real paths (:func:`match_modules`) rather than silently wrapping less than asked.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import paddle

ALLOWED_SYNTAX = ("a dotted path of names and brace groups such as 'model.layers.{*}', "
                  "'layers.{0-20,22-40}', 'blocks.{3}.attn', or a class name such as "
                  "'LlamaDecoderLayer'")
MAX_SUGGESTIONS = 5

_SINGLE_INDEX = re.compile(r"\d+")
_INDEX_RANGE = re.compile(r"(\d+)-(\d+)")


class PatternError(ValueError):
    """A malformed pattern, or one that matches no sub-module of the model."""


@dataclass(frozen=True)
class _AnyIndex:
    """``{*}``: any one component that is a non-negative integer index."""

    def matches(self, part: str) -> bool:
        return _is_index(part)


@dataclass(frozen=True)
class _IndexSet:
    """``{0-2,5}``: an index component whose value is one of ``indices``."""

    indices: frozenset

    def matches(self, part: str) -> bool:
        return _is_index(part) and int(part) in self.indices


@dataclass(frozen=True)
class _Literal:
    """A plain name component, compared exactly."""

    name: str

    def matches(self, part: str) -> bool:
        return part == self.name


@dataclass(frozen=True)
class Pattern:
    """A validated pattern; build it with :func:`parse_pattern`."""

    text: str
    is_class_name: bool
    components: tuple = ()

    def matches(self, path: str, module: Any) -> bool:
        """Whether the sub-module at dotted ``path`` is selected by this pattern."""
        if self.is_class_name:
            return type(module).__name__ == self.text
        parts = path.split(".")
        if len(parts) != len(self.components):
            return False
        return all(component.matches(part) for component, part in zip(self.components, parts))

    @property
    def has_index_groups(self) -> bool:
        return any(not isinstance(component, _Literal) for component in self.components)


def _is_index(part: str) -> bool:
    # str.isdigit also accepts non-ASCII digits such as '²', which int() rejects
    return part.isascii() and part.isdigit()


# ------------------------------------------------------------------------- parsing
def parse_pattern(text: str) -> Pattern:
    """Validate ``text`` and return its :class:`Pattern`; raise :class:`PatternError`
    naming the pattern, the problem and the allowed syntax when it is malformed."""
    if not isinstance(text, str):
        raise PatternError(f"pattern {text!r}: expected a string ({ALLOWED_SYNTAX}), "
                           f"got {type(text).__name__}")
    if _is_class_name(text):
        return Pattern(text=text, is_class_name=True)
    try:
        _check_braces(text)
        components = tuple(_parse_component(part) for part in text.split("."))
    except _Problem as problem:
        raise PatternError(f"pattern {text!r}: {problem}; allowed: {ALLOWED_SYNTAX}") from None
    return Pattern(text=text, is_class_name=False, components=components)


class _Problem(Exception):
    """What is wrong with one pattern; :func:`parse_pattern` adds the pattern text."""


def _is_class_name(text: str) -> bool:
    return text.isidentifier() and text[0].isupper()


def _check_braces(text: str) -> None:
    """Braces come in non-nested pairs with no dot inside (checked before splitting
    on dots, so '{0.5}' is reported as what it is)."""
    if not text:
        raise _Problem("empty pattern")
    inside = False
    for char in text:
        if char == "{":
            if inside:
                raise _Problem("unbalanced braces: '{' inside a brace group")
            inside = True
        elif char == "}":
            if not inside:
                raise _Problem("unbalanced braces: '}' without a matching '{'")
            inside = False
        elif char == "." and inside:
            raise _Problem("'.' inside a brace group")
    if inside:
        raise _Problem("unbalanced braces: '{' is never closed")


def _parse_component(part: str):
    if not part:
        raise _Problem("empty path component (a leading, trailing or doubled '.')")
    if "{" in part or "}" in part:
        if not (part.startswith("{") and part.endswith("}")):
            raise _Problem(f"brace group in {part!r} must be a whole path component")
        return _parse_brace_group(part[1:-1])
    if "*" in part or "?" in part:
        raise _Problem(f"{part!r} is not a name; write '{{*}}' for any index")
    if any(char.isspace() for char in part):
        raise _Problem(f"{part!r} contains whitespace")
    return _Literal(part)


def _parse_brace_group(body: str):
    items = [item.strip() for item in body.split(",")]
    if items == [""]:
        raise _Problem("empty brace group '{}'; list indices such as {0,2} or {0-3}, or {*}")
    if "*" in items:
        if len(items) > 1:
            raise _Problem(f"'*' must stand alone in its brace group, got {{{body}}}")
        return _AnyIndex()
    indices: set[int] = set()
    for item in items:
        indices.update(_parse_index_item(item))
    return _IndexSet(frozenset(indices))


def _parse_index_item(item: str) -> range:
    if _SINGLE_INDEX.fullmatch(item):
        return range(int(item), int(item) + 1)
    found = _INDEX_RANGE.fullmatch(item)
    if found:
        start, end = int(found.group(1)), int(found.group(2))
        if start > end:
            raise _Problem(f"range '{item}' has start {start} > end {end}")
        return range(start, end + 1)
    raise _Problem(_describe_bad_item(item))


def _describe_bad_item(item: str) -> str:
    """Why one comma-separated entry of a brace group is neither N nor N-M."""
    allowed = "each entry must be an index N >= 0 or an inclusive range N-M"
    if not item:
        return f"empty entry in a brace group; {allowed}"
    if item.startswith("-"):
        return f"'{item}' is a negative number or a range with no start; {allowed}"
    if item.endswith("-"):
        return f"range '{item}' has no end; {allowed}"
    if "--" in item:
        return f"range '{item}' has a negative end; {allowed}"
    return f"'{item}' is not an int; {allowed}"


# ------------------------------------------------------------------------ matching
def match_modules(model: paddle.nn.Layer, patterns: list[str],
                  key: str) -> list[tuple[str, Any]]:
    """The sub-modules of ``model`` (the root itself excluded) selected by any of
    ``patterns``, in ``named_sublayers`` order, each once. Every pattern must select at
    least one sub-module: all that select none are reported together in one
    :class:`PatternError` naming ``key`` and the nearest real paths or class names, and
    an index group must name only indices the model has ('layers.{0-5}' on a 2-layer
    model is refused like 'layers.{4-5}', with the real range named)."""
    parsed = _parse_all(patterns, key)
    sublayers = list(model.named_sublayers(include_self=False))
    matched: list[tuple[str, Any]] = []
    seen: set[int] = set()
    used: set[str] = set()
    for path, module in sublayers:
        hits = [pattern for pattern in parsed if pattern.matches(path, module)]
        used.update(pattern.text for pattern in hits)
        if hits and id(module) not in seen:
            seen.add(id(module))
            matched.append((path, module))
    problems = [_no_match_message(pattern, key, sublayers)
                for pattern in parsed if pattern.text not in used]
    problems += [problem for pattern in parsed if pattern.text in used
                 for problem in _missing_index_messages(pattern, key, sublayers)]
    if problems:
        raise PatternError("\n".join(problems))
    return matched


def _parse_all(patterns: Iterable[str], key: str) -> list[Pattern]:
    if isinstance(patterns, str):
        raise PatternError(f"{key}: expected a list of patterns, got the string {patterns!r}; "
                           f"write [{patterns!r}]")
    parsed, problems = [], []
    for text in patterns:
        try:
            parsed.append(parse_pattern(text))
        except PatternError as error:
            problems.append(f"{key}: {error}")
    if problems:
        raise PatternError("\n".join(problems))
    return parsed


def _no_match_message(pattern: Pattern, key: str, sublayers: list) -> str:
    if pattern.is_class_name:
        names = sorted({type(module).__name__ for _, module in sublayers})
        what, kind = f"no sub-module has class {pattern.text!r}", "class names"
    else:
        names = [path for path, _ in sublayers]
        what, kind = f"pattern {pattern.text!r} matches no sub-module", "paths"
    close = _nearest(pattern.text, names)
    if close:
        hint = f"nearest {kind}: " + ", ".join(repr(name) for name in close)
    else:
        shown = ", ".join(repr(name) for name in names[:MAX_SUGGESTIONS])
        hint = f"no close match; the model's first {kind}: {shown}" if names else \
            "the model has no sub-modules"
    return f"{key}: {what}; {hint}{_index_hint(pattern, sublayers)}"


def _nearest(text: str, names: list[str], cutoff: float = 0.5) -> list[str]:
    """Up to MAX_SUGGESTIONS names most like ``text``; unlike difflib.get_close_matches,
    equally close names keep the model's order ('layers.0' before 'layers.5')."""
    matcher = difflib.SequenceMatcher(b=text)
    scored = []
    for order, name in enumerate(names):
        matcher.set_seq1(name)
        if matcher.real_quick_ratio() >= cutoff and matcher.ratio() >= cutoff:
            scored.append((-matcher.ratio(), order, name))
    return [name for _, _, name in sorted(scored)[:MAX_SUGGESTIONS]]


def _index_hint(pattern: Pattern, sublayers: list) -> str:
    """For a path whose shape exists but whose indices do not, say which indices do
    (the usual slip: a range written for a deeper model)."""
    if pattern.is_class_name or not pattern.has_index_groups:
        return ""
    relaxed = Pattern(pattern.text, False, tuple(
        component if isinstance(component, _Literal) else _AnyIndex()
        for component in pattern.components))
    position = next(i for i, c in enumerate(pattern.components) if not isinstance(c, _Literal))
    present = sorted({int(path.split(".")[position]) for path, module in sublayers
                      if relaxed.matches(path, module)})
    if not present:
        return ""
    return f" (indices present at component {position + 1}: {_compress(present)})"


def _missing_index_messages(pattern: Pattern, key: str, sublayers: list) -> list[str]:
    """One message per index group of ``pattern`` that names indices the model does not
    have where the rest of the pattern matches (a range written for a deeper model)."""
    messages = []
    for position, component in enumerate(pattern.components):
        if not isinstance(component, _IndexSet):
            continue
        relaxed = Pattern(pattern.text, False, tuple(
            _AnyIndex() if i == position else c for i, c in enumerate(pattern.components)))
        present = {int(path.split(".")[position]) for path, module in sublayers
                   if relaxed.matches(path, module)}
        missing = sorted(component.indices - present)
        if missing:
            messages.append(
                f"{key}: pattern {pattern.text!r} names indices {_compress(missing)} at "
                f"component {position + 1} that the model does not have (indices present "
                f"there: {_compress(sorted(present))}); name only those, or use {{*}}")
    return messages


def _compress(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the brace-group syntax)."""
    runs: list[str] = []
    start = indices[0]
    # the last index again closes the last run (it is never previous + 1)
    for previous, current in zip(indices, indices[1:] + indices[-1:]):
        if current != previous + 1:
            runs.append(str(start) if start == previous else f"{start}-{previous}")
            start = current
    return ",".join(runs)


def order_bottom_up(matches: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Deepest paths first, ties in their original order, so a module is wrapped only
    after every matched module inside it (a parent's unit takes what is left)."""
    return sorted(matches, key=lambda item: -item[0].count("."))
