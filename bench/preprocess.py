#!/usr/bin/env python
"""Preprocessing speed and memory: tools/preprocess_data.py (--workers 2) vs its peers, per
tokenizer type, start-up included.

    python bench/preprocess.py [--target-mb 6] [--workers 2] [--repeats 3] [--work-dir DIR]
        [--types SentencePieceTokenizer GPT2BPETokenizer BertWordPieceLowerCase
                 HuggingFaceTokenizer Llama2Tokenizer TikTokenizer] [--megatron-lm DIR]

Peers:
* ``builder``: megatron-core's own ``IndexedDatasetBuilder`` fed line by line by the same
  tokenizer object in one process (the library path, no tool around it).
* ``megatron-lm`` (with ``--megatron-lm DIR``, a Megatron-LM checkout at tag core_v0.16.1, not
  part of this repository): its tools/preprocess_data.py run by this Python with the same
  --workers on the same corpus. Its default tokenizer system is used where it runs offline and
  matches (SentencePieceTokenizer); GPT2BPETokenizer and BertWordPiece* need the Hugging Face
  Hub there (AutoTokenizer of 'gpt2' / 'bert-large-uncased'), so they run with
  ``--legacy-tokenizer`` (Megatron's own gpt2_tokenization.py / bert_tokenization.py), as
  does HuggingFaceTokenizer (faster than the default system there, same ids) and
  Llama2Tokenizer (its default system maps that name to the plain sentencepiece wrapper, no
  bos: GPTSentencePieceTokenizer here); TikTokenizer runs in its default system. Extra
  directories for its imports (six, pydantic) go in ``--megatron-lm-pythonpath``.

Corpus: tools/make_corpus.py (standard-library docstrings and comments) repeated to about
``--target-mb``. Tokenizers (vocab 8000) are trained on it: sentencepiece BPE
(tools/train_tokenizer.py), and with ``tokenizers`` a byte-level BPE (vocab.json/merges.txt,
also saved as a tokenizer.json directory for HuggingFaceTokenizer) and a WordPiece vocab.txt.
All runs append eod except BERT's (Megatron-LM's legacy BERT tokenizer appends an added [EOS],
its default system [SEP]; BERT data is usually written without).

Measured per run: wall time (imports and start-up included: what a user waits for); peak memory
of the process tree as PSS (shared pages split between forked workers), sampled every 0.25 s,
and RssAnon every 25 ms; CPU seconds of the tree. Runs are interleaved, medians of
``--repeats``. Ours is also run on half the corpus: peak memory must not grow with the input.
Outputs are compared byte for byte with every peer's.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import statistics
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

    tok = build_tokenizer(**json.loads(args.tokenizer_json))
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
            if args.append_eod:
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


def measure(cmd, env=None) -> dict:
    """Run cmd; wall time, peak memory of its process tree, CPU seconds."""
    import resource

    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
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
        raise SystemExit(f"bench/preprocess.py: {' '.join(cmd[:4])} failed:\n{err[-3000:]}")
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # includes the reaped pool workers
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    return dict(wall=wall, pss_mb=peak["pss"] / 2 ** 20, anon_mb=peak["anon"] / 2 ** 20, cpu=cpu)


# ------------------------------------------------------------------------------------ corpus
TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "BertWordPieceLowerCase",
         "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer")


def prepare(work, target_mb):
    """The corpus (full and half) and a tokenizer of each type trained on it."""
    from tools import make_corpus, train_tokenizer

    base = os.path.join(work, "stdlib.jsonl")
    if not os.path.exists(base):
        make_corpus.main(["--output", base])
    with open(base, encoding="utf-8") as f:
        lines = f.readlines()
    size = sum(len(line.encode("utf-8")) for line in lines)
    reps = max(2, round(target_mb * 1e6 / size))
    corpus = os.path.join(work, f"corpus_x{reps}.jsonl")
    half = os.path.join(work, f"corpus_x{reps // 2}.jsonl")
    for path, n in ((corpus, reps), (half, reps // 2)):
        with open(path, "w", encoding="utf-8") as f:
            for _ in range(n):
                f.writelines(lines)
    files = {"sp": os.path.join(work, "sp.model"), "hf": os.path.join(work, "hf"),
             "vocab": os.path.join(work, "vocab.json"), "merges": os.path.join(work, "merges.txt"),
             "bert": os.path.join(work, "bert_vocab.txt"), "tik": os.path.join(work, "tik.json")}
    if not os.path.exists(files["sp"]):
        train_tokenizer.main(["--input", base, "--model-prefix", files["sp"][:-6],
                              "--vocab-size", "8000", "--num-threads", "1"])
    if not os.path.exists(files["bert"]):
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

        docs = [json.loads(line)["text"] for line in lines]
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        bpe.train_from_iterator(docs, trainers.BpeTrainer(
            vocab_size=8000, special_tokens=["<|endoftext|>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        bpe.model.save(work)
        os.makedirs(files["hf"], exist_ok=True)
        bpe.save(os.path.join(files["hf"], "tokenizer.json"))
        with open(os.path.join(files["hf"], "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "<|endoftext|>",
                       "tokenizer_class": "PreTrainedTokenizerFast"}, f)
        wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        wp.normalizer = normalizers.BertNormalizer(lowercase=True)
        wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        wp.train_from_iterator(docs, trainers.WordPieceTrainer(
            vocab_size=8000, show_progress=False,
            special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
        inv = {i: t for t, i in wp.get_vocab().items()}
        with open(files["bert"], "w", encoding="utf-8") as f:
            f.write("".join(inv[i] + "\n" for i in range(len(inv))))
    if not os.path.exists(files["tik"]):  # Megatron's tiktoken JSON vocabulary, 8000 ranks
        from tests._data_helpers import write_tiktoken_vocab

        write_tiktoken_vocab([json.loads(line)["text"] for line in lines], files["tik"], 7744)
    return corpus, half, files


def tokenizer_settings(kind, files):
    """(flags, build_tokenizer kwargs, Megatron-LM extra flags, append eod) for one type."""
    if kind == "SentencePieceTokenizer":
        return (["--tokenizer-model", files["sp"]], dict(tokenizer_model=files["sp"]), [], True)
    if kind == "GPT2BPETokenizer":
        flags = ["--vocab-file", files["vocab"], "--merge-file", files["merges"]]
        return (flags, dict(vocab_file=files["vocab"], merge_file=files["merges"]),
                ["--legacy-tokenizer"], True)
    if kind == "Llama2Tokenizer":  # Megatron's _Llama2Tokenizer is in its legacy system only
        return (["--tokenizer-model", files["sp"]], dict(tokenizer_model=files["sp"]),
                ["--legacy-tokenizer"], True)
    if kind == "TikTokenizer":  # default system (tiktoken runs offline there)
        with open(files["tik"]) as f:
            vocab = 1000 + len(json.load(f))  # the 1000 special ids + the file's ranks
        flags = ["--tokenizer-model", files["tik"], "--vocab-size", str(vocab),
                 "--tiktoken-pattern", "v2"]
        return (flags, dict(tokenizer_model=files["tik"], vocab_size=vocab,
                            tiktoken_pattern="v2"), [], True)
    if kind == "HuggingFaceTokenizer":
        return (["--tokenizer-model", files["hf"]], dict(tokenizer_model=files["hf"]),
                ["--legacy-tokenizer"], True)
    return (["--vocab-file", files["bert"]], dict(vocab_file=files["bert"]),
            ["--legacy-tokenizer"], False)


def _same(prefix_a, prefix_b):
    return all(filecmp.cmp(prefix_a + e, prefix_b + e, shallow=False) for e in (".bin", ".idx"))


def _median(runs, key):
    return statistics.median(r[key] for r in runs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target-mb", type=float, default=6.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--types", nargs="+", choices=TYPES, default=list(TYPES))
    p.add_argument("--megatron-lm", default=None,
                   help="a Megatron-LM checkout (tag core_v0.16.1) whose tools/preprocess_data.py "
                        "is run as a peer")
    p.add_argument("--megatron-lm-pythonpath", default="",
                   help="extra import path for Megatron-LM's tool (its deps: six, pydantic)")
    # internal: the builder peer's child process
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--input", help=argparse.SUPPRESS)
    p.add_argument("--output-prefix", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer-json", help=argparse.SUPPRESS)
    p.add_argument("--append-eod", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer:
        return run_peer(args)

    work = args.work_dir or tempfile.mkdtemp(prefix="bench_preprocess_")
    os.makedirs(work, exist_ok=True)
    corpus, half, files = prepare(work, args.target_mb)
    py = sys.executable
    mb = os.path.getsize(corpus) / 1e6
    print(f"corpus: {mb:.1f} MB ({os.path.basename(corpus)}), --workers {args.workers}, "
          f"cpus={os.cpu_count()}, load average before: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    results = {}
    for kind in args.types:
        flags, kwargs, mlm_extra, eod = tokenizer_settings(kind, files)
        kwargs["tokenizer_type"] = kind
        out = {name: os.path.join(work, f"{kind}_{name}") for name in ("ours", "half", "builder",
                                                                        "mlm")}
        common = ["--tokenizer-type", kind, *flags, "--workers", str(args.workers),
                  *(["--append-eod"] if eod else [])]
        cmds = {
            "ours": [py, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus,
                     "--output-prefix", out["ours"], *common, "--no-progress",
                     "--log-interval", "0"],
            "builder": [py, os.path.abspath(__file__), "--peer", "--input", corpus,
                        "--output-prefix", out["builder"] + "_text_document",
                        "--tokenizer-json", json.dumps(kwargs),
                        *(["--append-eod"] if eod else [])],
        }
        envs = {}
        if args.megatron_lm:
            cmds["megatron-lm"] = [py, os.path.join(args.megatron_lm, "tools",
                                                    "preprocess_data.py"),
                                   "--input", corpus, "--output-prefix", out["mlm"], *common,
                                   *mlm_extra, "--log-interval", "1000000000"]
            envs["megatron-lm"] = {"PYTHONPATH": args.megatron_lm_pythonpath,
                                   "HF_HUB_OFFLINE": "1"}
        runs = {name: [] for name in cmds}
        for _ in range(args.repeats):  # interleaved: load changes hit every side alike
            for name, cmd in cmds.items():
                runs[name].append(measure(cmd, envs.get(name)))
        half_cmd = cmds["ours"][:]
        half_cmd[half_cmd.index(corpus)] = half
        half_cmd[half_cmd.index(out["ours"])] = out["half"]
        ours_half = measure(half_cmd)
        ours_prefix = out["ours"] + "_text_document"
        same = {"builder": _same(ours_prefix, out["builder"] + "_text_document")}
        if args.megatron_lm:
            same["megatron-lm"] = _same(ours_prefix, out["mlm"] + "_text_document")
        print(f"\n{kind} ({'eod appended' if eod else 'no eod'}; Megatron-LM flags: "
              f"{' '.join(mlm_extra) or '(default)'})")
        print(f"  {'':14s} {'wall s':>7s} {'MB/s':>6s} {'peak PSS MB':>11s} {'peak anon MB':>12s} "
              f"{'CPU s':>6s}  identical to ours")
        for name, rs in runs.items():
            w = _median(rs, "wall")
            print(f"  {name:14s} {w:7.2f} {mb / w:6.2f} {_median(rs, 'pss_mb'):11.1f} "
                  f"{_median(rs, 'anon_mb'):12.1f} {_median(rs, 'cpu'):6.2f}  "
                  f"{'' if name == 'ours' else same[name]}")
        ratios = {name: _median(runs[name], "wall") / _median(runs["ours"], "wall")
                  for name in runs if name != "ours"}
        cpu_ratios = {name: _median(runs[name], "cpu") / _median(runs["ours"], "cpu")
                      for name in runs if name != "ours"}
        print("  ratio (peer wall / ours, start-up included): "
              + ", ".join(f"{n} x{r:.2f}" for n, r in ratios.items())
              + "; CPU seconds: " + ", ".join(f"{n} x{r:.2f}" for n, r in cpu_ratios.items()))
        print(f"  ours on half the corpus: peak PSS {ours_half['pss_mb']:.1f} MB vs "
              f"{_median(runs['ours'], 'pss_mb'):.1f} MB on the full one")
        results[kind] = dict(ratios=ratios, cpu_ratios=cpu_ratios, identical=same,
                             ours_wall=_median(runs["ours"], "wall"))
    print(f"\n(medians of {args.repeats}; load average after: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())})")
    if not all(all(r["identical"].values()) for r in results.values()):
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
