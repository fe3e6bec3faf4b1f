"""Tokenizers by --tokenizer-type: round trips, special ids, megatron-core's base class, errors."""

import json
import pickle

import pytest

from megatron_moe.data import tokenizers as T
from tests import _data_helpers as H

TEXTS = [
    "Return the number of items in the container.",
    "The quick brown fox jumps over the lazy dog. It was not amused!",
    "x = 3 and then the thing ends",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    corpus = str(d / "corpus.jsonl")
    H.write_corpus(corpus, max_docs=80)
    model = H.train_sp(corpus, str(d / "sp"), vocab_size=400)
    # a model without eos/pad pieces, to see SentencePieceTokenizer add them
    import sentencepiece as spm
    spm.SentencePieceTrainer.train(input=corpus, model_prefix=str(d / "noeos"), vocab_size=300,
                                   eos_id=-1, pad_id=-1, hard_vocab_limit=False, minloglevel=2,
                                   num_threads=1)
    vocab, merges = H.write_gpt2_files(str(d))
    return dict(dir=str(d), corpus=corpus, sp=model, noeos=str(d / "noeos.model"), vocab=vocab,
                merges=merges, bert=H.write_bert_vocab(str(d)))


def test_sentencepiece_round_trip_and_specials(files):
    tok = T.build_tokenizer(tokenizer_type="SentencePieceTokenizer", tokenizer_model=files["sp"])
    assert isinstance(tok, T._TokenizerBase)
    assert (tok.eod, tok.pad) == (2, 3)  # train_tokenizer's eos and pad ids
    # BERT's specials are added after the model's 400 pieces (Megatron's SentencePieceTokenizer)
    assert (tok.cls, tok.sep, tok.mask, tok.vocab_size) == (400, 401, 402, 403)
    assert tok.inv_vocab[401] == "<SEP>" and tok.vocab["<MASK>"] == 402
    for text in TEXTS:
        ids = tok.tokenize(text)
        assert ids and all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    assert tok.unique_identifiers["class"] == "SentencePieceTokenizer"
    assert tok.unique_identifiers["tokenizer_path"] == [files["sp"]]
    # a namespace (Megatron's args) works as well as keywords; default type is sentencepiece
    import argparse
    ns = argparse.Namespace(tokenizer_type=None, tokenizer_model=files["sp"], vocab_file=None,
                            merge_file=None, vocab_size=None)
    assert T.build_tokenizer(ns).tokenize(TEXTS[0]) == tok.tokenize(TEXTS[0])
    # picklable (reloads the model file), as multiprocessing and dataloader workers need
    again = pickle.loads(pickle.dumps(tok))
    assert again.tokenize(TEXTS[1]) == tok.tokenize(TEXTS[1])


def test_sentencepiece_adds_missing_eod_and_pad(files):
    tok = T.build_tokenizer(tokenizer_model=files["noeos"])
    assert tok.vocab_size == 305 and (tok.eod, tok.pad) == (303, 304)
    assert tok.detokenize(tok.tokenize(TEXTS[0]) + [tok.eod]) == TEXTS[0]
    with pytest.raises(T.TokenizerError, match="no eos"):
        T.build_tokenizer(tokenizer_type="GPTSentencePieceTokenizer",
                          tokenizer_model=files["noeos"])
    gpt = T.build_tokenizer(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=files["sp"])
    assert (gpt.vocab_size, gpt.eod, gpt.pad) == (400, 2, 3)  # Megatron's GPT variant adds nothing
    assert not hasattr(gpt, "cls")  # so the BERT dataset's check names the tokenizer


def test_gpt2_bpe_merges_and_round_trip(files):
    tok = T.build_tokenizer(tokenizer_type="GPT2BPETokenizer", vocab_file=files["vocab"],
                            merge_file=files["merges"])
    v = tok.vocab
    assert tok.tokenize("the and") == [v["the"], v["Ġand"]]
    # "th" (rank 0) merges before "Ġt" (rank 2); "Ġthe" then comes from "Ġ" + "the"
    assert tok.tokenize(" then") == [v["Ġthe"], v["n"]]
    assert tok.tokenize(" tin") == [v["Ġt"], v["in"]]
    assert tok.tokenize("thing") == [v["th"], v["ing"]]  # rank order: 'th' merges before 'in'
    assert tok.eod == v["<|endoftext|>"] and tok.pad == -1
    for text in TEXTS + ["Ünïcödé — “quotes” 🙂\n\n  tabs\tand  spaces  ",
                         "__init__(self)"]:
        assert tok.detokenize(tok.tokenize(text)) == text


def test_gpt2_bpe_matches_huggingface_tokenizers(files):
    """Same vocab/merges through HF `tokenizers`' GPT-2 byte-level BPE: identical ids."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    hf = tokenizers.Tokenizer(models.BPE.from_file(files["vocab"], files["merges"]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    ours = T.GPT2BPETokenizer(files["vocab"], files["merges"])
    with open(files["corpus"], encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    docs = [d if isinstance(d, str) else " ".join(d) for d in docs]
    for text in docs:
        assert ours.tokenize(text) == hf.encode(text).ids


def test_huggingface_tokenizer_directory(files, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator(TEXTS * 3, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<pad>", "</s>"]))
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = T.build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert (tok.eod, tok.pad) == (2, 1)
    ids = tok.tokenize(TEXTS[0])
    assert ids == hf.encode(TEXTS[0]).ids
    assert tok.detokenize(ids).replace(" ", "") == TEXTS[0].replace(" ", "")


def test_huggingface_tokenizer_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(T.TokenizerError, match="--tokenizer-model"):
        T.build_tokenizer(tokenizer_type="HuggingFaceTokenizer",
                          tokenizer_model=str(tmp_path / "nope"))


def test_bert_wordpiece(files):
    tok = T.build_tokenizer(tokenizer_type="BertWordPieceLowerCase", vocab_file=files["bert"])
    v = tok.vocab
    ids = tok.tokenize("The quick fox JUMPED, unaffable! Café 中文 zzz")
    assert [tok.inv_vocab[i] for i in ids] == [
        "the", "quick", "fox", "jump", "##ed", ",", "un", "##aff", "##able", "!", "cafe",
        "中", "文", "[UNK]"]
    assert tok.detokenize(tok.tokenize("the fox jumps over the lazy dog.")) == \
        "the fox jumps over the lazy dog ."
    assert (tok.cls, tok.sep, tok.pad, tok.mask, tok.eod) == (
        v["[CLS]"], v["[SEP]"], v["[PAD]"], v["[MASK]"], v["[SEP]"])
    assert tok.vocab_size == len(H.BERT_VOCAB)
    cased = T.build_tokenizer(tokenizer_type="BertWordPieceCase", vocab_file=files["bert"])
    assert [cased.inv_vocab[i] for i in cased.tokenize("Hello hello HELLO")] == \
        ["Hello", "hello", "[UNK]"]


def test_null_tokenizer():
    tok = T.build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=100)
    assert tok.tokenize("5 17 99") == [5, 17, 99]
    assert tok.detokenize([5, 17]) == "5 17"
    assert (tok.vocab_size, tok.eod) == (101, 100)


def test_vocab_size_with_padding():
    assert T.vocab_size_with_padding(50257, 128, 1) == 50304
    assert T.vocab_size_with_padding(50257, 128, 8) == 51200
    assert T.vocab_size_with_padding(4000, 128, 2) == 4096
    assert T.vocab_size_with_padding(256, 128, 2) == 256


@pytest.mark.parametrize("kwargs,flag", [
    (dict(tokenizer_type="Nope"), "--tokenizer-type"),
    (dict(tokenizer_model="/no/such.model"), "--tokenizer-model"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/no/vocab.json"), "--vocab-file"),
    (dict(tokenizer_type="BertWordPieceCase"), "--vocab-file"),
    (dict(tokenizer_type="NullTokenizer"), "--vocab-size"),
])
def test_bad_settings_name_the_flag(kwargs, flag):
    with pytest.raises(T.TokenizerError, match=flag):
        T.build_tokenizer(**kwargs)


def test_not_a_sentencepiece_model(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(T.TokenizerError, match="not a sentencepiece model"):
        T.build_tokenizer(tokenizer_model=str(bad))
