"""Every relative markdown link in README.md, docs/ and results/ resolves: the file exists and an
``#anchor`` into a markdown file names one of its headings (GitHub's slugs). Also: README.md stays
the short entry page (<= 12 KB) and benchmarks/ holds code only (results live in results/)."""

import pathlib
import re


ROOT = pathlib.Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "results").rglob("*.md"))]


def _slug(heading: str) -> str:
    h = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", page.read_text(), re.M)}


def broken_links(pages, root=ROOT) -> list[str]:
    bad = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not inside code blocks
        text = re.sub(r"`[^`\n]*`", "", text)  # nor code spans
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = page.relative_to(root)
            if not dest.exists():
                bad.append(f"{where}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in _anchors(dest):
                bad.append(f"{where}: {target} (no heading #{frag})")
    return bad


def test_every_relative_link_resolves():
    pages = _pages()
    assert len(pages) > 10
    assert broken_links(pages) == []


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n[ok](a.md#top) [gone](b.md) [anchor](a.md#nowhere) "
                                   "`[code](x.md)`\n```\n[fenced](y.md)\n```\n")
    assert broken_links([tmp_path / "a.md"], root=tmp_path) == ["a.md: b.md (no such file)", "a.md: a.md#nowhere (no heading #nowhere)"]


def test_readme_is_short_and_benchmarks_hold_code_only():
    assert (ROOT / "README.md").stat().st_size <= 12 * 1024
    data = [p.name for p in (ROOT / "benchmarks").iterdir() if p.is_file() and p.suffix not in (".py", ".sh")]
    assert data == []
