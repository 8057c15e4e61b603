"""The docs hold together: every relative link in README.md and docs/*.md points to an
existing file (and heading, for links with a #anchor), nothing points into ../shared/
(a clone of the project has no such folder), every docs page that the code, tests or
tools name exists, and docs/topology.md lists every valid ``sharding_configs`` key (the
error for an unknown key sends users there).

The README is a front door (issue 68): at most 120 lines, its two commands first, no
measured figure outside its one "What it costs" table, and a map that leads to every
docs page. Every docs page opens with what it is for, and docs/architecture.md has a
line for every module of the package."""

from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    out, fence = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            out.append(line)
    return "\n".join(out)


def _anchors(text: str) -> set:
    """GitHub's anchors for the headings of a page."""
    seen: dict = {}
    anchors = set()
    for line in _prose(text).split("\n"):
        m = re.match(r"#{1,6} (.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_there_are_docs_pages():
    assert "docs/faults.md" in PAGES and "docs/topology.md" in PAGES, PAGES


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_resolves(page):
    text = _read(page)
    broken = []
    for target in LINK.findall(_prose(text)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path \
            else os.path.join(ROOT, page)
        if not os.path.exists(full):
            broken.append(f"{target} (no file {os.path.relpath(full, ROOT)})")
        elif anchor and full.endswith(".md") and anchor not in _anchors(_read(full)):
            broken.append(f"{target} (no heading #{anchor} in {os.path.relpath(full, ROOT)})")
    assert not broken, f"{page} has broken links: {broken}"


@pytest.mark.parametrize("page", PAGES)
def test_nothing_points_into_shared(page):
    assert "../shared" not in _read(page), f"{page} refers to ../shared/, which clones lack"


def test_docs_pages_named_in_the_code_exist():
    named = set()
    for folder in ("paddle_hsdp", "test", "test_collective", "tools"):
        for path in glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True):
            with open(path, encoding="utf-8") as f:
                named.update(re.findall(r"docs/[\w.-]+\.md", f.read()))
    assert "docs/topology.md" in named  # the error for an unknown sharding_configs key
    missing = sorted(p for p in named if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing, f"the code names docs pages that do not exist: {missing}"


def test_topology_lists_every_valid_sharding_configs_key():
    from paddle.distributed.fleet.proto import distributed_strategy_pb2 as pb

    from paddle_hsdp.topology.fleet import HSDP_OPTIONS

    text = _read("docs/topology.md")
    keys = list(HSDP_OPTIONS) + list(pb.DygraphShardingConfig.DESCRIPTOR.fields_by_name)
    missing = [k for k in keys if f"`{k}`" not in text]
    assert not missing, (f"docs/topology.md does not list these valid sharding_configs keys "
                         f"(this Paddle's DygraphShardingConfig or paddle_hsdp's): {missing}")


# ---------------------------------------------------------------- the README (issue 68)

README_MAX_LINES = 120
TWO_COMMANDS = ["bash tools/demo.sh", "bash tools/test.sh"]


def _sections(text: str) -> dict:
    """The README's prose by ``## `` section, code blocks left out."""
    out: dict = {}
    name = ""
    for line in _prose(text).split("\n"):
        if line.startswith("## "):
            name = line[3:].strip()
        out.setdefault(name, []).append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def test_readme_is_at_most_120_lines():
    n = len(_read("README.md").splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines (at most {README_MAX_LINES}): "
                                   f"move detail to a docs page and link it")


def test_readme_says_what_it_is_and_for_whom_in_3_to_5_lines():
    text = _read("README.md")
    intro = [line for line in text.split("\n## ", 1)[0].split("\n")[1:] if line.strip()]
    assert 3 <= len(intro) <= 5, f"README.md's intro has {len(intro)} lines, not 3-5"
    assert "for engineers who" in " ".join(intro).lower(), "the intro should say for whom"


def test_readme_gives_the_two_commands_first():
    text = _read("README.md")
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    assert blocks, "README.md has no code block"
    first = [line.split("#")[0].strip() for line in blocks[0].strip().split("\n")]
    assert first == TWO_COMMANDS, f"README.md's first code block is {first}, not {TWO_COMMANDS}"
    headings = re.findall(r"^## (.*)$", _prose(text), re.M)
    assert headings and headings[0] == "Run it", f"the first section is {headings[:1]}, not 'Run it'"
    for cmd in TWO_COMMANDS:
        assert os.path.exists(os.path.join(ROOT, cmd.split()[1])), cmd


# a measured figure: a time, a ratio, a size, a rate or a share, e.g. "35 s", "0.74x",
# "1.2 GB", "11k tokens/s", "8%"; "2 x 2" (a layout) is not one
FIGURE = re.compile(r"\b\d[\d,.]*(?:x\b|\s?(?:k?\s?tokens/s|ms\b|s\b|min\b|[KMG]i?B\b|%))")


def test_readme_has_no_measured_figure_outside_what_it_costs():
    sections = _sections(_read("README.md"))
    assert "What it costs" in sections, "README.md lost its 'What it costs' table"
    assert FIGURE.search(sections["What it costs"]), "the 'What it costs' table has no figure"
    assert "docs/benchmark.md" in sections["What it costs"]
    found = {name: FIGURE.findall(body) for name, body in sections.items()
             if name != "What it costs"}
    found = {k: v for k, v in found.items() if v}
    assert not found, (f"README.md has measured figures outside 'What it costs' (they belong "
                       f"in docs/, with their date and command): {found}")
    assert not re.search(r"\b\d+ tests\b", _read("README.md")), \
        "the suite's size and time change at every commit: docs/getting-started.md has them"


def test_figure_pattern_sees_figures_and_not_layouts():
    assert FIGURE.findall("about 35 s, 0.74x, 1.2 GB, 11-13k tokens/s, 8% and 10 min")
    assert len(FIGURE.findall("0.74x / 0.87x")) == 2
    assert not FIGURE.findall("HSDP 2 x 2 on 4 CPU ranks, 1/inner shards, 8-way, step_100")


def test_readme_docs_map_leads_to_every_docs_page():
    text = _read("README.md")
    mapped = {os.path.normpath(t.partition("#")[0]) for t in LINK.findall(
        _sections(text).get("Documentation", ""))}
    pages = {p for p in PAGES if p.startswith("docs/")}
    missing = sorted(pages - mapped)
    assert not missing, f"README.md's Documentation map lacks {missing}"


# ------------------------------------------------------ every page says what it is for

DOCS = [p for p in PAGES if p.startswith("docs/")]
PURPOSE = "This page is for "


def _opening(page: str) -> str:
    """The first paragraph after a page's ``# `` title, as one line."""
    lines = _read(page).split("\n")
    assert lines[0].startswith("# "), f"{page} does not start with a '# ' title"
    para: list = []
    for line in lines[1:]:
        if not line.strip():
            if para:
                break
            continue
        para.append(line.strip())
    return " ".join(para)


@pytest.mark.parametrize("page", DOCS)
def test_every_docs_page_opens_with_what_it_is_for(page):
    opening = _opening(page)
    assert opening.startswith(PURPOSE), (
        f"{page}: the first paragraph after the title should say what the page is for, "
        f"starting {PURPOSE!r}; it is: {opening[:120]!r}")
    # a sentence that names a reader or a task and what the page covers, not a stub
    first_sentence = re.split(r"(?<=[.!?])\s", opening, maxsplit=1)[0]
    assert len(first_sentence.split()) >= 12, f"{page}: {first_sentence!r} says too little"
    assert ":" in first_sentence or "," in first_sentence, (
        f"{page}: say what the page covers after who it is for: {first_sentence!r}")


def test_docs_pages_say_different_things_at_their_top():
    openings = {page: _opening(page) for page in DOCS}
    seen: dict = {}
    for page, opening in openings.items():
        seen.setdefault(opening.split(".")[0], []).append(page)
    same = [pages for pages in seen.values() if len(pages) > 1]
    assert not same, f"pages open with the same sentence: {same}"


# ------------------------------------------------- docs/architecture.md and the code

MODULE_ROW = re.compile(r"^\| `([\w/]+\.py)` \|", re.M)


def test_architecture_has_a_line_for_every_module():
    rows = MODULE_ROW.findall(_read("docs/architecture.md"))
    modules = sorted(os.path.relpath(p, os.path.join(ROOT, "paddle_hsdp")) for p in
                     glob.glob(os.path.join(ROOT, "paddle_hsdp", "**", "*.py"), recursive=True))
    assert len(modules) > 50  # the glob sees the package
    missing = [m for m in modules if m not in rows]
    assert not missing, f"docs/architecture.md has no line for {missing}"
    stale = [r for r in rows if r not in modules]
    assert not stale, f"docs/architecture.md describes modules that do not exist: {stale}"
    twice = sorted({r for r in rows if rows.count(r) > 1})
    assert not twice, f"docs/architecture.md describes these modules twice: {twice}"
