#!/usr/bin/env python3
"""Lists the import circles between the files of each crate: file A names something of file B
(`use crate::b::...`, `super::b::...`, `crate::b::f(...)` in code) while B, directly or through other
files, names something of A. Prints each circle's files and exits 1 if there is any.

    scripts/import-cycles.py [CRATE_DIR ...]      (default: every crate under crates/)

A file's module path comes from its place under src/ (`a/mod.rs` and `a.rs` are `a`). A path that names
an item of a module (`crate::a::Item`) counts as an edge to `a`'s file; child modules declared inside a
file (`mod tests { ... }`) belong to it. Test modules are skipped: they may use their parent freely.

A module root (`mod.rs`, `lib.rs`, or `a.rs` beside an `a/` directory) naming its own child's items is an
edge like any other: for each `mod child;` it declares, `child::Item` in code, `use child::Item;` and
`pub use child::{A, B};` count as edges to the child's file. So a child that uses `super::Item` of its
parent while the parent uses the child is a circle; what both need belongs in a file below both, and
children reach their siblings directly (`super::sibling::Item`), not through the parent's re-exports.
A group `use super::{a, b};` names the parent itself too, so a child names its siblings one `use` each.
"""

import re
import sys
from pathlib import Path

PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE_GROUP = re.compile(r"\buse\s+([A-Za-z_][A-Za-z0-9_]*)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^;]*)\}\s*;", re.S)
# Comments, raw strings, strings (a `\` at a line's end continues one) and character literals, in one
# pass from the left, so that `//` in a string or `"` in a character literal is not taken for the other.
LEXEMES = re.compile(r"""//[^\n]*|/\*.*?\*/|r(#*)".*?"\1|"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\\n])'""", re.S)
CHILD = re.compile(r"\bmod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;")


def module_of(src: Path, f: Path):
    parts = list(f.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts.pop()
    return tuple(parts)


def strip(text: str) -> str:
    """The code without comments, strings and `#[cfg(test)]` modules."""
    text = LEXEMES.sub(lambda m: "" if m.group(0).startswith("/") else '""', text)
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def base_of(m, kind, rest):
    """The module path that `kind::rest` names from inside module `m` (`kind` is `crate`, `super`,
    `self`, or one of `m`'s own child modules)."""
    if kind not in ("crate", "super", "self"):
        return list(m) + [kind] + rest
    base = [] if kind == "crate" else list(m) if kind == "self" else list(m[:-1])
    while rest and rest[0] == "super":
        rest, base = rest[1:], base[:-1]
    return base + rest


def resolve(modules, path):
    """The longest module prefix of `path` that is a file of the crate."""
    for n in range(len(path), -1, -1):
        if tuple(path[:n]) in modules:
            return tuple(path[:n])
    return None


def edges(src: Path):
    files = sorted(src.rglob("*.rs"))
    modules = {module_of(src, f): f for f in files}
    graph = {m: set() for m in modules}
    for m, f in modules.items():
        if "tests" in m or f.name == "tests.rs" or f.name.endswith("_tests.rs"):
            continue
        text = strip(f.read_text())
        targets = []
        children = set(CHILD.findall(text))
        for g in USE_GROUP.finditer(text):
            if g.group(1) not in ("crate", "super", "self") and g.group(1) not in children:
                continue
            root = base_of(m, g.group(1), [x for x in g.group(2).split("::") if x])
            for item in re.split(r"[,{}\s]+", g.group(3)):
                if item and item != "self":
                    targets.append(root + item.split("::"))
            targets.append(root)
        for p in PATH.finditer(text):
            targets.append(base_of(m, p.group(1), [x for x in p.group(2).split("::") if x]))
        for child in children:
            for p in re.finditer(r"(?<![:\w])" + child + r"((?:::[A-Za-z_][A-Za-z0-9_]*)+)", text):
                targets.append(base_of(m, child, [x for x in p.group(1).split("::") if x]))
        for t in targets:
            r = resolve(modules, t)
            if r is not None and r != m and r != ():
                graph[m].add(r)
    return modules, graph


def circles(graph):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def main():
    root = Path(__file__).resolve().parent.parent
    crates = [Path(a) for a in sys.argv[1:]] or sorted(p.parent for p in root.glob("crates/*/Cargo.toml"))
    found = 0
    for c in crates:
        src = c / "src"
        if not src.is_dir():
            continue
        modules, graph = edges(src)
        for comp in circles(graph):
            found += 1
            names = [str(modules[m].relative_to(c)) for m in comp]
            print(f"{c.name}: {' <-> '.join(names)}")
            for m in comp:
                uses = sorted(str(modules[t].relative_to(c)) for t in graph[m] if t in comp)
                print(f"    {modules[m].relative_to(c)} uses {', '.join(uses)}")
    if found:
        print(f"{found} import circle(s)")
        return 1
    print("no import circles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
