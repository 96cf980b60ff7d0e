#!/usr/bin/env python3
"""Checks the links of the built book and of README.md; prints each broken one and exits 1 if any.

    scripts/check-links.py [BOOK_DIR]     (default: the build-dir of docs/book.toml, else docs/book)

Build the book first (`mdbook build docs`). In every HTML page of the book, each relative `href` and
`src` must name a file inside the book (a folder stands for its index.html), and a `#fragment` must be
the id (or the `name` of an `<a>`) of an element of the page it points to. Links with a scheme
(`https:`, `mailto:`, ...) and absolute paths (`/`, the site root of the 404 page) are left alone.

In README.md, each relative link (`[text](path)`, `![alt](path)`, `[label]: path`) outside code must
name a file or folder of the repository, and a `#fragment` into a Markdown file must be the anchor
GitHub gives one of its headings.
"""

import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent


def book_dir() -> Path:
    docs = ROOT / "docs"
    build = "book"
    try:
        import tomllib

        with open(docs / "book.toml", "rb") as f:
            build = tomllib.load(f).get("build", {}).get("build-dir", build)
    except (ImportError, OSError):
        pass
    return (docs / build).resolve()


def external(link: str) -> bool:
    """A link this check leaves alone: with a scheme, protocol-relative, or absolute."""
    return bool(urlsplit(link).scheme) or link.startswith("/")


class Page(HTMLParser):
    """The ids of a page and its links (line, attribute, value)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids = set()
        self.links = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value)
            elif name in ("href", "src"):
                self.links.append((self.getpos()[0], name, value))

    handle_startendtag = handle_starttag


def parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    page.close()
    return page


def check_book(book: Path) -> list:
    broken = []
    pages = {p.resolve(): parse(p) for p in sorted(book.rglob("*.html"))}
    if not pages:
        return [f"{book}: no HTML pages (build the book first: mdbook build docs)"]
    for path, page in pages.items():
        where = path.relative_to(book)
        for line, attr, link in page.links:
            if not link or external(link):
                continue
            parts = urlsplit(link)
            target = path if not parts.path else (path.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if target != book and book not in target.parents:
                broken.append(f"{where}:{line}: {attr}={link!r} points outside the book")
                continue
            if not target.is_file():
                broken.append(f"{where}:{line}: {attr}={link!r}: no such file")
                continue
            if parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(
                        f"{where}:{line}: {attr}={link!r}: {target.relative_to(book)} has no "
                        f"element with id {parts.fragment!r}"
                    )
    return broken


FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(`+)(?:.(?!\1))*?.?\1")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def markdown_anchors(path: Path) -> set:
    anchors, seen = set(), {}
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        m = None if in_fence else re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = github_anchor(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


def check_markdown(path: Path) -> list:
    broken = []
    in_fence = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        text = CODE_SPAN.sub("", line)
        links = [m.group(1) for m in INLINE_LINK.finditer(text)]
        ref = REFERENCE.match(text)
        if ref:
            links.append(ref.group(1))
        for link in links:
            if external(link):
                continue
            parts = urlsplit(link)
            target = path if not parts.path else (path.parent / unquote(parts.path)).resolve()
            where = f"{path.relative_to(ROOT)}:{number}"
            if target != ROOT and ROOT not in target.parents:
                broken.append(f"{where}: ({link}) points outside the repository")
            elif not target.exists():
                broken.append(f"{where}: ({link}): no such file")
            elif parts.fragment and target.suffix == ".md":
                if unquote(parts.fragment).lower() not in markdown_anchors(target):
                    broken.append(f"{where}: ({link}): {target.relative_to(ROOT)} has no heading "
                                  f"with anchor #{parts.fragment}")
    return broken


def main(argv) -> int:
    book = Path(argv[1]).resolve() if len(argv) > 1 else book_dir()
    broken = check_book(book) + check_markdown(ROOT / "README.md")
    for b in broken:
        print(b)
    if broken:
        print(f"{len(broken)} broken link(s)")
        return 1
    print(f"links ok: {book.relative_to(ROOT) if ROOT in book.parents else book} and README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
