"""tools/preprocess_data.py, train_tokenizer.py and make_corpus.py: round trips against the
tokenizer, megatron-core reading the output (IndexedDataset, GPTDataset), bad lines, cleanup."""

import json
import os
import types

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_moe.data.tokenizers import build_tokenizer
from tests import _data_helpers as H
from tools import make_corpus, preprocess_data, train_tokenizer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("pre")
    corpus = str(d / "corpus.jsonl")
    docs = H.write_corpus(corpus, max_docs=150)
    model = H.train_sp(corpus, str(d / "sp"), vocab_size=500)
    return types.SimpleNamespace(dir=d, corpus=corpus, docs=docs, model=model,
                                 tok=build_tokenizer(tokenizer_model=model))


def run(data, prefix, *extra, corpus=None):
    return preprocess_data.main(["--input", corpus or data.corpus, "--output-prefix", prefix,
                                 "--tokenizer-model", data.model, "--no-progress",
                                 "--log-interval", "0", *extra])


def _texts(doc):
    t = doc["text"]
    return t if isinstance(t, list) else [t]


def test_document_round_trip_equals_direct_tokenization(data, tmp_path):
    prefix = str(tmp_path / "c")
    stats = run(data, prefix, "--workers", "2", "--append-eod", "--chunksize", "4")
    ds = IndexedDataset(prefix + "_text_document")
    expected = []
    for doc in data.docs:
        ids = [i for s in _texts(doc) for i in data.tok.tokenize(s)]
        if ids:
            expected.append(ids + [data.tok.eod])
    assert stats["empty"] == 1 and stats["documents"] == len(expected)
    assert ds.index.dtype == np.uint16  # DType.optimal_dtype(500)
    di = ds.document_indices
    assert len(di) == len(expected) + 1 and di[-1] == len(ds)
    for i, ids in enumerate(expected):
        got = [t for seq in range(di[i], di[i + 1]) for t in ds[int(seq)].tolist()]
        assert got == ids
    # one sequence per document, except the list-valued one (its items stay sequences)
    assert len(ds) == len(expected) + 1
    assert stats["tokens"] == sum(map(len, expected))
    # the number of workers does not change a byte of the output
    run(data, str(tmp_path / "one"), "--workers", "1", "--append-eod")
    for ext in (".bin", ".idx"):
        with open(prefix + "_text_document" + ext, "rb") as a, \
                open(str(tmp_path / "one") + "_text_document" + ext, "rb") as b:
            assert a.read() == b.read()


def test_gpt_dataset_builds_on_the_output(data, tmp_path):
    """megatron-core's GPTDataset through BlendedMegatronDatasetBuilder (our data/gpt.py)."""
    from megatron_moe.data.gpt import build_gpt_datasets

    prefix = str(tmp_path / "g")
    run(data, prefix, "--workers", "2", "--append-eod")
    args = types.SimpleNamespace(
        seed=1234, seq_length=32, data_path=[prefix + "_text_document"], train_data_path=None,
        valid_data_path=None, test_data_path=None, split="90,10,0",
        data_cache_path=str(tmp_path / "cache"), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask_in_dataloader=True, mock_data=False)
    train, valid, test = build_gpt_datasets(args, data.tok, num_samples=[64, 8, 0])
    assert len(train) >= 64 and valid is not None
    all_tokens = np.fromfile(prefix + "_text_document.bin", dtype=np.uint16)
    text = " ".join(map(str, all_tokens.tolist()))
    for i in (0, 5, 63):
        sample = train[i]
        assert sample["tokens"].shape == (32,) and sample["labels"].shape == (32,)
        assert sample["tokens"][1:].tolist() == sample["labels"][:-1].tolist()
        assert int(sample["tokens"].max()) < data.tok.vocab_size
        # samples are windows of the corpus, possibly across document boundaries
        assert " ".join(map(str, sample["tokens"][:4].tolist())) in text


def test_sentence_level_output(data, tmp_path):
    prefix = str(tmp_path / "s")
    stats = run(data, prefix, "--workers", "2", "--split-sentences", "--append-eod")
    ds = IndexedDataset(prefix + "_text_sentence")
    # the first hand-written document: four sentences -> four sequences, one document
    docs_with_tokens = [d for d in data.docs if any(data.tok.tokenize(s) for s in _texts(d))]
    fox = docs_with_tokens.index(H.EXTRA_DOCS[0])
    first, last = ds.document_indices[fox], ds.document_indices[fox + 1]
    sents = ["The quick brown fox jumps over the lazy dog.", "It was not amused!", "Was it?",
             "Yes."]
    assert last - first == 4
    for k, s in enumerate(sents):
        ids = data.tok.tokenize(s) + ([data.tok.eod] if k == 3 else [])
        assert ds[int(first) + k].tolist() == ids
    # a list value is taken as the document's sentences, as given
    lst = docs_with_tokens.index(H.EXTRA_DOCS[2])
    assert ds.document_indices[lst + 1] - ds.document_indices[lst] == 2
    assert len(ds.document_indices) - 1 == stats["documents"]
    assert stats["sequences"] == len(ds) > stats["documents"]


def test_regex_sentence_splitter():
    split = preprocess_data.regex_split_sentences
    assert split("Hi there. This is e.g. fine! Ok? \"Quoted.\" Next one") == \
        ["Hi there.", "This is e.g. fine!", "Ok?", "\"Quoted.\"", "Next one"]
    assert split("Para one\n\nPara two. lower case stays.") == \
        ["Para one", "Para two. lower case stays."]
    kept = split("One.\nTwo.\n\nThree.", keep_newlines=True)
    assert kept == ["One.\n", "Two.\n\n", "Three."] and "".join(kept) == "One.\nTwo.\n\nThree."


def _outputs(tmp_path, stem):
    return sorted(p for p in os.listdir(tmp_path) if p.startswith(stem))


@pytest.mark.parametrize("bad,why", [
    ('{"text": "unterminated', "malformed JSON"),
    ('{"other": "no text key"}', "missing key 'text'"),
    ('{"text": 42}', "must be a string"),
    ('["not", "an", "object"]', "expected a JSON object"),
])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_bad_line_fails_with_file_and_line_and_leaves_nothing(data, tmp_path, bad, why, workers):
    corpus = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": f"document number {i}."}) for i in range(300)]
    lines.insert(200, bad)
    corpus.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as exc:
        run(data, str(tmp_path / "out"), "--workers", workers, "--chunksize", "8",
            corpus=str(corpus))
    msg = str(exc.value)
    assert f"{corpus}:201: " in msg and why in msg and "\n" not in msg
    assert _outputs(tmp_path, "out") == []  # no .bin/.idx, no temporary files


def test_skip_malformed_counts(data, tmp_path):
    corpus = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": f"document number {i}."}) for i in range(50)]
    lines[10] = "{broken"
    lines[20] = '{"title": "no text"}'
    corpus.write_text("\n".join(lines) + "\n\n")
    stats = run(data, str(tmp_path / "out"), "--workers", "2", "--skip-malformed",
                corpus=str(corpus))
    assert stats["skipped"] == 2 and stats["documents"] == 48
    assert len(IndexedDataset(str(tmp_path / "out_text_document"))) == 48
    assert stats["skipped_examples"][0].startswith(f"{corpus}:11: malformed JSON")


def test_multiple_keys_and_bad_flags(data, tmp_path):
    corpus = tmp_path / "two.jsonl"
    corpus.write_text("".join(json.dumps({"title": f"Title {i}", "text": f"Body text {i}."}) + "\n"
                              for i in range(20)))
    run(data, str(tmp_path / "kv"), "--json-keys", "title", "text", "--workers", "2",
        corpus=str(corpus))
    t = IndexedDataset(str(tmp_path / "kv_title_document"))
    assert t[3].tolist() == data.tok.tokenize("Title 3")
    # keep the dataset alive while reading: its arrays are views of its mmap
    body = IndexedDataset(str(tmp_path / "kv_text_document"))
    assert body[3].tolist() == data.tok.tokenize("Body text 3.")
    with pytest.raises(SystemExit, match="--input: .* does not exist"):
        run(data, str(tmp_path / "x"), corpus=str(tmp_path / "missing.jsonl"))
    with pytest.raises(SystemExit, match="--tokenizer-model"):
        preprocess_data.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "x"),
                              "--tokenizer-model", str(tmp_path / "none.model")])
    assert _outputs(tmp_path, "x") == []


def test_train_tokenizer_model_is_usable_and_reports_bad_lines(data, tmp_path):
    path = H.train_sp(data.corpus, str(tmp_path / "t"), vocab_size=300,
                      extra=["--model-type", "unigram"])
    assert path == str(tmp_path / "t.model") and os.path.isfile(path)
    tok = build_tokenizer(tokenizer_model=path)
    assert tok.vocab_size == 300 + 3 and (tok.eod, tok.pad) == (2, 3)  # + <CLS> <SEP> <MASK>
    text = "Return a new list of the items."
    assert tok.detokenize(tok.tokenize(text)) == text
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine line"}\n{"text": "fine"}\n{oops\n')
    with pytest.raises(SystemExit, match=f"{bad}:3: "):
        train_tokenizer.main(["--input", str(bad), "--model-prefix", str(tmp_path / "b"),
                              "--vocab-size", "20"])
    assert not os.path.exists(tmp_path / "b.model")


def test_make_corpus_is_deterministic_real_text(tmp_path):
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    make_corpus.main(["--output", a, "--max-docs", "40"])
    make_corpus.main(["--output", b, "--max-docs", "40"])
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()
    with open(a, encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    assert len(docs) == 40 and all(set(d) == {"text"} and len(d["text"]) >= 30 for d in docs)
    assert sum(len(d["text"]) for d in docs) > 4000


def test_reader_stays_a_bounded_number_of_lines_ahead():
    """The line feeder blocks once `limit` lines are in flight (what keeps memory flat when the
    workers are slower than reading), resumes as results are consumed, and stop() ends it."""
    import threading
    import time

    fl = preprocess_data._InFlight(5)
    taken = []
    feeder = threading.Thread(target=lambda: taken.extend(fl.lines(iter(["x\n"] * 100))))
    feeder.start()

    def settle(n):
        deadline = time.time() + 10
        while len(taken) < n and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # give it the chance to run further ahead than allowed
        return len(taken)

    assert settle(5) == 5
    for _ in range(3):
        fl.release()
    assert settle(8) == 8
    fl.stop()
    feeder.join(timeout=10)
    assert not feeder.is_alive() and len(taken) == 8


@pytest.mark.parametrize("kind", ["BertWordPieceLowerCase", "SentencePieceTokenizer"])
def test_bert_dataset_builds_on_sentence_level_output(data, tmp_path, kind):
    """megatron-core's BERTMaskedWordPieceDataset (our data/bert.py) over --split-sentences
    output, with a WordPiece vocab file or the sentencepiece model (one gloo rank: the dataset
    needs a process group)."""
    from megatron_moe.runtime.local_ranks import run_distributed

    if kind == "SentencePieceTokenizer":
        kwargs = dict(tokenizer_type=kind, tokenizer_model=data.model)
        flags = ["--tokenizer-model", data.model]
    else:
        vocab = H.write_bert_vocab_for(data.docs, str(tmp_path))
        kwargs = dict(tokenizer_type=kind, vocab_file=vocab)
        flags = ["--vocab-file", vocab]
    tok = build_tokenizer(**kwargs)
    prefix = str(tmp_path / "b")
    preprocess_data.main(["--input", data.corpus, "--output-prefix", prefix, "--tokenizer-type",
                          kind, *flags, "--split-sentences", "--workers", "2", "--no-progress",
                          "--log-interval", "0"])
    if kind != "SentencePieceTokenizer":
        ds = IndexedDataset(prefix + "_text_sentence")
        assert tok.vocab["[UNK]"] not in np.concatenate([ds[i] for i in range(len(ds))]).tolist()
    s = run_distributed(H.bert_sample, 1, prefix + "_text_sentence", kwargs,
                        str(tmp_path / "cache"), timeout_s=180)[0]
    assert s["n"] >= 32 and len(s["text"]) == 64 and s["text"][0] == tok.cls
    assert tok.sep in s["text"] and sum(s["loss_mask"]) > 0 and s["is_random"] in (0, 1)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_invalid_utf8_and_tokenizer_failures_are_clear_errors(tmp_path, workers):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(b'{"text": "1 2 3"}\n' * 10 + b'{"text": "\xff\xfe"}\n')
    argv = ["--input", str(corpus), "--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
            "--workers", workers, "--no-progress", "--chunksize", "4"]
    with pytest.raises(SystemExit, match=r"c.jsonl:11: not valid UTF-8 \(invalid start byte"):
        preprocess_data.main(argv + ["--output-prefix", str(tmp_path / "u")])
    corpus.write_text('{"text": "1 2 3"}\n' * 10 + '{"text": "1 two 3"}\n')
    with pytest.raises(SystemExit, match=r"c.jsonl:11: key 'text': NullTokenizer failed"):
        preprocess_data.main(argv + ["--output-prefix", str(tmp_path / "n")])
    assert _outputs(tmp_path, "u") == [] and _outputs(tmp_path, "n") == []


@pytest.mark.parametrize("vocab_size", [500, 70000])  # uint16 and int32 tokens
def test_writer_is_byte_identical_to_megatron_core_builder(tmp_path, vocab_size):
    """IndexedDatasetWriter (numpy only) vs megatron-core's IndexedDatasetBuilder."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    dtype = preprocess_data.optimal_dtype(vocab_size)
    assert dtype is DType.optimal_dtype(vocab_size)
    docs = []
    for _ in range(40):
        lengths = [int(n) for n in rng.integers(1, 30, size=int(rng.integers(1, 4)))]
        docs.append((rng.integers(0, vocab_size, size=sum(lengths)).tolist(), lengths))
    ours = preprocess_data.IndexedDatasetWriter(str(tmp_path / "o.bin"), dtype)
    for tokens, lengths in docs[:20]:
        ours.add_document(tokens, lengths)
    blob = np.concatenate([np.asarray(t, dtype) for t, _ in docs[20:]]).tobytes()
    ours.add_documents(blob, [n for _, ls in docs[20:] for n in ls],
                       [len(ls) for _, ls in docs[20:]])
    ours.finalize(str(tmp_path / "o.idx"))
    ref = IndexedDatasetBuilder(str(tmp_path / "r.bin"), dtype=dtype)
    for tokens, lengths in docs:
        ref.add_document(np.asarray(tokens), lengths)
    ref.finalize(str(tmp_path / "r.idx"))
    for ext in (".bin", ".idx"):
        with open(tmp_path / ("o" + ext), "rb") as a, open(tmp_path / ("r" + ext), "rb") as b:
            assert a.read() == b.read()
    assert len(IndexedDataset(str(tmp_path / "o"))) == sum(len(ls) for _, ls in docs)


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "BertWordPieceCase",
                                  "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer"])
def test_preprocess_equals_megatron_reference_on_hard_text(tmp_path, kind):
    """End to end on the hard corpus (scripts, controls, whitespace runs, code): the .bin/.idx
    of tools/preprocess_data.py (2 workers, batch tokenization) == megatron-core's builder fed
    with the reference tokenizer's ids (OpenAI GPT-2 / BERT FullTokenizer / tokenizers)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tests import _tokenizer_reference as R

    docs = R.hard_corpus(120, seed=3)
    corpus = tmp_path / "hard.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    if kind == "GPT2BPETokenizer":
        pytest.importorskip("regex")
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.train_from_iterator(docs, trainers.BpeTrainer(
            vocab_size=700, special_tokens=["<|endoftext|>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        vocab, merges = bpe.model.save(str(tmp_path))
        flags = ["--vocab-file", vocab, "--merge-file", merges]
        ref = R.Gpt2Reference(vocab, merges)
        eod = ref.encoder["<|endoftext|>"]
    elif kind == "BertWordPieceCase":
        chars = sorted({c for d in docs for c in d if not c.isspace()})[:300]
        vocab = tmp_path / "vocab.txt"
        vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "def", "##ly"]
                                   + chars + ["##" + c for c in chars[:150]]) + "\n",
                         encoding="utf-8")
        flags = ["--vocab-file", str(vocab)]
        ref = R.BertReference(str(vocab), lower_case=False)
        eod = ref.vocab["[SEP]"]
    elif kind == "Llama2Tokenizer":  # bos + sentencepiece's ids (Megatron's _Llama2Tokenizer)
        import sentencepiece as spm

        model = H.train_sp(str(corpus), str(tmp_path / "sp"), vocab_size=500)
        sp = spm.SentencePieceProcessor(model_file=model)
        flags = ["--tokenizer-model", model]
        ref = type("Ref", (), {"tokenize": lambda self, t: [sp.bos_id()] + sp.encode(t)})()
        eod = sp.eos_id()
    elif kind == "TikTokenizer":  # tiktoken's reference BPE on the ranks, shifted by K = 1000
        from tests.test_tokenizers import _tiktoken_oracle

        pytest.importorskip("regex")
        vocab = H.write_tiktoken_vocab(docs, str(tmp_path / "tik.json"), 400)
        flags = ["--tokenizer-model", vocab, "--vocab-size", "1600", "--tiktoken-pattern", "v1"]
        oracle = _tiktoken_oracle(vocab, "v1", limit=600)
        ref = type("Ref", (), {"tokenize": lambda self, t: [r + 1000 for r in oracle(t)]})()
        eod = 2
    else:
        hf = Tokenizer(models.BPE(unk_token="<unk>"))
        hf.pre_tokenizer = pre_tokenizers.Metaspace()
        hf.train_from_iterator(docs, trainers.BpeTrainer(
            vocab_size=600, special_tokens=["<unk>", "</s>"], show_progress=False))
        hf.save(str(tmp_path / "tokenizer.json"))
        (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
        flags = ["--tokenizer-model", str(tmp_path)]
        ref = type("Ref", (), {"tokenize": lambda self, t: hf.encode(
            t, add_special_tokens=False).ids})()
        eod = hf.token_to_id("</s>")
    stats = preprocess_data.main(["--input", str(corpus), "--output-prefix",
                                  str(tmp_path / "ours"), "--tokenizer-type", kind, *flags,
                                  "--workers", "2", "--append-eod", "--chunksize", "16",
                                  "--no-progress", "--log-interval", "0"])
    dtype = DType.optimal_dtype(1000)
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
    n = 0
    for d in docs:
        ids = ref.tokenize(d)
        if ids:
            builder.add_document(np.asarray(ids + [eod]), [len(ids) + 1])
            n += 1
    builder.finalize(str(tmp_path / "ref.idx"))
    assert stats["documents"] == n > 100 and stats["tokens"] > 2000
    for ext in (".bin", ".idx"):
        with open(str(tmp_path / "ours_text_document") + ext, "rb") as a, \
                open(str(tmp_path / "ref") + ext, "rb") as b:
            assert a.read() == b.read()
