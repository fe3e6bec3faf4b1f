"""Routing traces for the simulator: synthetic (Zipf popularity drifting by a random walk) or recorded.

A trace is an int64 array ``counts[iteration, layer, source_rank, expert]``: how many (token, expert)
inputs that originate on ``source_rank`` the gate sends to ``expert`` (top-k duplicates counted, as in
the design notes).  Source ranks are global ranks; the simulator splits them into EP groups.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import List, Optional

import numpy as np

__all__ = ["synthetic_trace", "balanced_trace", "load_trace_dir", "tile_sources"]


def synthetic_trace(num_sources: int, num_experts: int, iterations: int, layers: int = 1,
                    inputs_per_source: int = 8192, zipf_s: float = 1.2, drift_sigma: float = 0.05,
                    source_sigma: float = 0.3, seed: int = 0,
                    popularity: Optional[np.ndarray] = None) -> np.ndarray:
    """Zipf-skewed expert popularity that drifts by a log-normal random walk between iterations.

    * Each layer starts from Zipf(``zipf_s``) (or the given ``popularity`` vector, e.g. a paper's
      "4 hot experts at 20% each") over a random permutation of the experts.
    * Each iteration multiplies every expert's popularity by ``exp(drift_sigma * N(0,1))`` (smooth
      drift, the "locality" both FlexMoE and Pro-Prophet rely on).
    * Each source rank sees the global popularity times a fixed per-source log-normal preference
      (``source_sigma``), so sources differ, as real data-parallel shards do.
    * Counts are Poisson draws around ``inputs_per_source * p`` with every row fixed up to sum to
      ``inputs_per_source`` (top-k duplicates drawn independently: the simulator needs counts only).
    """
    for name, v in (("num_sources", num_sources), ("num_experts", num_experts),
                    ("iterations", iterations), ("layers", layers),
                    ("inputs_per_source", inputs_per_source)):
        if int(v) < 1:
            raise ValueError(f"synthetic_trace: {name}={v} must be >= 1")
    if zipf_s < 0 or drift_sigma < 0 or source_sigma < 0:
        raise ValueError("synthetic_trace: zipf_s, drift_sigma and source_sigma must be >= 0")
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
            out[it, layer] = _multinomial_rows(rng, inputs_per_source, p)
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
