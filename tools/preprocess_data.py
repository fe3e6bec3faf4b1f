#!/usr/bin/env python
"""Tokenize a JSONL corpus into Megatron's indexed dataset (.bin/.idx), Megatron-LM's flags.

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \
        --output-prefix my-corpus --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model tok.model --workers 8 --append-eod
    # -> my-corpus_text_document.bin/.idx   (--data-path my-corpus_text_document)

Each input line is one JSON object; each ``--json-keys`` key gives one output dataset
``{prefix}_{key}_{document|sentence}``. A key's value is a string, or a list of strings taken as
the document's sentences (Megatron's convention). Blank lines are skipped. Documents that
tokenize to nothing are skipped and counted.

* Streaming: lines are read lazily in batches of ``--chunksize`` and fed to ``--workers``
  processes (``Pool.imap``), at most 16 batches per worker in flight, so memory does not grow
  with the corpus.
  Results come back in input order, so the output does not depend on the number of workers.
* ``--split-sentences``: every sentence is one sequence and a document's sentences form one
  document (BERT's layout). nltk's punkt splitter is used when nltk and its punkt data are
  installed; otherwise a regex splitter: a sentence ends at ``.``, ``!`` or ``?`` (plus closing
  quotes/brackets) followed by whitespace and a character that is not lower case, or at a blank
  line. ``--keep-newlines`` keeps each sentence's trailing whitespace/newlines.
* ``--partitions`` is accepted for command-line compatibility; Megatron uses it to split a large
  input into files processed separately and merged. Streaming makes that unnecessary, so the
  output is always the single dataset above.
* Start-up: neither torch nor megatron-core is imported (seconds saved per run, and per worker
  under the spawn start method); the .bin/.idx are written by ``IndexedDatasetWriter`` below,
  byte for byte what megatron-core's ``IndexedDatasetBuilder`` writes (tests compare them).
  Each batch of lines is tokenized with one call into the tokenizer library
  (``tokenize_batch``).
* A malformed JSON line, a missing key or a non-string value fails with ``file:line``, unless
  ``--skip-malformed`` (skipped lines are counted and the first few reported). Output is written to
  temporary names and renamed at the end, so a failed run leaves no half-written .bin/.idx.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import multiprocessing
import os
import re
import struct
import sys
import threading
import time
from array import array

if __package__ in (None, ""):  # run as a script: make megatron_moe importable from the checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# light (no torch, no megatron-core): the tokenizer libraries are imported when one is built
from megatron_moe.data.tokenizers import (  # noqa: E402
    TokenizerError, add_tokenizer_args, build_tokenizer)


class PreprocessError(Exception):
    """Bad input or settings; the message names the file:line or the flag."""


# --------------------------------------------------------------------------- sentence splitting
_SENT_END = re.compile(
    r"""(?:[.!?]+["'”’)\]]*(?=\s+["'“‘(\[]*[^\s"'“‘(\[a-z])|\n[ \t]*\n)\s*""")


def regex_split_sentences(text: str, keep_newlines: bool = False):
    """The fallback splitter (see module doc). Returns the non-empty sentences, stripped unless
    keep_newlines (then the trailing whitespace stays with its sentence)."""
    out, start = [], 0
    for m in _SENT_END.finditer(text):
        out.append(text[start:m.end()])
        start = m.end()
    out.append(text[start:])
    if keep_newlines:
        return [s for s in out if s.strip()]
    return [s.strip() for s in out if s.strip()]


def _punkt_splitter(lang: str, keep_newlines: bool):
    """nltk's punkt sentence tokenizer, or None when nltk or its punkt data are missing."""
    try:
        import nltk
        from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer
    except ImportError:
        return None
    for resource in (f"tokenizers/punkt/{lang}.pickle", f"tokenizers/punkt_tab/{lang}/"):
        try:
            if resource.endswith(".pickle"):
                splitter = nltk.data.load(resource)
            else:
                splitter = nltk.tokenize.PunktTokenizer(lang)
            break
        except Exception:  # LookupError, missing PunktTokenizer in older nltk, ...
            continue
    else:
        return None
    if keep_newlines:  # Megatron's CustomLanguageVars: keep the newline at the sentence end
        class _Vars(PunktLanguageVars):
            _period_context_fmt = r"""
                \S*                          # some word material
                %(SentEndChars)s             # a potential sentence ending
                \s*                       #  <-- THIS is what I changed
                (?=(?P<after_tok>
                    %(NonWord)s              # either other punctuation
                    |
                    (?P<next_tok>\S+)     #  <-- Normally you would have \s+ here
                ))"""

        splitter = PunktSentenceTokenizer(splitter._params, lang_vars=_Vars())
    return splitter


# ------------------------------------------------------------------------------- .bin/.idx
_INDEX_HEADER = b"MMIDIDX\x00\x00"  # megatron-core's indexed dataset, version 1
_DTYPE_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6,
                "float32": 7, "uint16": 8}


def optimal_dtype(vocab_size):
    """megatron-core's ``DType.optimal_dtype``: uint16 below 65500 ids, else int32."""
    import numpy as np

    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


class IndexedDatasetWriter:
    """megatron-core's ``IndexedDatasetBuilder`` (.bin tokens, .idx header + int32 sequence
    lengths + int64 byte pointers + int64 document indices), written with numpy alone: that
    class's module imports torch, whose import is most of this tool's start-up. Lengths and
    document indices are kept in compact arrays (4 + 8 bytes per sequence/document, not Python
    lists). tests/test_preprocess.py checks the bytes against megatron-core's builder."""

    def __init__(self, bin_path: str, dtype):
        import numpy as np

        self.dtype = np.dtype(dtype)
        self.data_file = open(bin_path, "wb")
        self.sequence_lengths = array("i")  # C int: int32 on every platform numpy supports
        self.document_indices = array("q", [0])

    def add_document(self, tokens, lengths):
        """One document: its tokens (any int sequence) and its sequences' lengths."""
        import numpy as np

        self.data_file.write(np.asarray(tokens, dtype=self.dtype).tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def add_documents(self, blob: bytes, lengths, sequences_per_document):
        """Several consecutive documents at once: their tokens as raw bytes of ``dtype``."""
        self.data_file.write(blob)
        self.sequence_lengths.extend(lengths)
        end = len(self.sequence_lengths) - len(lengths)
        for n in sequences_per_document:
            end += n
            self.document_indices.append(end)

    def finalize(self, idx_path: str):
        import numpy as np

        self.data_file.close()
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int32) \
            if len(self.sequence_lengths) else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(idx_path, "wb") as f:
            f.write(_INDEX_HEADER)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", _DTYPE_CODES[self.dtype.name]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(self.document_indices)))
            f.write(lengths.astype("<i4").tobytes(order="C"))
            f.write(pointers.astype("<i8").tobytes(order="C"))
            f.write(np.frombuffer(self.document_indices, dtype=np.int64).astype("<i8").tobytes())


# ------------------------------------------------------------------------------------ workers
class Encoder:
    """Per-process state: the tokenizer and the sentence splitter (built once per worker).

    Also Megatron-LM's Python interface (tools/preprocess_data.py at core_v0.19.0), for code that
    imports this tool as a library: ``Encoder(args)``, ``initializer()`` (builds the tokenizer
    and splitter; like Megatron it also stores them on the class, so ``Encoder.tokenizer`` works
    after it), ``encode(json_line)`` -> ``(ids by key, sentence lengths by key, bytes read)`` and
    ``split(json_line)`` -> ``(JSON line of sentences by key, bytes read)``. As in Megatron,
    ``encode`` does not split sentences (``split`` does that; a list value is taken as the
    sentences). The tool's own pipeline batches lines (``encode_batch``) and writes the same ids.
    """

    tokenizer = None
    splitter = None

    def __init__(self, args):
        self.args = args

    def initialize(self):
        self.tokenizer = build_tokenizer(self.args)
        self.dtype = optimal_dtype(self.tokenizer.vocab_size)
        self.splitter = None
        if self.args.split_sentences:
            self.splitter = _punkt_splitter(self.args.lang, self.args.keep_newlines)

    def initializer(self):
        """Megatron-LM's name (a Pool initializer): build the tokenizer and the splitter."""
        self.initialize()
        Encoder.tokenizer, Encoder.splitter = self.tokenizer, self.splitter

    def split_text(self, text: str):
        if not self.args.split_sentences:
            return [text]
        if self.splitter is not None:
            return self.splitter.tokenize(text)
        return regex_split_sentences(text, self.args.keep_newlines)

    def _json_values(self, json_line):
        data = json.loads(json_line)
        for key in self.args.json_keys:
            if key not in data:
                raise PreprocessError(f"missing key {key!r} (--json-keys)")
        return data

    def split(self, json_line):
        """Megatron-LM's ``split``: the sentences of each key, as one JSON line, and its length."""
        if self.tokenizer is None:
            self.initializer()
        data = self._json_values(json_line)
        out = {k: (data[k] if isinstance(data[k], list) else self.split_text(data[k]))
               for k in self.args.json_keys}
        return json.dumps(out), len(json_line)

    def encode(self, json_line):
        """Megatron-LM's ``encode``: ``({key: token ids}, {key: sentence lengths}, len(json_line))``
        for one JSON line. A string value is one sentence, a list value its sentences; empty
        sentences are dropped; --append-eod adds the eod to a non-empty document."""
        if self.tokenizer is None:
            self.initializer()
        data = self._json_values(json_line)
        ids, lens = {}, {}
        for key in self.args.json_keys:
            text = data[key]
            sentences = text if isinstance(text, list) else [text]
            doc, lengths = [], []
            for sentence_ids in self.tokenizer.tokenize_batch(sentences):
                if len(sentence_ids) > 0:
                    doc.extend(sentence_ids)
                    lengths.append(len(sentence_ids))
            if doc and self.args.append_eod:
                doc.append(self.tokenizer.eod)
                lengths[-1] += 1
            ids[key], lens[key] = doc, lengths
        return ids, lens, len(json_line)

    def parse(self, lineno, raw):
        """(lineno, raw line bytes) -> ({key: [sentence, ...]} | None for a blank line, error)."""
        try:  # decoded here, per line, so a bad byte is reported with its line
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return None, f"not valid UTF-8 ({exc.reason} at byte {exc.start})"
        if not line.strip():
            return None, None
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            return None, f"malformed JSON ({exc.msg} at column {exc.colno})"
        if not isinstance(data, dict):
            return None, f"expected a JSON object, got {type(data).__name__}"
        out = {}
        for key in self.args.json_keys:
            if key not in data:
                return None, f"missing key {key!r} (--json-keys)"
            text = data[key]
            if isinstance(text, str):
                out[key] = self.split_text(text)
            elif isinstance(text, list) and all(isinstance(t, str) for t in text):
                out[key] = text
            else:
                return None, (f"key {key!r} must be a string or a list of strings, got "
                              f"{type(text).__name__}")
        return out, None

    def _tokenize_docs(self, docs):
        """[(lineno, {key: sentences})] -> ([{key: [ids per sentence]}], first failure
        (lineno, error) | None). One library call for all sentences; when it fails, sentence
        by sentence to find the line (results before it are kept)."""
        name = type(self.tokenizer).__name__
        flat = [s for _, doc in docs for k in self.args.json_keys for s in doc[k]]
        try:
            ids = self.tokenizer.tokenize_batch(flat)
        except Exception:
            ids = None
        out, pos = [], 0
        for lineno, doc in docs:
            tokens = {}
            for key in self.args.json_keys:
                n = len(doc[key])
                if ids is not None:
                    tokens[key] = ids[pos:pos + n]
                else:
                    try:
                        tokens[key] = [self.tokenizer.tokenize(s) for s in doc[key]]
                    except Exception as exc:  # file:line instead of a worker traceback
                        return out, (lineno, f"key {key!r}: {name} failed: {exc}")
                pos += n
            out.append(tokens)
        return out, None

    def encode_batch(self, batch):
        """(first_lineno, lines) -> one result for the batch, so the main process receives one
        message per batch instead of per line:
        (last_lineno, nbytes, {key: (token_bytes, seq_lengths, seqs_per_doc)}, docs, empty,
         skipped [(lineno, error)], fatal (lineno, error) | None). A fatal error ends the batch."""
        import numpy as np

        first, lines = batch
        nbytes = 0
        skipped, fatal, lineno = [], None, first - 1
        parsed = []
        for lineno, line in enumerate(lines, first):
            nbytes += len(line)
            doc, error = self.parse(lineno, line)
            if error is not None:
                if not self.args.skip_malformed:
                    fatal = (lineno, error)
                    break
                skipped.append((lineno, error))
            elif doc is not None:
                parsed.append((lineno, doc))
        while True:  # under --skip-malformed a failing line is skipped and the rest retried
            tokenized, failure = self._tokenize_docs(parsed)
            if failure is None:
                break
            if not self.args.skip_malformed:
                fatal = failure
                break
            skipped.append(failure)
            parsed = [d for d in parsed if d[0] != failure[0]]
        skipped.sort()
        ids = {k: [] for k in self.args.json_keys}
        lens = {k: [] for k in self.args.json_keys}
        per_doc = {k: [] for k in self.args.json_keys}
        docs = empty = 0
        eod = self.tokenizer.eod if self.args.append_eod else None
        for tokens in tokenized:
            any_tokens = False
            for k, sentences in tokens.items():
                lengths = [len(s) for s in sentences if len(s) > 0]
                if not lengths:  # Megatron would add a zero-sequence document; skip it
                    empty += 1
                    continue
                for s in sentences:
                    ids[k].extend(s)
                if eod is not None:
                    ids[k].append(eod)
                    lengths[-1] += 1
                lens[k].extend(lengths)
                per_doc[k].append(len(lengths))
                any_tokens = True
            docs += any_tokens
        # raw bytes of the token dtype: the smallest and fastest thing to send back
        result = {k: (np.asarray(ids[k], dtype=self.dtype).tobytes(), lens[k], per_doc[k])
                  for k in self.args.json_keys}
        return lineno, nbytes, result, docs, empty, skipped, fatal


_ENCODER: Encoder | None = None


def _worker_init(args):
    global _ENCODER
    _ENCODER = Encoder(args)
    _ENCODER.initialize()


def _worker_encode(batch):
    return _ENCODER.encode_batch(batch)


# ------------------------------------------------------------------------------------- driver
def get_args(argv=None):
    p = argparse.ArgumentParser(
        prog="preprocess_data.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract from each JSON object (default: text)")
    g.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence (sentence-level dataset, for BERT)")
    g.add_argument("--keep-newlines", action="store_true",
                   help="keep newlines between sentences when splitting")
    g.add_argument("--skip-malformed", action="store_true",
                   help="skip and count malformed lines instead of failing")
    add_tokenizer_args(p)
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes {prefix}_{key}_{document|sentence}.bin/.idx")
    g.add_argument("--append-eod", action="store_true",
                   help="append the tokenizer's end-of-document token to each document")
    g.add_argument("--lang", default="english", help="language for nltk's punkt splitter")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--partitions", type=int, default=1,
                   help="accepted for Megatron compatibility; input is streamed, so this does "
                        "not change the output (always one dataset per key)")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="accepted for Megatron compatibility; documents are always written in "
                        "input order")
    g.add_argument("--dataset-impl", choices=("mmap",), default="mmap",
                   help="accepted for older Megatron scripts; the format is always mmap")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="print progress every N documents (0: only the tqdm bar)")
    g.add_argument("--chunksize", type=int, default=64,
                   help="lines per worker task (at most 16 tasks per worker are in flight)")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    g.add_argument("--find-optimal-num-workers", action="store_true",
                   help="Megatron-LM's worker search: preprocess the first --max-documents "
                        "lines with each of --workers-to-check workers, print the docs/s of "
                        "each and the fastest (the output holds those documents)")
    g.add_argument("--workers-to-check", nargs="+", type=int, default=None,
                   help="worker counts to try with --find-optimal-num-workers (default: 16 32 64)")
    g.add_argument("--max-documents", type=int, default=None,
                   help="documents (input lines) per try of --find-optimal-num-workers "
                        "(default: 100000)")
    args = p.parse_args(argv)  # argv None: sys.argv, as Megatron-LM's get_args()
    if args.workers < 1:
        p.error(f"--workers must be >= 1 (got {args.workers})")
    if args.partitions < 1:
        p.error(f"--partitions must be >= 1 (got {args.partitions})")
    if args.chunksize < 1:
        p.error(f"--chunksize must be >= 1 (got {args.chunksize})")
    if not args.find_optimal_num_workers:
        for flag in ("workers_to_check", "max_documents"):
            if getattr(args, flag) is not None:
                p.error(f"--{flag.replace('_', '-')} applies only with --find-optimal-num-workers")
    if args.workers_to_check is None:
        args.workers_to_check = [16, 32, 64]  # Megatron-LM's defaults
    if args.max_documents is None:
        args.max_documents = 100_000
    if min(args.workers_to_check) < 1:
        p.error(f"--workers-to-check: every count must be >= 1 (got {args.workers_to_check})")
    if args.max_documents < 1:
        p.error(f"--max-documents must be >= 1 (got {args.max_documents})")
    # the attributes Megatron-LM's get_args() adds, for code that passes these args on
    for name, value in (("keep_empty", False), ("rank", 1), ("make_vocab_size_divisible_by", 128),
                        ("tensor_model_parallel_size", 1), ("vocab_extra_ids", 0)):
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


class _InFlight:
    """Bounds the batches of lines in flight. Pool.imap's feeder thread would otherwise read the
    whole file ahead of the workers; `stop()` unblocks it so Pool.terminate() (which joins it)
    cannot hang."""

    def __init__(self, limit: int):
        self._sem = threading.Semaphore(limit)
        self._stopped = False

    def lines(self, f, batch_lines: int = 1, max_lines: int | None = None):
        """(first_lineno, [lines]) batches of f (its first max_lines lines); one unit of the
        limit per batch."""
        lineno = 1
        while True:
            if max_lines is not None:
                batch_lines = min(batch_lines, max_lines - lineno + 1)
            batch = list(itertools.islice(f, batch_lines)) if batch_lines > 0 else []
            if not batch:
                return
            while not self._sem.acquire(timeout=0.2):
                if self._stopped:
                    return
            if self._stopped:
                return
            yield lineno, batch
            lineno += len(batch)

    def release(self):
        self._sem.release()

    def stop(self):
        self._stopped = True


def preprocess(args, max_lines: int | None = None) -> dict:
    """Run preprocessing for parsed ``args`` (the first ``max_lines`` lines of the input, or all);
    returns stats. Raises PreprocessError."""
    if not os.path.isfile(args.input):
        raise PreprocessError(f"--input: {args.input} does not exist")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise PreprocessError(f"--output-prefix: directory {out_dir} does not exist")
    try:
        tokenizer = build_tokenizer(args)
    except TokenizerError as exc:
        raise PreprocessError(str(exc)) from None
    if args.split_sentences and _punkt_splitter(args.lang, args.keep_newlines) is None:
        print("preprocess_data: nltk punkt not available; using the regex sentence splitter",
              file=sys.stderr)
    if args.partitions > 1:
        print(f"preprocess_data: --partitions {args.partitions}: input is streamed, writing one "
              f"dataset per key", file=sys.stderr)
    dtype = optimal_dtype(tokenizer.vocab_size)
    itemsize = dtype(0).itemsize
    level = "sentence" if args.split_sentences else "document"
    prefixes = {k: f"{args.output_prefix}_{k}_{level}" for k in args.json_keys}
    pid = os.getpid()
    tmp = {k: (f"{p}.bin.tmp{pid}", f"{p}.idx.tmp{pid}") for k, p in prefixes.items()}
    stats = dict(documents=0, tokens=0, sequences=0, empty=0, skipped=0, bytes=0, lines=0)
    skipped_examples = []
    builders = {}
    pool = in_flight = None
    start = time.time()
    try:
        for k in args.json_keys:
            builders[k] = IndexedDatasetWriter(tmp[k][0], dtype=dtype)
        total_bytes = os.path.getsize(args.input)
        try:
            from tqdm import tqdm
            bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess",
                       disable=args.no_progress, mininterval=0.5, file=sys.stderr)
        except ImportError:  # pragma: no cover
            bar = None
        with open(args.input, "rb") as f:
            if args.workers == 1:
                encoder = Encoder(args)
                encoder.initialize()
                in_flight = _InFlight(1)
                results = map(encoder.encode_batch, in_flight.lines(f, args.chunksize, max_lines))
            else:
                # deep enough that the workers keep busy while this process waits for a CPU
                # (shared machines), small enough to bound memory (~16 x chunksize lines each)
                in_flight = _InFlight(16 * args.workers)
                # objects the parent already has move to the permanent GC generation, so the
                # workers' collections do not write to (and copy) their pages
                gc.freeze()
                # one core per worker: no extra Rust threads inside `tokenizers`' batch calls
                os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
                # fork (where there is one): workers start with this process's modules
                methods = multiprocessing.get_all_start_methods()
                ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
                pool = ctx.Pool(args.workers, initializer=_worker_init, initargs=(args,))
                gc.unfreeze()
                results = pool.imap(_worker_encode, in_flight.lines(f, args.chunksize, max_lines))
            for lineno, nbytes, out, docs, empty, skipped, fatal in results:
                in_flight.release()
                stats["lines"] = lineno
                stats["bytes"] += nbytes
                if bar is not None:
                    bar.update(nbytes)
                if fatal is not None:
                    raise PreprocessError(f"{args.input}:{fatal[0]}: {fatal[1]} (use "
                                          f"--skip-malformed to skip such lines)")
                stats["skipped"] += len(skipped)
                for bad_line, error in skipped[:max(0, 5 - len(skipped_examples))]:
                    skipped_examples.append(f"{args.input}:{bad_line}: {error}")
                for k, (blob, lengths, per_doc) in out.items():
                    builders[k].add_documents(blob, lengths, per_doc)
                    stats["tokens"] += len(blob) // itemsize
                    stats["sequences"] += len(lengths)
                stats["empty"] += empty
                before = stats["documents"]
                stats["documents"] += docs
                if args.log_interval and before // args.log_interval != \
                        stats["documents"] // args.log_interval:
                    el = time.time() - start
                    n = stats["documents"]
                    msg = (f"Processed {n} documents ({n / el:.1f} docs/s, "
                           f"{stats['bytes'] / el / 1024 ** 2:.2f} MB/s).")
                    (bar.write(msg, file=sys.stderr) if bar is not None
                     else print(msg, file=sys.stderr))
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
        for k, b in builders.items():
            b.finalize(tmp[k][1])
        for k, p in prefixes.items():  # publish: .bin first, the .idx (what readers open) last
            os.replace(tmp[k][0], p + ".bin")
            os.replace(tmp[k][1], p + ".idx")
    finally:
        if in_flight is not None:
            in_flight.stop()
        if pool is not None:
            pool.terminate()
            pool.join()
        for k, b in builders.items():
            if not b.data_file.closed:
                b.data_file.close()
        for paths in tmp.values():
            for path in paths:
                if os.path.exists(path):
                    os.remove(path)
    stats["seconds"] = time.time() - start
    stats["outputs"] = list(prefixes.values())
    stats["skipped_examples"] = skipped_examples
    return stats


def find_optimal_num_workers(args) -> dict:
    """Megatron-LM's --find-optimal-num-workers: the first --max-documents lines preprocessed
    once per --workers-to-check count (each run writes the output anew); prints the docs/s of
    each, fastest first, and the best count. Returns {workers: docs/s}."""
    import copy

    performance = {}
    for workers in dict.fromkeys(args.workers_to_check):
        print(f"Processing data with {workers} workers.")
        run = copy.copy(args)
        run.workers = workers
        stats = preprocess(run, max_lines=args.max_documents)
        performance[workers] = stats["documents"] / max(stats["seconds"], 1e-9)
    ranked = sorted(performance.items(), key=lambda kv: kv[1], reverse=True)
    print("\n-----------------------------------")
    print("Performance results (fastest → slowest):")
    for i, (workers, rate) in enumerate(ranked, 1):
        print(f"{i}. {workers} workers → avg. docs/s: {rate:.4f}")
    print("\n-----------------------------------")
    print(f"The most optimal num of workers is {ranked[0][0]} with avg. preprocessed docs/s: "
          f"{ranked[0][1]:.4f}.")
    print("-----------------------------------")
    return performance


def main(argv=None) -> dict:
    """Command-line entry (``argv`` None: ``sys.argv``, as Megatron-LM's ``main()``); errors exit
    with a one-line message (no traceback)."""
    args = get_args(argv)
    try:
        if args.find_optimal_num_workers:
            return {"performance": find_optimal_num_workers(args)}
        stats = preprocess(args)
    except PreprocessError as exc:
        raise SystemExit(f"preprocess_data.py: error: {exc}") from None
    except KeyboardInterrupt:
        raise SystemExit("preprocess_data.py: interrupted; no output written") from None
    for example in stats["skipped_examples"]:
        print(f"skipped {example}", file=sys.stderr)
    rate = stats["tokens"] / max(stats["seconds"], 1e-9)
    print(f"Done: {stats['documents']} documents, {stats['sequences']} sequences, "
          f"{stats['tokens']} tokens in {stats['seconds']:.2f}s ({rate:.0f} tokens/s); "
          f"skipped {stats['skipped']} malformed lines, {stats['empty']} empty documents. "
          f"Wrote {', '.join(p + '.bin/.idx' for p in stats['outputs'])}")
    return stats


if __name__ == "__main__":
    main()
