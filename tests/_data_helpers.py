"""Tiny corpora and tokenizer files for the data tests (built on the fly, a second or two)."""

from __future__ import annotations

import json
import os

from tools import make_corpus, train_tokenizer

# A few hand-written documents: several sentences, unicode, a pre-split list, an empty text.
EXTRA_DOCS = [
    {"text": "The quick brown fox jumps over the lazy dog. It was not amused! Was it? Yes."},
    {"text": "Ünïcödé text — with dashes, “quotes” and emoji 🙂 survive the round trip."},
    {"text": ["A document given as a list.", "Each item is one sentence."]},
    {"text": ""},
    {"text": "Line one of a paragraph.\n\nA second paragraph starts here.\nAnd goes on."},
]


def write_corpus(path: str, max_docs: int = 120) -> list:
    """Standard-library docstrings (make_corpus) plus EXTRA_DOCS; returns the documents."""
    make_corpus.main(["--output", path, "--max-docs", str(max_docs)])
    with open(path, encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    with open(path, "a", encoding="utf-8") as f:
        for d in EXTRA_DOCS:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    return docs + EXTRA_DOCS


def train_sp(corpus: str, prefix: str, vocab_size: int = 600, extra=()) -> str:
    return train_tokenizer.main(["--input", corpus, "--model-prefix", prefix, "--vocab-size",
                                 str(vocab_size), "--character-coverage", "1.0",
                                 "--num-threads", "1", *extra])


def sp_dataset(directory, max_docs: int, vocab_size: int, tokenizer_type: str | None = None):
    """write_corpus + a sentencepiece model trained on it + its .bin/.idx (eod appended; by
    preprocess_data's default tokenizer type unless `tokenizer_type` names another):
    (the --data-path prefix, the --tokenizer-model path)."""
    from tools import preprocess_data

    corpus = os.path.join(directory, "corpus.jsonl")
    write_corpus(corpus, max_docs=max_docs)
    tok = train_sp(corpus, os.path.join(directory, "sp"), vocab_size=vocab_size)
    prefix = os.path.join(directory, "corpus")
    kind = ["--tokenizer-type", tokenizer_type] if tokenizer_type else []
    preprocess_data.main(["--input", corpus, "--output-prefix", prefix, "--tokenizer-model", tok,
                          *kind, "--no-progress", "--log-interval", "0", "--append-eod"])
    return prefix + "_text_document", tok


def write_gpt2_files(directory: str):
    """A small byte-level BPE vocab: all 256 byte symbols, a few merges, <|endoftext|>."""
    from megatron_moe.data.tokenizers import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    merges = [("t", "h"), ("th", "e"), ("Ġ", "t"), ("i", "n"), ("Ġ", "a"), ("o", "n"),
              ("e", "r"), ("Ġa", "n"), ("Ġan", "d"), ("in", "g"), ("Ġ", "the")]
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    vocab_file = os.path.join(directory, "vocab.json")
    merge_file = os.path.join(directory, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merge_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return vocab_file, merge_file


BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "quick", "brown", "fox",
              "jump", "##s", "##ed", "over", "lazy", "dog", ".", ",", "!", "cafe", "un", "##aff",
              "##able", "a", "b", "c", "##b", "##c", "Hello", "hello", "中", "文"]


def write_bert_vocab(directory: str) -> str:
    path = os.path.join(directory, "vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(BERT_VOCAB) + "\n")
    return path


def write_bert_vocab_for(docs, directory: str, words: int = 400) -> str:
    """A WordPiece vocab covering `docs`: specials, every character (alone and as ##suffix)
    and the most frequent lower-cased words, so nothing tokenizes to [UNK]."""
    from collections import Counter

    from megatron_moe.data.tokenizers import BertWordPieceTokenizer

    basic = BertWordPieceTokenizer.__new__(BertWordPieceTokenizer)
    basic.lower_case = True
    counts = Counter()
    for d in docs:
        for text in (d["text"] if isinstance(d["text"], list) else [d["text"]]):
            counts.update(basic.basic(text).split())
    chars = sorted({c for w in counts for c in w})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars]
    vocab += [w for w, _ in counts.most_common(words) if len(w) > 1]
    path = os.path.join(directory, "bert_vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(dict.fromkeys(vocab)) + "\n")
    return path


def bert_sample(rank, world_size, prefix, tokenizer_kwargs, cache):
    """Build megatron-core's BERT datasets (our data/bert.py) on a sentence-level dataset and
    return the first training sample. The masked datasets need a process group (run_distributed)."""
    import types

    import numpy as np

    from megatron_moe.data.bert import build_bert_datasets
    from megatron_moe.data.tokenizers import build_tokenizer

    tok = build_tokenizer(**tokenizer_kwargs)
    args = types.SimpleNamespace(
        seed=1, seq_length=64, data_path=[prefix], train_data_path=None, valid_data_path=None,
        test_data_path=None, split="100,0,0", data_cache_path=cache, mask_prob=0.15,
        short_seq_prob=0.1, bert_binary_head=True)
    train, _, _ = build_bert_datasets(args, tok, [32, 0, 0])
    s = train[0]
    return dict(n=len(train),
                **{k: np.asarray(s[k]).tolist() for k in ("text", "loss_mask", "is_random")})


def write_tiktoken_vocab(docs, path: str, merges: int = 500) -> str:
    """Megatron's tiktoken JSON vocabulary (a list of {rank, token_bytes, token_str}): the 256
    bytes in order, then the merges of a byte-level BPE trained on `docs` with `tokenizers`
    (rank = merge order, as tiktoken ranks merges)."""
    import base64

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from megatron_moe.data.tokenizers import bytes_to_unicode

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=256 + merges, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    tokens = [bytes([i]) for i in range(256)]
    seen = set(tokens)
    for merge in json.loads(bpe.to_str())["model"]["merges"]:
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        token = bytes(byte_of[c] for c in a + b)
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode("ascii"),
                "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(tokens)]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(entries, f)
    return path


def train_hf_bytelevel(texts, directory: str, vocab_size: int, eos: str, **config) -> str:
    """A byte-level BPE tokenizer.json (GPT-2/Qwen's kind) trained on `texts` with the `tokenizers`
    library, plus a tokenizer_config.json naming `eos` (and `config`); returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eos], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(directory, exist_ok=True)
    hf.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": eos, **config}, f)
    return directory
