#!/usr/bin/env python
"""Build a small real-text corpus offline from the Python standard library.

    python tools/make_corpus.py --output corpus.jsonl [--max-docs N] [--max-bytes B]

Documents, one JSON object ``{"text": ...}`` per line: each module's, class's and function's
docstring (cleaned with ``inspect.cleandoc``), and per module the text of its ``#`` comments
(consecutive comment lines joined into paragraphs). Files are visited in sorted order and
test suites, site-packages and generated files are left out, so the output is deterministic for a
given Python version. Stops at ``--max-docs`` documents or ``--max-bytes`` (default 4 MB).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import os
import sys
import sysconfig
import tokenize

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
              "lib2to3", "turtledemo", "ensurepip", "venv", "pydoc_data", "encodings"}


def stdlib_files(root: str):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("test_"):
                yield os.path.join(dirpath, name)


def _docstrings(tree):
    nodes = [tree] + [n for n in ast.walk(tree)
                      if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in nodes:
        doc = ast.get_docstring(node, clean=False)
        if doc:
            doc = inspect.cleandoc(doc).strip()
            if len(doc) >= 40:
                yield doc


def _comments(source: str):
    paragraphs, cur, last_line = [], [], -2
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            text = tok.string.lstrip("#").strip()
            if text.startswith("!") or "coding" in text[:12] or "-*-" in text:
                continue
            if tok.start[0] != last_line + 1 and cur:
                paragraphs.append(" ".join(cur))
                cur = []
            if text:
                cur.append(text)
            last_line = tok.start[0]
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    if cur:
        paragraphs.append(" ".join(cur))
    # keep prose, drop short code-like remarks and separator lines
    return [p for p in paragraphs if len(p) >= 30 and sum(c.isalpha() for c in p) > len(p) // 2]


def iter_documents(root: str):
    for path in stdlib_files(root):
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        yield from _docstrings(tree)
        comments = _comments(source)
        if comments:
            yield "\n".join(comments)


def get_args(argv=None):
    p = argparse.ArgumentParser(prog="make_corpus.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--max-bytes", type=int, default=4_000_000)
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"],
                   help="standard library directory (default: this Python's)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = get_args(argv)
    if not os.path.isdir(args.stdlib):
        raise SystemExit(f"make_corpus.py: error: --stdlib: {args.stdlib} is not a directory")
    docs = nbytes = 0
    tmp = args.output + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for text in iter_documents(args.stdlib):
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                size = len(line.encode("utf-8"))
                if (args.max_docs is not None and docs >= args.max_docs) or \
                        nbytes + size > args.max_bytes:
                    break
                out.write(line)
                docs += 1
                nbytes += size
        os.replace(tmp, args.output)
    except OSError as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise SystemExit(f"make_corpus.py: error: --output: {exc}") from None
    print(f"wrote {docs} documents ({nbytes / 1e6:.2f} MB) to {args.output}", file=sys.stderr)
    return {"documents": docs, "bytes": nbytes}


if __name__ == "__main__":
    main()
