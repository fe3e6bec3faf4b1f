#!/usr/bin/env python
"""Preprocessing throughput and memory: tools/preprocess_data.py (--workers 2) vs the peer,
megatron-core's own ``IndexedDatasetBuilder`` fed by the same tokenizer in one process.

    python bench/preprocess.py [--target-mb 6] [--workers 2] [--repeats 2] [--work-dir DIR]

Corpus: tools/make_corpus.py (standard-library docstrings and comments) repeated to about
``--target-mb``; tokenizer: a sentencepiece model trained on it (tools/train_tokenizer.py, vocab
4000) unless ``--tokenizer-model`` is given. Both sides run as child processes doing the same
work (read JSONL, json.loads, tokenize, append eod, write .bin/.idx with the same dtype):

* tokens/s over the processing time each reports (from opening the input to the finished .idx),
  and over the child's wall time (imports included);
* peak memory of the child's process tree: PSS (proportional set size: pages shared by forked
  workers are split, not counted once per process), sampled every 0.25 s because reading it is
  slow; and RssAnon (anonymous memory, every 25 ms; counts pages a forked worker still shares
  with its parent in each process, so it overstates ours);
* CPU seconds of each child's whole process tree (imports included);
* ours is also run on half the corpus, to show its peak memory does not grow with the input.

The outputs of both are compared byte for byte. Best of ``--repeats`` runs per side, interleaved.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# ------------------------------------------------------------------------------------- peer
def run_peer(args) -> None:
    """One process: megatron-core's IndexedDatasetBuilder fed line by line by our tokenizer."""
    import numpy as np

    from megatron_moe.data.tokenizers import build_tokenizer  # first: quiets import notices
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: I001

    tok = build_tokenizer(tokenizer_type="SentencePieceTokenizer",
                          tokenizer_model=args.tokenizer_model)
    dtype = DType.optimal_dtype(tok.vocab_size)
    start = time.time()
    builder = IndexedDatasetBuilder(args.output_prefix + ".bin", dtype=dtype)
    tokens = docs = 0
    with open(args.input, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            ids = tok.tokenize(json.loads(line)["text"])
            if not ids:
                continue
            ids.append(tok.eod)
            builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
            tokens += len(ids)
            docs += 1
    builder.finalize(args.output_prefix + ".idx")
    print(f"Done: {docs} documents, {tokens} tokens in {time.time() - start:.2f}s")


# ---------------------------------------------------------------------------------- measure
def _children(pid: int):
    """Direct children from /proc (cheap; psutil's children() scans every process)."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _anon_rss(pid: int) -> int:
    """RssAnon in bytes from /proc/PID/status: the process's anonymous (heap) memory, what grows
    with the data. Reading it costs microseconds, unlike smaps/PSS (tens of ms for a process
    that imported torch), so sampling does not steal the CPU being measured."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _pss(pid: int) -> int:
    """PSS in bytes (/proc/PID/smaps_rollup): shared pages split between the processes sharing
    them, so forked workers are not counted as copies of their parent. Costs ~10-30 ms for a
    process that imported torch, hence sampled less often."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree(pid: int):
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo += _children(p)
    return pids


def measure(cmd) -> dict:
    """Run cmd; wall time, peak anonymous memory of its process tree, CPU seconds, and the
    'N tokens in S s' it prints."""
    import resource

    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    peak = {"anon": 0, "pss": 0}
    done = threading.Event()

    def sample():
        n = 0
        while not done.is_set():
            pids = _tree(child.pid)
            peak["anon"] = max(peak["anon"], sum(_anon_rss(p) for p in pids))
            if n % 10 == 0:
                peak["pss"] = max(peak["pss"], sum(_pss(p) for p in pids))
            n += 1
            done.wait(0.025)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = child.communicate()
    wall = time.time() - start
    done.set()
    sampler.join()
    if child.returncode != 0:
        raise SystemExit(f"bench/preprocess.py: {' '.join(cmd[:3])} failed:\n{err[-2000:]}")
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # includes the reaped pool workers
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    m = re.search(r"(\d+) tokens in ([0-9.]+)s", out)
    tokens, secs = int(m.group(1)), float(m.group(2))
    return dict(wall=wall, pss_mb=peak["pss"] / 2 ** 20, anon_mb=peak["anon"] / 2 ** 20,
                tokens=tokens, seconds=secs, cpu=cpu)


def prepare(work, target_mb, tokenizer_model):
    from tools import make_corpus, train_tokenizer

    base = os.path.join(work, "stdlib.jsonl")
    if not os.path.exists(base):
        make_corpus.main(["--output", base])
    with open(base, encoding="utf-8") as f:
        lines = f.readlines()
    size = sum(len(line.encode("utf-8")) for line in lines)
    reps = max(1, round(target_mb * 1e6 / size))
    corpus = os.path.join(work, f"corpus_x{reps}.jsonl")
    half = os.path.join(work, f"corpus_half.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        for _ in range(reps):
            f.writelines(lines)
    with open(half, "w", encoding="utf-8") as f:
        for _ in range(max(1, reps // 2)):
            f.writelines(lines)
    if tokenizer_model is None:
        tokenizer_model = os.path.join(work, "tok.model")
        if not os.path.exists(tokenizer_model):
            train_tokenizer.main(["--input", base, "--model-prefix", tokenizer_model[:-6],
                                  "--vocab-size", "4000"])
    return corpus, half, tokenizer_model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target-mb", type=float, default=6.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--tokenizer-model", default=None)
    # internal: the peer's child process
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--input", help=argparse.SUPPRESS)
    p.add_argument("--output-prefix", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer:
        return run_peer(args)

    work = args.work_dir or tempfile.mkdtemp(prefix="bench_preprocess_")
    os.makedirs(work, exist_ok=True)
    corpus, half, model = prepare(work, args.target_mb, args.tokenizer_model)
    py = sys.executable
    ours_prefix, peer_prefix = os.path.join(work, "ours"), os.path.join(work, "peer")
    ours_cmd = [py, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus,
                "--output-prefix", ours_prefix, "--tokenizer-type", "SentencePieceTokenizer",
                "--tokenizer-model", model, "--workers", str(args.workers), "--append-eod",
                "--no-progress", "--log-interval", "0"]
    peer_cmd = [py, os.path.abspath(__file__), "--peer", "--input", corpus, "--output-prefix",
                peer_prefix + "_text_document", "--tokenizer-model", model]
    half_cmd = ours_cmd[:]
    half_cmd[half_cmd.index(corpus)] = half
    half_cmd[half_cmd.index(ours_prefix)] = os.path.join(work, "half")

    load0 = " ".join(f"{x:.1f}" for x in os.getloadavg())
    ours, peer, ours_half = [], [], []
    for _ in range(args.repeats):
        ours.append(measure(ours_cmd))
        peer.append(measure(peer_cmd))
    ours_half.append(measure(half_cmd))

    identical = all(filecmp.cmp(f"{ours_prefix}_text_document{e}",
                                f"{peer_prefix}_text_document{e}", shallow=False)
                    for e in (".bin", ".idx"))
    best = lambda runs, k: min(r[k] for r in runs)  # noqa: E731
    mb = os.path.getsize(corpus) / 1e6
    tokens = ours[0]["tokens"]
    rows = [
        ("ours (--workers %d)" % args.workers, ours),
        ("peer (IndexedDatasetBuilder, 1 proc)", peer),
    ]
    print(f"corpus: {mb:.1f} MB, {tokens} tokens (sentencepiece vocab 4000), cpus={os.cpu_count()}")
    print(f"{'':38s} {'tokens/s':>10s} {'tokens/s wall':>13s} {'peak PSS MB':>11s} "
          f"{'peak anon MB':>12s} {'CPU s':>6s}")
    for name, runs in rows:
        print(f"{name:38s} {tokens / best(runs, 'seconds'):10.0f} "
              f"{tokens / best(runs, 'wall'):13.0f} {best(runs, 'pss_mb'):11.1f} "
              f"{best(runs, 'anon_mb'):12.1f} {best(runs, 'cpu'):6.2f}")
    print(f"(best of {args.repeats}; load average before: {load0}; wall and CPU s include imports)")
    speed = best(peer, "seconds") / best(ours, "seconds")
    speed_wall = best(peer, "wall") / best(ours, "wall")
    mem = best(ours, "pss_mb") / best(peer, "pss_mb")
    print(f"ratio ours/peer: throughput x{speed:.2f} (processing), x{speed_wall:.2f} (wall); "
          f"peak memory (PSS) x{mem:.2f}")
    print(f"ours on half the corpus ({os.path.getsize(half) / 1e6:.1f} MB): peak PSS "
          f"{best(ours_half, 'pss_mb'):.1f} MB vs {best(ours, 'pss_mb'):.1f} MB on the full one")
    print(f"outputs token-identical (byte-identical .bin/.idx): {identical}")
    if not identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
