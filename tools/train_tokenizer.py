#!/usr/bin/env python
"""Train a sentencepiece tokenizer on a JSONL corpus (for --tokenizer-type SentencePieceTokenizer).

    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix tok --vocab-size 4000
    # -> tok.model, tok.vocab (prints the model path)

The corpus is streamed to sentencepiece line by line (each non-blank line of each document's text
is one training sentence); sentencepiece keeps at most ``--input-sentence-size`` sentences
(a uniform sample), so memory stays bounded. Special ids: unk 0, bos 1, eos 2 (used as
end-of-document), pad 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


class TrainTokenizerError(Exception):
    pass


def get_args(argv=None):
    p = argparse.ArgumentParser(prog="train_tokenizer.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, nargs="+", help="JSONL file(s)")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--model-type", choices=("bpe", "unigram", "char", "word"), default="bpe")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="sample at most this many sentences (bounds memory)")
    p.add_argument("--max-sentence-length", type=int, default=8192, help="in bytes; longer "
                   "lines are skipped by sentencepiece")
    p.add_argument("--byte-fallback", action="store_true",
                   help="encode unknown characters as bytes (needs vocab >= 260)")
    p.add_argument("--normalization-rule-name", default="nmt_nfkc",
                   help="sentencepiece normalization (identity keeps text byte-exact)")
    p.add_argument("--skip-malformed", action="store_true", help="skip bad JSON lines")
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    if args.vocab_size < 8:
        p.error(f"--vocab-size must be >= 8 (got {args.vocab_size})")
    if not 0.0 < args.character_coverage <= 1.0:
        p.error(f"--character-coverage must be in (0, 1] (got {args.character_coverage})")
    return args


def iter_sentences(paths, keys, skip_malformed=False, counter=None):
    """Non-blank lines of each document's text, streamed."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                    texts = [data[k] for k in keys]
                    if not all(isinstance(t, (str, list)) for t in texts):
                        raise TypeError("value is not a string or list")
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    if skip_malformed:
                        if counter is not None:
                            counter["skipped"] += 1
                        continue
                    raise TrainTokenizerError(f"{path}:{lineno}: {type(exc).__name__}: {exc} "
                                              f"(use --skip-malformed to skip)") from None
                for text in texts:
                    for t in (text if isinstance(text, list) else [text]):
                        for s in t.split("\n"):
                            if s.strip():
                                yield s


def train(args) -> str:
    import sentencepiece as spm

    for path in args.input:
        if not os.path.isfile(path):
            raise TrainTokenizerError(f"--input: {path} does not exist")
    out_dir = os.path.dirname(os.path.abspath(args.model_prefix))
    if not os.path.isdir(out_dir):
        raise TrainTokenizerError(f"--model-prefix: directory {out_dir} does not exist")
    counter = {"skipped": 0}
    error = []

    def sentences():  # keep our error (file:line) instead of sentencepiece's generic one
        try:
            yield from iter_sentences(args.input, args.json_keys, args.skip_malformed, counter)
        except TrainTokenizerError as exc:
            error.append(exc)

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_prefix=args.model_prefix,
            vocab_size=args.vocab_size, model_type=args.model_type,
            character_coverage=args.character_coverage,
            input_sentence_size=args.input_sentence_size, shuffle_input_sentence=True,
            max_sentence_length=args.max_sentence_length, byte_fallback=args.byte_fallback,
            normalization_rule_name=args.normalization_rule_name,
            unk_id=0, bos_id=1, eos_id=2, pad_id=3,
            hard_vocab_limit=False,  # a small corpus yields a smaller vocab instead of failing
            num_threads=args.num_threads, minloglevel=2)
    except RuntimeError as exc:
        if error:
            raise error[0] from None
        raise TrainTokenizerError(f"sentencepiece training failed: {exc}") from None
    if error:  # training ran on a prefix of the corpus: do not leave that model behind
        for ext in (".model", ".vocab"):
            if os.path.exists(args.model_prefix + ext):
                os.remove(args.model_prefix + ext)
        raise error[0]
    if counter["skipped"]:
        print(f"skipped {counter['skipped']} malformed lines", file=sys.stderr)
    return args.model_prefix + ".model"


def main(argv=None) -> str:
    args = get_args(argv)
    try:
        path = train(args)
    except TrainTokenizerError as exc:
        raise SystemExit(f"train_tokenizer.py: error: {exc}") from None
    print(path)
    return path


if __name__ == "__main__":
    main()
