"""Value types of Megatron's flags that more than one parser section uses (arguments.py, gpt-oss)."""

from __future__ import annotations

import argparse


def layer_freq(text):
    """Megatron's moe_freq_type: an int N, or a list expression such as '([0]+[1]*26)'."""
    text = text.strip()
    if "[" in text:
        try:
            values = _list_expression(text)
        except (ValueError, SyntaxError):
            raise argparse.ArgumentTypeError(f"invalid list expression {text!r}")
        if any(v not in (0, 1) for v in values):
            raise argparse.ArgumentTypeError("list entries must be 0 or 1")
        return values
    return int(text)


def _list_expression(text):
    """Evaluate list literals of ints joined by + and * (Megatron eval()s the string; no eval here)."""
    import ast

    def value(node):
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(text)

    out = value(ast.parse(text, mode="eval").body)
    if not isinstance(out, list) or not all(type(v) is int for v in out):
        raise ValueError(text)
    return out
