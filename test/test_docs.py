"""The docs hold together: every relative link in README.md and docs/*.md points to an
existing file (and heading, for links with a #anchor), nothing points into ../shared/
(a clone of the project has no such folder), every docs page that the code, tests or
tools name exists, and docs/topology.md lists every valid ``sharding_configs`` key (the
error for an unknown key sends users there)."""

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
