#!/usr/bin/env python
"""Merge the indexed datasets (.bin/.idx pairs) in a directory into one, Megatron-LM's flags.

    python tools/merge_datasets.py --input DIR --output-prefix merged
    # -> merged.bin / merged.idx  (--data-path merged)

As Megatron-LM's tools/merge_datasets.py: every file in --input (not recursive) must belong to a
.bin/.idx pair; the prefixes are merged in sorted order with megatron-core's
``IndexedDatasetBuilder.add_index`` (sequence lengths and document boundaries appended, .bin
bytes copied), so merging the outputs of preprocessing parts of a corpus gives the .bin of
preprocessing the whole corpus, and an .idx with the same sequences and documents. All inputs
must have the same token dtype. ``--multimodal`` keeps the per-sequence modes. Output is written
to temporary names and renamed at the end: a failed merge leaves nothing behind.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make megatron_moe importable from the checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class MergeError(Exception):
    """Bad input; the message names the flag or file."""


def get_args(argv=None):
    p = argparse.ArgumentParser(prog="merge_datasets.py", description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True,
                   help="directory holding the .bin/.idx pairs to merge (all of its files)")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    g = p.add_argument_group("miscellaneous")
    g.add_argument("--multimodal", action="store_true",
                   help="the datasets are multimodal (their .idx carries sequence modes)")
    return p.parse_args(argv)


def find_prefixes(directory: str):
    """The sorted dataset prefixes in ``directory``; every file must have its .bin/.idx mate."""
    if not os.path.isdir(directory):
        raise MergeError(f"--input: {directory} is not a directory or does not exist")
    prefixes = set()
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        prefix, ext = os.path.splitext(name)
        mate = ".bin" if ext == ".idx" else ".idx"
        if ext not in (".bin", ".idx") or not os.path.isfile(os.path.join(directory,
                                                                          prefix + mate)):
            raise MergeError(f"--input: {path} has no {mate} file (every file in --input must "
                             f"belong to a .bin/.idx pair)")
        prefixes.add(prefix)
    if not prefixes:
        raise MergeError(f"--input: {directory} holds no .bin/.idx pairs")
    return sorted(prefixes)


def merge(args) -> dict:
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise MergeError(f"--output-prefix: directory {out_dir} does not exist")
    prefixes = find_prefixes(args.input)
    # megatron-core (and torch) only now, after the arguments are checked
    import megatron_moe  # noqa: F401  (first: quiets megatron-core's import-time notices)
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    paths = [os.path.join(args.input, p) for p in prefixes]
    dtypes = {}
    for path in paths:
        try:
            dtypes[path] = IndexedDataset(path, multimodal=args.multimodal).index.dtype
        except Exception as exc:  # a truncated or foreign .idx: name the file
            raise MergeError(f"--input: {path}.idx is not a readable indexed dataset index "
                             f"({type(exc).__name__}: {exc})") from None
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{os.path.basename(p)}: {d.__name__}" for p, d in dtypes.items())
        raise MergeError(f"--input: the datasets have different token dtypes ({listing}); "
                         f"preprocess them with the same tokenizer")
    tmp_bin = f"{args.output_prefix}.bin.tmp{os.getpid()}"
    tmp_idx = f"{args.output_prefix}.idx.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp_bin, dtype=dtypes[paths[0]], multimodal=args.multimodal)
    try:
        for path in paths:
            builder.add_index(path)
        documents = len(builder.document_indices) - 1
        sequences = len(builder.sequence_lengths)
        builder.finalize(tmp_idx)
        os.replace(tmp_bin, args.output_prefix + ".bin")  # .idx (what readers open) last
        os.replace(tmp_idx, args.output_prefix + ".idx")
    finally:
        if not builder.data_file.closed:
            builder.data_file.close()
        for path in (tmp_bin, tmp_idx):
            if os.path.exists(path):
                os.remove(path)
    return dict(inputs=prefixes, documents=documents, sequences=sequences,
                bytes=os.path.getsize(args.output_prefix + ".bin"))


def main(argv=None) -> dict:
    args = get_args(argv)
    try:
        stats = merge(args)
    except MergeError as exc:
        raise SystemExit(f"merge_datasets.py: error: {exc}") from None
    print(f"Merged {len(stats['inputs'])} datasets ({', '.join(stats['inputs'])}): "
          f"{stats['documents']} documents, {stats['sequences']} sequences, {stats['bytes']} "
          f"bytes -> {args.output_prefix}.bin/.idx")
    return stats


if __name__ == "__main__":
    main()
