"""Every relative Markdown link in README.md, CONTRIBUTING.md and docs/*.md resolves: its file exists,
and its #anchor is a heading of the target, as GitHub names headings."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
"""An inline link `[text](target)` or `[text](target "title")`; images are left out."""
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
SKIP = ("http://", "https://", "mailto:")


def outside_fences(text: str) -> list[str]:
    """The page's lines, with those inside fenced code blocks blanked (line numbers kept)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: a link keeps its text, code marks go, lowercase, punctuation
    but - and _ dropped, each space to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor in a page, with GitHub's -1, -2, ... for a repeated one."""
    found, seen = set(), {}
    for line in outside_fences(page.read_text()):
        if m := HEADING.match(line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(f"{base}-{n}" if n else base)
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """One line per link of the page that does not resolve: page:line: (target) and why."""
    bad = []
    for number, line in enumerate(outside_fences(page.read_text()), 1):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):  # code spans hold no links
            if not target or target.startswith(SKIP):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}:{number}: ({target})"
            if not file.exists():
                bad.append(f"{where} {path} does not exist")
            elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
                bad.append(f"{where} no heading #{anchor} in {file.relative_to(root)}")
    return bad


def test_the_slug_is_githubs():
    assert slug("Quantized weights (`quantization`, vLLM's name)") == "quantized-weights-quantization-vllms-name"
    assert slug("Choosing the knobs: `batchinfer tune`") == "choosing-the-knobs-batchinfer-tune"
    assert slug("LoRA adapters against the base model and PEFT (2026-12-02, this 2-core machine, shared)") == \
        "lora-adapters-against-the-base-model-and-peft-2026-12-02-this-2-core-machine-shared"
    assert slug("pass@k and maj@n") == "passk-and-majn"
    assert slug("snake_case and [a link](x.md)") == "snake_case-and-a-link"


def test_a_broken_link_is_named(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Here it is\n\n[ok](#here-it-is) [gone](missing.md) [no](#nowhere)\n"
                    "[there](other.md#twice-1) [not there](other.md#twice-2)\n"
                    "```\n[in code](nowhere.md)\n```\n`[in a span](nowhere.md)` [web](https://example.com/x)\n")
    bad = broken_links(page, tmp_path)
    assert [b.split(": (", 1)[1].split(")", 1)[0] for b in bad] == ["missing.md", "#nowhere", "other.md#twice-2"], bad
    assert bad[0].startswith("page.md:5: ")


def test_every_relative_link_and_anchor_in_the_docs_resolves():
    bad = [b for page in PAGES for b in broken_links(page)]
    assert not bad, "broken links:\n" + "\n".join(bad)
