#!/usr/bin/env python3
"""The crate's import graph between files, its circles, and the imports that run up the layers.

Usage: python3 tools/import_graph.py [--src src] [--dot graph.dot] [--check]

Every path to an item of this crate is read from the code outside `#[cfg(test)]` modules:
`use crate::…`, `use super::…`, `use self::…` trees, and inline `crate::a::B` / `super::B`
paths. A path resolves to the file that defines its module; an item re-exported by a module
(`pub use child::Item`) resolves through the re-export to the file that defines it, so a
`mod.rs` that re-exports is not mistaken for the item's home. A file depends on its parent
`mod.rs` only through a path; declaring `mod child;` is not an edge.

It prints the strongly connected components with more than one file (the import circles) and
every edge that runs from a lower layer to a higher one (`LAYERS` below). With `--check` it
exits non-zero when a circle other than `ALLOWED_CIRCLES` or an upward edge exists.
"""
import argparse
import os
import re
import sys

# Layers from the bottom up, by module path; a file's layer is that of the longest entry that
# prefixes its module path. An import may go to the same layer or a lower one, and a `mod.rs`
# may re-export its own children whatever their layer (that is its surface, not a dependency).
LAYERS = [
    ["profile"],
    # process groups: the communication interface the op traits' collectives name
    ["comm"],
    # the op traits of our backend, their reference bodies and the kernels' dispatch
    ["ops"],
    # the engines, the mesh and its device, FSDP, and the backend decorator that implements
    # the op traits (and runs their collectives)
    ["distributed"],
    ["config"],
    ["text", "vision"],
    ["model", "input", "loss", "peft"],
    ["checkpoint", "data", "io"],
    ["generate", "train", "plan"],
    ["lib"],
]
# The op trait (`ops/backend/mod.rs`), the primitive conversions of its default bodies
# (`prim.rs`) and the reference bodies they call (`kda_scan.rs`, which calls the trait's
# overridable pieces back): Burn's own pattern of default methods over overridable ones.
ALLOWED_CIRCLES = [["ops/backend/mod.rs", "ops/backend/prim.rs", "ops/kda_scan.rs"]]


def module_of(path, src):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] == "mod":
        rel = rel[:-1]
    if rel == ["lib"]:
        return ()
    return tuple(rel)


def strip_tests(text):
    """Drop `#[cfg(test)]` items (a module or a single item) and comments."""
    text = re.sub(r"//[^\n]*", "", text)
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        j = m.end()
        # skip to the item's body and past its matching brace (or to the `;` of a `use`)
        depth, k = 0, j
        while k < len(text):
            c = text[k]
            if c == ";" and depth == 0:
                k += 1
                break
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    k += 1
                    break
            k += 1
        i = k
    out.append(text[i:])
    return "".join(out)


def parse_use_tree(s):
    """Expand a use tree (`a::{b, c::{d, e as f}}`) into paths (lists of segments)."""
    s = re.sub(r"\s+as\s+\w+", "", s)  # `x as y` names x's item
    s = re.sub(r"\s+", "", s)

    def expand(prefix, t):
        if "{" not in t:
            parts = [p for p in t.split("::") if p]
            return [prefix + parts]
        head, _, rest = t.partition("{")
        body = rest[: rest.rfind("}")]
        head_parts = [p for p in head.split("::") if p]
        items, depth, cur = [], 0, ""
        for c in body:
            if c == "," and depth == 0:
                items.append(cur)
                cur = ""
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            cur += c
        if cur:
            items.append(cur)
        out = []
        for it in items:
            out += expand(prefix + head_parts, it)
        return out

    return expand([], s)


class Crate:
    def __init__(self, src):
        self.src = src
        self.files = {}  # module tuple -> path
        for root, _, names in os.walk(src):
            for n in names:
                if n.endswith(".rs"):
                    p = os.path.join(root, n)
                    self.files[module_of(p, src)] = p
        self.text = {m: strip_tests(open(p).read()) for m, p in self.files.items()}
        self.reexports = {m: self._reexports(m) for m in self.files}

    def _inline_mods(self, m):
        """(start, end, name) of each inline `mod name { … }` of module m's text."""
        text, spans = self.text[m], []
        for im in re.finditer(r"\bmod\s+(\w+)\s*\{", text):
            depth, k = 0, im.end() - 1
            while k < len(text):
                if text[k] == "{":
                    depth += 1
                elif text[k] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                k += 1
            spans.append((im.end(), k, im.group(1)))
        return spans

    def _scope(self, m, pos, spans):
        """The module path in force at `pos` of m's text (inline modules included)."""
        inner = [name for start, end, name in spans if start <= pos < end]
        return m + tuple(inner)

    def _uses(self, m):
        """(path segments, is_pub) for each `use` in module m, made absolute."""
        out, spans = [], self._inline_mods(m)
        for um in re.finditer(r"(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", self.text[m]):
            is_pub = bool(um.group(1))
            scope = self._scope(m, um.start(), spans)
            for path in parse_use_tree(um.group(2)):
                absolute = self.absolute(scope, path)
                if absolute is not None:
                    out.append((absolute, is_pub))
        return out

    def absolute(self, m, path):
        path = [p for p in path if p]
        if not path:
            return None
        if path[0] == "crate":
            return tuple(path[1:])
        if path[0] == "super":
            base = list(m[:-1])
            rest = path[1:]
            while rest and rest[0] == "super":
                base = base[:-1]
                rest = rest[1:]
            return tuple(base + rest)
        if path[0] == "self":
            return tuple(list(m) + path[1:])
        # a child module named without `self::` (2018 paths: `use child::Item` in a mod.rs)
        if m + (path[0],) in self.files or (m in self.files and any(n == path[0] for _, _, n in self._inline_mods(m))):
            return tuple(list(m) + path)
        return None

    def _reexports(self, m):
        res = {}
        for path, is_pub in self._uses(m):
            if is_pub and path:
                res[path[-1]] = path
        return res

    def resolve(self, path, seen=None):
        """The file defining the item at `path` (absolute module path plus item)."""
        seen = seen or set()
        path = tuple(path)
        # longest prefix that is a module
        for k in range(len(path), -1, -1):
            mod = path[:k]
            if mod in self.files:
                rest = path[k:]
                if rest and rest[0] in self.reexports.get(mod, {}) and (mod, rest[0]) not in seen:
                    seen.add((mod, rest[0]))
                    target = self.reexports[mod][rest[0]]
                    if target == "*":
                        return mod
                    return self.resolve(tuple(target) + rest[1:], seen)
                return mod
        return None

    def edges(self):
        result = {}
        for m in self.files:
            deps = set()
            for path, is_pub in self._uses(m):
                if path and path[-1] == "*":
                    target = self.resolve(path[:-1])
                else:
                    target = self.resolve(path)
                if target is not None and target != m:
                    deps.add(target)
            spans = self._inline_mods(m)
            code = re.sub(r"(pub(?:\([^)]*\))?\s+)?use\s+[^;]+;", lambda u: " " * len(u.group(0)), self.text[m])
            for im in re.finditer(r"(?<![:\w])(crate|super)((?:::\w+)+)", code):
                segs = [im.group(1)] + [s for s in im.group(2).split("::") if s]
                ab = self.absolute(self._scope(m, im.start(), spans), segs)
                if ab is None:
                    continue
                target = self.resolve(ab)
                if target is not None and target != m:
                    deps.add(target)
            result[m] = deps
        return result


def layer_of(m):
    best, layer = -1, len(LAYERS)
    for i, names in enumerate(LAYERS):
        for entry in names:
            prefix = () if entry == "lib" else tuple(entry.split("::"))
            if m[: len(prefix)] == prefix and len(prefix) > best:
                best, layer = len(prefix), i
    return layer


def sccs(graph):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
            out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def name(m, crate):
    return os.path.relpath(crate.files[m], crate.src)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default=os.path.join(os.path.dirname(__file__), "..", "src"))
    ap.add_argument("--dot")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    crate = Crate(os.path.normpath(args.src))
    graph = crate.edges()
    n_edges = sum(len(v) for v in graph.values())
    print(f"{len(graph)} files, {n_edges} file-to-file imports")
    circles = [sorted(name(m, crate) for m in c) for c in sccs(graph) if len(c) > 1]
    allowed = [sorted(c) for c in ALLOWED_CIRCLES]
    bad = [c for c in circles if c not in allowed]
    print(f"{len(circles)} import circle(s)")
    for c in sorted(circles, key=len, reverse=True):
        tag = "allowed: " if c in allowed else ""
        print(f"  {tag}{len(c)} files: {', '.join(c)}")
        members = {m for m in graph if name(m, crate) in c}
        for a in sorted(members):
            for b in sorted(graph[a] & members):
                print(f"      {name(a, crate)} -> {name(b, crate)}")
    upward = []
    for a, deps in graph.items():
        for b in deps:
            if layer_of(b) > layer_of(a) and b[: len(a)] != a:
                upward.append((name(a, crate), name(b, crate)))
    print(f"{len(upward)} import(s) up the layers")
    for a, b in sorted(upward):
        print(f"  {a} -> {b}")
    if args.dot:
        with open(args.dot, "w") as f:
            f.write("digraph imports {\n")
            for a, deps in sorted(graph.items()):
                for b in sorted(deps):
                    f.write(f'  "{name(a, crate)}" -> "{name(b, crate)}";\n')
            f.write("}\n")
    if args.check and (bad or upward):
        sys.exit(1)


if __name__ == "__main__":
    main()
