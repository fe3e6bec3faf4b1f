"""tools/preprocess_data.py and tools/merge_datasets.py driven as a library, the way Megatron-LM's
own test drives its tools (tests/unit_tests/data/test_preprocess_data.py at core_v0.19.0): set
``sys.argv``, call ``main()`` per raw JSONL file, ``merge_datasets.main()`` over the outputs, then
``Encoder(get_args())`` + ``initializer()`` + ``encode(json_line)`` per raw line, and check that
each file's dataset and the merged dataset hold exactly those tokens, document by document, and
detokenize to the same text. For GPT-2 BPE, SentencePiece, a HF tokenizer.json directory and BERT
(--split-sentences)."""

import json
import os
import sys

import pytest

from tests import _data_helpers as H
from tools import merge_datasets, preprocess_data

HERE = os.path.abspath(__file__)


def _raw_files(directory):
    """Megatron's three dummy files (numbers, ascending numbers, the lines of this test file)
    plus a few prose documents (several sentences, unicode, a pre-split list)."""
    files = {
        "numbers": [{"text": str(i + 1)} for i in range(60)],
        "numbers_ascending": [{"text": " ".join(str(j + 1) for j in range(i + 1))}
                              for i in range(40)],
        "test": [{"text": line} for line in open(HERE, encoding="utf-8")][:80],
        "prose": [d for d in H.EXTRA_DOCS if d["text"]] * 3,
    }
    for name, docs in files.items():
        with open(os.path.join(directory, name + ".jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
    return sorted(files)


def _tokenizer_flags(kind, tmp_path):
    if kind == "GPT2BPETokenizer":
        vocab, merges = H.write_gpt2_files(str(tmp_path))
        return ["--tokenizer-type", kind, "--vocab-file", vocab, "--merge-file", merges,
                "--append-eod"]
    if kind == "SentencePieceTokenizer":
        corpus = str(tmp_path / "sp_corpus.jsonl")
        H.write_corpus(corpus, max_docs=80)
        return ["--tokenizer-type", kind, "--tokenizer-model",
                H.train_sp(corpus, str(tmp_path / "sp"), vocab_size=400), "--append-eod"]
    if kind == "HuggingFaceTokenizer":
        docs = H.write_corpus(str(tmp_path / "hf_corpus.jsonl"), max_docs=80)
        texts = [t for d in docs for t in (d["text"] if isinstance(d["text"], list)
                                           else [d["text"]])]
        d = H.train_hf_bytelevel(texts, str(tmp_path / "hf"), 500, "</s>")
        return ["--tokenizer-type", kind, "--tokenizer-model", d, "--append-eod"]
    docs = [json.loads(line) for name in ("numbers", "numbers_ascending", "test", "prose")
            for line in open(tmp_path / "raws" / f"{name}.jsonl", encoding="utf-8")]
    vocab = H.write_bert_vocab_for(docs, str(tmp_path), words=300)
    return ["--tokenizer-type", kind, "--vocab-file", vocab, "--split-sentences"]


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "SentencePieceTokenizer",
                                  "HuggingFaceTokenizer", "BertWordPieceLowerCase"])
def test_megatron_library_interface_raw_to_merged(tmp_path, monkeypatch, kind):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    raws, data = tmp_path / "raws", tmp_path / "data"
    raws.mkdir()
    data.mkdir()
    names = _raw_files(str(raws))
    flags = _tokenizer_flags(kind, tmp_path) + ["--workers", "2", "--log-interval", "0",
                                                "--no-progress"]
    for name in names:  # build one dataset per raw file: sys.argv + main(), as Megatron's test
        monkeypatch.setattr(sys, "argv", ["preprocess_data.py", "--input",
                                          str(raws / f"{name}.jsonl"), "--output-prefix",
                                          str(data / name)] + flags)
        preprocess_data.main()
    monkeypatch.setattr(sys, "argv", ["merge_datasets.py", "--input", str(data),
                                      "--output-prefix", str(data / "merge")])
    merge_datasets.main()

    # Megatron's test builds its encoder from placeholder --input/--output-prefix values
    monkeypatch.setattr(sys, "argv", ["x", "--input", None, "--output-prefix", None] + flags)
    encoder = preprocess_data.Encoder(preprocess_data.get_args())
    encoder.initializer()
    tokenizer = preprocess_data.Encoder.tokenizer  # Megatron keeps it on the class
    assert tokenizer is encoder.tokenizer and type(tokenizer).__name__ == \
        {"BertWordPieceLowerCase": "BertWordPieceTokenizer"}.get(kind, kind)

    level = "sentence" if "--split-sentences" in flags else "document"
    names.sort(key=lambda n: f"{n}_text_{level}")  # the merge's order: sorted prefixes
    merged = IndexedDataset(str(data / "merge"))
    merged_doc = 0
    documents = sentences_seen = 0
    for name in names:
        part = IndexedDataset(str(data / f"{name}_text_{level}"))
        n_docs = len(part.document_indices) - 1
        for doc in range(n_docs):  # the merged dataset holds the part's documents in order
            a = part.document_indices[doc:doc + 2]
            b = merged.document_indices[merged_doc + doc:merged_doc + doc + 2]
            assert [len(part[i]) for i in range(*a)] == [len(merged[i]) for i in range(*b)]
        doc = 0
        with open(raws / f"{name}.jsonl", encoding="utf-8") as reader:
            for json_line in reader:
                ids, lens, nbytes = encoder.encode(json_line)
                assert nbytes == len(json_line) and sum(lens["text"]) == len(ids["text"])
                if not ids["text"]:
                    continue  # empty documents are not written (docs/data.md)
                whole = tokenizer.detokenize(ids["text"])
                if level == "sentence":  # Megatron's split(): the sentences, then encode
                    split_line, nbytes = encoder.split(json_line)
                    assert nbytes == len(json_line)
                    ids, lens, _ = encoder.encode(split_line)
                    sentences_seen += len(lens["text"])
                lo, hi = part.document_indices[doc:doc + 2]
                tokens = [int(t) for i in range(lo, hi) for t in part[i]]
                mlo, mhi = merged.document_indices[merged_doc + doc:merged_doc + doc + 2]
                merged_tokens = [int(t) for i in range(mlo, mhi) for t in merged[i]]
                assert tokens == ids["text"] == merged_tokens, (name, doc)
                assert [len(part[i]) for i in range(lo, hi)] == lens["text"]
                text = tokenizer.detokenize(ids["text"])
                assert tokenizer.detokenize(tokens) == text == tokenizer.detokenize(merged_tokens) \
                    == whole
                if kind == "GPT2BPETokenizer":  # byte-level, no special tokens parsed: lossless
                    eod = tokenizer.detokenize([tokenizer.eod])
                    raw = json.loads(json_line)["text"]
                    assert text == "".join(raw if isinstance(raw, list) else [raw]) + eod
                doc += 1
        assert doc == n_docs  # every document of the part was checked
        documents += n_docs
        merged_doc += n_docs
    assert documents == len(merged.document_indices) - 1 > 150
    if level == "sentence":  # the prose documents really were split into several sentences
        assert sentences_seen > documents


def test_megatron_flags_find_optimal_num_workers(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(str(j) for j in range(i % 9 + 1))})
                              + "\n" for i in range(50)))
    out = str(tmp_path / "o")
    base = ["--input", str(corpus), "--output-prefix", out, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100", "--log-interval", "0", "--no-progress", "--workers", "2"]
    result = preprocess_data.main(base + ["--find-optimal-num-workers", "--workers-to-check",
                                          "1", "2", "--max-documents", "20"])
    assert sorted(result["performance"]) == [1, 2]
    assert all(rate > 0 for rate in result["performance"].values())
    printed = capsys.readouterr().out
    assert "Processing data with 1 workers." in printed and "Processing data with 2 workers." in \
        printed and "The most optimal num of workers is " in printed
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    assert len(IndexedDataset(out + "_text_document").document_indices) - 1 == 20  # first 20
    for flag, value in (("--workers-to-check", "4"), ("--max-documents", "5")):
        with pytest.raises(SystemExit):
            preprocess_data.main(base + [flag, value])
        assert f"{flag} applies only with --find-optimal-num-workers" in capsys.readouterr().err
