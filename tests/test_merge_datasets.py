"""tools/merge_datasets.py (Megatron-LM's tool): merging the preprocessed parts of a corpus equals
preprocessing the whole corpus; bad inputs fail naming the flag/file and leave nothing."""

import os

import numpy as np
import pytest

from tools import merge_datasets, preprocess_data


def _preprocess(corpus, prefix, *extra):
    preprocess_data.main(["--input", corpus, "--output-prefix", prefix, "--tokenizer-type",
                          "NullTokenizer", "--vocab-size", "70000", "--append-eod",
                          "--no-progress", "--log-interval", "0", "--workers", "1", *extra])


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def test_merge_of_two_parts_equals_preprocessing_the_whole_corpus(tmp_path):
    import json

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = [" ".join(str((7 * i + j) % 69000) for j in range(1 + i % 13)) for i in range(120)]
    docs[5] = ["1 2 3", "4 5"]  # a two-sequence document
    lines = [json.dumps({"text": d}) + "\n" for d in docs]
    (tmp_path / "parts").mkdir()
    for name, part in (("a", lines[:70]), ("b", lines[70:]), ("all", lines)):
        (tmp_path / f"{name}.jsonl").write_text("".join(part))
    _preprocess(str(tmp_path / "a.jsonl"), str(tmp_path / "parts" / "p0"))
    _preprocess(str(tmp_path / "b.jsonl"), str(tmp_path / "parts" / "p1"))
    _preprocess(str(tmp_path / "all.jsonl"), str(tmp_path / "whole"))
    stats = merge_datasets.main(["--input", str(tmp_path / "parts"), "--output-prefix",
                                 str(tmp_path / "merged")])
    assert stats["inputs"] == ["p0_text_document", "p1_text_document"]
    assert stats["documents"] == 120 and stats["sequences"] == 121
    whole, merged = str(tmp_path / "whole_text_document"), str(tmp_path / "merged")
    assert _read(merged + ".bin") == _read(whole + ".bin")
    a, b = IndexedDataset(merged), IndexedDataset(whole)
    assert a.index.dtype == b.index.dtype == np.int32  # NullTokenizer 70000 -> int32
    assert np.array_equal(a.sequence_lengths, b.sequence_lengths)
    assert np.array_equal(a.document_indices, b.document_indices)
    assert np.array_equal(a.index.sequence_pointers, b.index.sequence_pointers)
    assert _read(merged + ".idx") == _read(whole + ".idx")  # equal down to the bytes
    assert a[5].tolist() == [1, 2, 3] and a[6].tolist() == [4, 5, 70000]
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


def test_bad_inputs_fail_naming_the_flag_and_leave_nothing(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "1 2 3"}\n')
    d = tmp_path / "in"
    d.mkdir()
    out = str(tmp_path / "out")
    with pytest.raises(SystemExit, match="--input: .* no .bin/.idx pairs"):
        merge_datasets.main(["--input", str(d), "--output-prefix", out])
    _preprocess(str(tmp_path / "c.jsonl"), str(d / "x"))
    (d / "README").write_text("not a dataset")
    with pytest.raises(SystemExit, match="--input: .*README has no .idx file"):
        merge_datasets.main(["--input", str(d), "--output-prefix", out])
    (d / "README").unlink()
    # a uint16 dataset next to the int32 one
    preprocess_data.main(["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(d / "y"),
                          "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                          "--no-progress"])
    with pytest.raises(SystemExit, match="different token dtypes .*uint16"):
        merge_datasets.main(["--input", str(d), "--output-prefix", out])
    with pytest.raises(SystemExit, match="--input: .* is not a directory"):
        merge_datasets.main(["--input", str(tmp_path / "nope"), "--output-prefix", out])
    with pytest.raises(SystemExit, match="--output-prefix: directory"):
        merge_datasets.main(["--input", str(d), "--output-prefix", str(tmp_path / "no" / "o")])
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]
