"""Routing traces for the simulator: synthetic (Zipf popularity drifting by a random walk) or recorded.

A trace is an int64 array ``counts[iteration, layer, source_rank, expert]``: how many (token, expert)
inputs that originate on ``source_rank`` the gate sends to ``expert`` (a token routed to k experts
counts once at each of its k distinct experts, as in the design notes).  Source ranks are global ranks; the simulator splits them into EP groups.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import List, Optional

import numpy as np

__all__ = ["synthetic_trace", "balanced_trace", "load_trace_dir", "tile_sources", "topk_inclusion"]


def synthetic_trace(num_sources: int, num_experts: int, iterations: int, layers: int = 1,
                    inputs_per_source: int = 8192, zipf_s: float = 1.2, drift_sigma: float = 0.05,
                    source_sigma: float = 0.3, seed: int = 0,
                    popularity: Optional[np.ndarray] = None, top_k: int = 1) -> np.ndarray:
    """Zipf-skewed expert popularity that drifts by a log-normal random walk between iterations.

    * Each layer starts from Zipf(``zipf_s``) (or the given ``popularity`` vector, e.g. a paper's
      "4 hot experts at 20% each") over a random permutation of the experts.
    * Each iteration multiplies every expert's popularity by ``exp(drift_sigma * N(0,1))`` (smooth
      drift, the "locality" both FlexMoE and Pro-Prophet rely on).
    * Each source rank sees the global popularity times a fixed per-source log-normal preference
      (``source_sigma``), so sources differ, as real data-parallel shards do.
    * ``top_k`` = 1: counts are Poisson draws around ``inputs_per_source * p`` with every row fixed up
      to sum to ``inputs_per_source``.
    * ``top_k`` = k > 1: ``inputs_per_source`` = k x tokens, and every token goes to k DISTINCT experts
      (an expert gets at most one copy of a token, as top-k routing does), drawn without replacement
      in proportion to the popularity (:func:`_distinct_topk_rows`): ``p`` is then the distribution of
      a token's first choice, and no expert ever receives more than the source's tokens.
    """
    for name, v in (("num_sources", num_sources), ("num_experts", num_experts),
                    ("iterations", iterations), ("layers", layers),
                    ("inputs_per_source", inputs_per_source)):
        if int(v) < 1:
            raise ValueError(f"synthetic_trace: {name}={v} must be >= 1")
    if zipf_s < 0 or drift_sigma < 0 or source_sigma < 0:
        raise ValueError("synthetic_trace: zipf_s, drift_sigma and source_sigma must be >= 0")
    if top_k < 1 or top_k > num_experts or inputs_per_source % top_k:
        raise ValueError(f"synthetic_trace: top_k={top_k} must be in [1, num_experts={num_experts}] and "
                         f"divide inputs_per_source={inputs_per_source}")
    rng = np.random.default_rng(seed)
    out = np.empty((iterations, layers, num_sources, num_experts), dtype=np.int64)
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)
    if popularity is not None:
        popularity = np.asarray(popularity, dtype=np.float64)
        if popularity.shape != (num_experts,) or (popularity <= 0).any():
            raise ValueError(f"synthetic_trace: popularity must be {num_experts} positive numbers")
    for layer in range(layers):
        logp = -zipf_s * np.log(ranks) if popularity is None else np.log(popularity)
        logp = logp[rng.permutation(num_experts)]
        pref = source_sigma * rng.standard_normal((num_sources, num_experts))
        for it in range(iterations):
            if it:
                logp = logp + drift_sigma * rng.standard_normal(num_experts)
            lp = logp[None, :] + pref
            p = np.exp(lp - lp.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            if top_k == 1:
                out[it, layer] = _multinomial_rows(rng, inputs_per_source, p)
            else:
                out[it, layer] = _distinct_topk_rows(rng, inputs_per_source // top_k, p, top_k)
    return out


def _multinomial_rows(rng, n: int, p: np.ndarray) -> np.ndarray:
    """Per-row counts with mean ``n * p`` and rows summing exactly to ``n``: Poisson draws (one
    vectorised call; multinomial per row is ~40 us each, too slow for 1024 ranks x 100 iterations)
    with the rounding difference put on each row's most popular expert."""
    out = rng.poisson(n * p).astype(np.int64)
    diff = n - out.sum(axis=1)
    j = np.argmax(p, axis=1)
    r = np.arange(p.shape[0])
    out[r, j] = np.maximum(0, out[r, j] + diff)
    short = n - out.sum(axis=1)              # only if the fix-up was clipped at 0 (tiny n)
    if short.any():
        out[r, j] += short
    return out


def topk_inclusion(p: np.ndarray, k: int) -> np.ndarray:
    """Probability that a token picks each expert among its ``k`` distinct ones when it draws them one
    after another without replacement, each in proportion to ``p`` (rows of ``p`` sum to 1): the
    Plackett-Luce / Gumbel-top-k law, i.e. top-k of log-popularity + Gumbel noise.  Rows sum to k,
    every entry <= 1.  k = 2 in closed form, pi_j = p_j + sum_{i != j} p_i p_j / (1 - p_i); larger k
    have no closed form (the papers' runs use k <= 2) and are refused."""
    p = np.asarray(p, dtype=np.float64)
    if k == 1:
        return p.copy()
    if k != 2:
        raise ValueError(f"synthetic_trace: top_k={k}: distinct top-k counts are implemented for k <= 2 "
                         f"(the Plackett-Luce inclusion probability has a closed form there)")
    rest = np.maximum(1.0 - p, np.finfo(np.float64).tiny)      # 1 - p_i = sum of the others
    a = (p / rest).sum(axis=-1, keepdims=True)
    pi = np.minimum(p * (1.0 + a - p / rest), 1.0)
    return pi * (k / pi.sum(axis=-1, keepdims=True))


def _distinct_topk_rows(rng, tokens: int, p: np.ndarray, k: int) -> np.ndarray:
    """Per-row expert counts of ``tokens`` tokens that each go to ``k`` distinct experts, expert j with
    probability ``pi_j`` = :func:`topk_inclusion` (so E[count_j] = tokens x pi_j, as sampling every
    token's k experts without replacement would give), at count level: O(experts) per row instead of
    O(tokens x experts) for per-token Gumbel-top-k (8192 sources x 8192 tokens x 256 experts is 17 G
    draws per layer and iteration).

    Systematic sampling realises the k-subsets: lay the experts' pi_j end to end on [0, k); a token
    with offset u ~ U[0, 1) takes the experts under u, u + 1, ..., u + k - 1.  Every pi_j <= 1, so no
    expert is hit twice by one token, and exactly k are hit.  Counting the tokens per offset interval
    (one exact multinomial per row over the E + 1 pieces that the folded breakpoints cut [0, 1) into;
    numpy's vectorised multinomial costs about what the k=1 Poisson draws do) gives
    count_j = G(C_j) - G(C_{j-1}), with C the cumulative pi and G(x) = floor(x) x tokens +
    #(offsets < frac(x)), so by construction 0 <= count_j <= tokens and the row sums to k x tokens.
    Each count is exactly Binomial(tokens, pi_j), as with per-token sampling; which experts share a
    token (the joint law of the k-subset) is the systematic design's, not Plackett-Luce's, and the
    simulator reads only per-expert counts."""
    pi = topk_inclusion(p, k)
    c = np.cumsum(pi, axis=1)
    c[:, -1] = float(k)                                   # exact total: the last expert ends at k
    fl = np.floor(c)
    fr = c - fl
    order = np.argsort(fr, axis=1, kind="stable")
    srt = np.take_along_axis(fr, order, axis=1)
    pieces = np.diff(srt, axis=1, prepend=0.0, append=1.0)   # [0, b_1), [b_1, b_2), ..., [b_E, 1)
    n = rng.multinomial(tokens, np.maximum(pieces, 0.0))
    below = np.empty_like(n[:, :-1])                      # offsets below each breakpoint
    np.put_along_axis(below, order, np.cumsum(n, axis=1)[:, :-1], axis=1)
    g = fl.astype(np.int64) * tokens + below
    return np.diff(g, axis=1, prepend=0)


def balanced_trace(num_sources: int, num_experts: int, iterations: int, layers: int = 1,
                   inputs_per_source: int = 8192) -> np.ndarray:
    """Perfectly uniform routing (every source sends the same count to every expert)."""
    if inputs_per_source % num_experts:
        raise ValueError(f"balanced_trace: inputs_per_source={inputs_per_source} must be a multiple "
                         f"of num_experts={num_experts}")
    c = inputs_per_source // num_experts
    return np.full((iterations, layers, num_sources, num_experts), c, dtype=np.int64)


def tile_sources(trace: np.ndarray, num_sources: int) -> np.ndarray:
    """Repeat a recorded trace's source rows to ``num_sources`` (to replay a 2-rank recording at scale).

    Rows are repeated cyclically; every EP group of the larger cluster then sees the recorded skew.
    """
    d = trace.shape[2]
    reps = -(-num_sources // d)
    return np.tile(trace, (1, 1, reps, 1))[:, :, :num_sources]


_ITER_RE = re.compile(r"(\d+)")


def _matrix(obj, where: str) -> np.ndarray:
    a = np.asarray(obj, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"{where}: counts must be a 2-D list [source_rank][expert], got shape {a.shape}")
    if (a < 0).any():
        raise ValueError(f"{where}: negative counts")
    return np.rint(a).astype(np.int64)


def _parse_record(obj, where: str):
    """Yield (iteration, layer, matrix) from one JSON object of a trace file.

    Accepted shapes (the training writer's format and simple hand-written ones):
      {"iteration": i, "layer": l, "counts": [[...]]}
      {"iteration": i, "layers": {"0": [[...]], "1": [[...]]}}  or a list of matrices
      {"iteration": i, "counts": [[[...]]]}                         (layer-major 3-D list)
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with 'counts' or 'layers'")
    it = obj.get("iteration", obj.get("iter"))
    if "layers" in obj:
        layers = obj["layers"]
        items = layers.items() if isinstance(layers, dict) else enumerate(layers)
        for l, m in items:
            if isinstance(m, dict):
                m = m.get("counts")
            yield it, int(l), _matrix(m, f"{where} layer {l}")
        return
    if "counts" not in obj:
        raise ValueError(f"{where}: no 'counts' or 'layers' key (keys: {sorted(obj)})")
    a = np.asarray(obj["counts"])
    if a.ndim == 3:
        for l in range(a.shape[0]):
            yield it, l, _matrix(a[l], f"{where} layer {l}")
    else:
        yield it, int(obj.get("layer", obj.get("layer_number", 0))), _matrix(a, where)


def load_trace_dir(path: str, max_iterations: Optional[int] = None) -> np.ndarray:
    """Read the routing trace a training run wrote with ``--moe-routing-trace-dir``.

    Files are ``*.json`` (one object, or a list of objects) or ``*.jsonl`` (one object per line),
    each object giving the source x expert counts of one layer and iteration (see
    :func:`_parse_record`).  Iterations missing an ``iteration`` key are numbered by file order.
    Returns ``counts[iteration, layer, source, expert]`` over the iterations present in every layer.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--trace-dir {path}: not a directory")
    files = sorted(glob.glob(os.path.join(path, "**", "*.json*"), recursive=True))
    if not files:
        raise ValueError(f"--trace-dir {path}: no *.json / *.jsonl files")
    recs = {}
    seq = 0
    for fi, fn in enumerate(files):
        with open(fn) as f:
            text = f.read()
        objs: List = []
        if fn.endswith(".jsonl"):
            for ln, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        objs.append((f"{fn}:{ln}", json.loads(line)))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{fn}:{ln}: invalid JSON ({e.msg})") from None
        else:
            try:
                o = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{fn}:{e.lineno}: invalid JSON ({e.msg})") from None
            objs = [(f"{fn}[{i}]", x) for i, x in enumerate(o)] if isinstance(o, list) else [(fn, o)]
        for where, o in objs:
            for it, layer, m in _parse_record(o, where):
                if it is None:
                    mm = _ITER_RE.findall(os.path.basename(fn))
                    it = int(mm[-1]) if mm else seq
                # one file per EP group (counts_rank<R>.jsonl): the same (iteration, layer) in several
                # files is several groups' source rows; within one file the last record wins
                recs.setdefault((int(it), layer), {})[fi] = (m, where)
            seq += 1
    recs = {k: (np.concatenate([v[f][0] for f in sorted(v)], axis=0), v[min(v)][1])
            for k, v in recs.items()}
    layers = sorted({l for _, l in recs})
    iters = sorted({i for i, _ in recs})
    iters = [i for i in iters if all((i, l) in recs for l in layers)]
    if not iters:
        raise ValueError(f"--trace-dir {path}: no iteration has counts for every layer {layers}")
    if max_iterations:
        iters = iters[:max_iterations]
    shape = recs[(iters[0], layers[0])][0].shape
    out = np.empty((len(iters), len(layers), *shape), dtype=np.int64)
    for a, i in enumerate(iters):
        for b, l in enumerate(layers):
            m, where = recs[(i, l)]
            if m.shape != shape:
                raise ValueError(f"{where}: counts shape {m.shape} differs from {shape}")
            out[a, b] = m
    return out
