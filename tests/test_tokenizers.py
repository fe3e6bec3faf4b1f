"""Tokenizers by --tokenizer-type: round trips, special ids, megatron-core's base class, errors."""

import json
import os
import pickle

import pytest

from megatron_moe.data import tokenizers as T
from tests import _data_helpers as H
from tests import _tokenizer_reference as R

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
    # the special token's text is not special in the input (Megatron's GPT2Tokenizer)
    assert tok.eod not in tok.tokenize("a<|endoftext|>b")
    for text in TEXTS + ["Ünïcödé — “quotes” 🙂\n\n  tabs\tand  spaces  ", "__init__(self)"]:
        assert tok.detokenize(tok.tokenize(text)) == text
    assert pickle.loads(pickle.dumps(tok)).tokenize(TEXTS[1]) == tok.tokenize(TEXTS[1])


@pytest.fixture(scope="module")
def hard(files):
    """The hard corpus (tests/_tokenizer_reference.py: scripts, controls, zero-width and Unicode
    spaces, whitespace runs, code) plus real documents, and GPT-2 / BERT vocabularies trained on
    it with `tokenizers` (no download)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    with open(files["corpus"], encoding="utf-8") as f:
        plain = [json.loads(line)["text"] for line in f]
    plain = [t if isinstance(t, str) else " ".join(t) for t in plain]
    docs = R.hard_corpus(250, seed=1, plain=plain[:40]) + plain
    d = files["dir"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=1200, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(os.path.join(d, "gpt2"), exist_ok=True)
    vocab, merges = bpe.model.save(os.path.join(d, "gpt2"))
    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wp.normalizer = normalizers.BertNormalizer(lowercase=False)
    wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wp.train_from_iterator(docs, trainers.WordPieceTrainer(
        vocab_size=900, show_progress=False,
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    inv = {i: t for t, i in wp.get_vocab().items()}
    bert = os.path.join(d, "hard_vocab.txt")
    with open(bert, "w", encoding="utf-8") as f:
        f.write("".join(inv[i] + "\n" for i in range(len(inv))))
    return dict(docs=docs, vocab=vocab, merges=merges, bert=bert)


def test_gpt2_bpe_is_byte_identical_to_the_reference_on_hard_text(hard):
    """GPT2BPETokenizer (tokenizers' Rust BPE) vs OpenAI's algorithm as Megatron's
    gpt2_tokenization.py runs it (regex package + byte-level BPE)."""
    pytest.importorskip("regex")
    tok = T.GPT2BPETokenizer(hard["vocab"], hard["merges"])
    ref = R.Gpt2Reference(hard["vocab"], hard["merges"])
    merged = 0
    for text in hard["docs"]:
        ids = tok.tokenize(text)
        assert ids == ref.tokenize(text), repr(text[:80])
        assert tok.detokenize(ids) == text
        merged += len(text.encode("utf-8")) - len(ids)
    assert merged > 0.3 * sum(len(t.encode("utf-8")) for t in hard["docs"])  # BPE really merged
    assert tok.tokenize_batch(hard["docs"][:50]) == [ref.tokenize(t) for t in hard["docs"][:50]]
    assert 0 < len(tok._cache) <= tok._CACHE_ENTRIES  # the regex + piece-cache path ran
    # without the regex package: tokenizers' own ByteLevel pre-tokenizer, same ids
    fallback = T.GPT2BPETokenizer(hard["vocab"], hard["merges"])
    fallback._pattern = None
    for text in hard["docs"]:
        assert fallback.tokenize(text) == ref.tokenize(text), repr(text[:80])
    assert fallback.tokenize_batch(hard["docs"][:50]) == tok.tokenize_batch(hard["docs"][:50])
    assert not fallback._cache
    # the comparison is sensitive: Megatron skips the merges file's first line; ranking it too
    # changes the ids
    with open(hard["merges"], encoding="utf-8") as f:
        lines = f.read().split("\n")
    shifted = os.path.join(os.path.dirname(hard["merges"]), "merges_no_header.txt")
    with open(shifted, "w", encoding="utf-8") as f:
        f.write("\n".join(lines[1:]))
    other = T.GPT2BPETokenizer(hard["vocab"], shifted)
    assert any(other.tokenize(t) != ref.tokenize(t) for t in hard["docs"])


def _assigned_bmp_sample():
    """Every assigned BMP character outside the big CJK / Hangul / private-use blocks, and one
    in 97 inside them."""
    import unicodedata

    big = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xE000, 0xF8FF))
    out = []
    for cp in range(0x10000):
        if 0xD800 <= cp <= 0xDFFF or unicodedata.category(chr(cp)) == "Cn":
            continue
        if any(lo <= cp <= hi for lo, hi in big) and cp % 97:
            continue
        out.append(chr(cp))
    return out


def test_gpt2_pretokenizer_matches_the_regex_package_on_every_character():
    """tokenizers' ByteLevel split (Oniguruma) == OpenAI's regex (the `regex` package) for each
    assigned character in several contexts: after a letter, doubled, before a digit, after a
    space run, before a contraction. (Characters unassigned in this Python's Unicode data may
    differ: the regex package's Unicode tables are its own, newer ones.)"""
    pytest.importorskip("regex")
    from tokenizers import pre_tokenizers

    import regex

    pattern = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    enc = R._bytes_to_unicode()
    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    chars = _assigned_bmp_sample()
    assert len(chars) > 15000
    for i in range(0, len(chars), 8192):
        s = "".join(f"a{c}{c}b {c}1  {c}'s x{c} " for c in chars[i:i + 8192])
        want = ["".join(enc[b] for b in p.encode("utf-8")) for p in pattern.findall(s)]
        assert [p for p, _ in split.pre_tokenize_str(s)] == want


@pytest.mark.parametrize("kind", ["BertWordPieceLowerCase", "BertWordPieceCase"])
def test_bert_wordpiece_is_byte_identical_to_full_tokenizer_on_hard_text(hard, kind):
    """BertWordPiece* vs BERT's FullTokenizer (Megatron's bert_tokenization.py)."""
    tok = T.build_tokenizer(tokenizer_type=kind, vocab_file=hard["bert"])
    ref = R.BertReference(hard["bert"], lower_case=kind.endswith("LowerCase"))
    unk = pieces = 0
    for text in hard["docs"]:
        ids = tok.tokenize(text)
        assert ids == ref.tokenize(text), repr(text[:80])
        unk += ids.count(tok.vocab["[UNK]"])
        pieces += sum(tok.inv_vocab[i].startswith("##") for i in ids)
    assert unk > 0 and pieces > 100  # both WordPiece outcomes were exercised
    assert tok.tokenize_batch(hard["docs"][:50]) == [ref.tokenize(t) for t in hard["docs"][:50]]
    # every assigned BMP character through the basic tokenizer (clean, CJK, case, accents,
    # punctuation), in context
    chars = _assigned_bmp_sample()
    for i in range(0, len(chars), 8192):
        s = "".join(f"a{c}{c}b {c}1 {c}.Σ{c}Σ " for c in chars[i:i + 8192])
        assert tok.basic(s).split() == ref.basic(s)


def test_tokenizers_own_bert_pipeline_would_differ(hard):
    """Why BertWordPiece* does BERT's basic tokenization itself: tokenizers' BertNormalizer +
    BertPreTokenizer differ from FullTokenizer on the hard corpus (private-use characters,
    final sigma, the CJK block U+2B820-U+2B91F)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    ref = R.BertReference(hard["bert"], lower_case=True)
    own = Tokenizer(models.WordPiece(dict(ref.vocab), unk_token="[UNK]",
                                     max_input_chars_per_word=200))
    own.normalizer = normalizers.BertNormalizer(lowercase=True)
    own.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    texts = hard["docs"] + ["ΟΔΥΣΣΕΥΣ", "\U0002B820\U0002B821"]
    assert sum(own.encode(t, add_special_tokens=False).ids != ref.tokenize(t) for t in texts) > 3


def _hf_dir(path, config=True):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator(TEXTS * 3, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<pad>", "</s>"], show_progress=False))
    hf.add_special_tokens(["<extra_0>"])
    os.makedirs(path, exist_ok=True)
    hf.save(os.path.join(path, "tokenizer.json"))
    if config:
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}, f)
        with open(os.path.join(path, "special_tokens_map.json"), "w") as f:  # AddedToken form
            json.dump({"pad_token": {"content": "<pad>", "lstrip": False, "normalized": False,
                                     "rstrip": False, "single_word": False}}, f)
    return hf


def test_huggingface_tokenizer_directory(tmp_path, hard):
    from tokenizers import processors

    hf = _hf_dir(str(tmp_path))
    tok = T.build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert (tok.eod, tok.pad) == (2, 1)
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True) == len(tok.vocab)
    for text in TEXTS + hard["docs"][:100]:
        assert tok.tokenize(text) == hf.encode(text, add_special_tokens=False).ids
    ids = tok.tokenize(TEXTS[0])
    assert tok.detokenize(ids).replace(" ", "") == TEXTS[0].replace(" ", "")
    assert tok.tokenize("a <extra_0> b")[1] == tok.vocab["<extra_0>"]  # added tokens are kept
    assert tok.tokenize_batch(TEXTS) == [tok.tokenize(t) for t in TEXTS]
    starts = tok.offsets(ids, TEXTS[0])  # where each token starts in the text
    assert starts[0] == 0 and starts == sorted(starts) and len(set(starts)) == len(ids) > 3
    assert all(TEXTS[0].startswith(tok.inv_vocab[i], at) for i, at in zip(ids, starts))
    assert pickle.loads(pickle.dumps(tok)).tokenize(TEXTS[2]) == tok.tokenize(TEXTS[2])
    # --tokenizer-hf-include-special-tokens: the post-processor's tokens (here a trailing eos)
    hf.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                      special_tokens=[("</s>", 2)])
    hf.save(str(tmp_path / "tokenizer.json"))
    with_specials = T.build_tokenizer(tokenizer_type="HuggingFaceTokenizer",
                                      tokenizer_model=str(tmp_path),
                                      tokenizer_hf_include_special_tokens=True)
    assert with_specials.tokenize(TEXTS[0]) == ids + [2]
    assert with_specials.tokenize_batch(TEXTS[:1]) == [ids + [2]]
    assert T.build_tokenizer(tokenizer_type="HuggingFaceTokenizer",
                             tokenizer_model=str(tmp_path)).tokenize(TEXTS[0]) == ids
    with pytest.raises(T.TokenizerError, match="--tokenizer-hf-include-special-tokens"):
        T.build_tokenizer(tokenizer_type="BertWordPieceCase", vocab_file="x",
                          tokenizer_hf_include_special_tokens=True)
    # without an eos_token there is no end-of-document: an error naming the flag when used
    _hf_dir(str(tmp_path / "noeos"), config=False)
    noeos = T.build_tokenizer(tokenizer_type="HuggingFaceTokenizer",
                              tokenizer_model=str(tmp_path / "noeos"))
    assert noeos.pad == -1
    with pytest.raises(T.TokenizerError, match="--tokenizer-model: .* no eos_token"):
        noeos.eod


def test_huggingface_tokenizer_matches_transformers_autotokenizer(tmp_path, hard):
    """Megatron's _HuggingFaceTokenizer loads the directory with transformers.AutoTokenizer:
    same ids and specials from `tokenizers` directly (runs where transformers is installed)."""
    transformers = pytest.importorskip("transformers")
    _hf_dir(str(tmp_path))
    ours = T.HuggingFaceTokenizer(str(tmp_path))
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert (ours.eod, ours.pad, ours.vocab_size) == (auto.eos_token_id, auto.pad_token_id,
                                                     len(auto))
    for text in hard["docs"][:200]:
        assert ours.tokenize(text) == auto.encode(text, add_special_tokens=False)


def test_gpt2_matches_transformers_slow_gpt2_tokenizer(hard):
    """transformers' pure-Python GPT2Tokenizer (OpenAI's algorithm; what Megatron-LM 0.16's
    default tokenizer system loads for GPT2BPETokenizer), where transformers is installed."""
    transformers = pytest.importorskip("transformers")
    slow = transformers.GPT2Tokenizer(hard["vocab"], hard["merges"])
    tok = T.GPT2BPETokenizer(hard["vocab"], hard["merges"])
    for text in hard["docs"]:
        assert tok.tokenize(text) == slow.convert_tokens_to_ids(slow.tokenize(text))


def test_huggingface_tokenizer_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(T.TokenizerError, match="--tokenizer-model"):
        T.build_tokenizer(tokenizer_type="HuggingFaceTokenizer",
                          tokenizer_model=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(T.TokenizerError, match="tokenizer.json.*transformers"):
            T.build_tokenizer(tokenizer_type="HuggingFaceTokenizer",
                              tokenizer_model=str(tmp_path / "empty"))


def test_bert_wordpiece(files):
    tok = T.build_tokenizer(tokenizer_type="BertWordPieceLowerCase", vocab_file=files["bert"])
    v = tok.vocab
    ids = tok.tokenize("The quick fox JUMPED, unaffable! Café 中文 zzz")
    assert [tok.inv_vocab[i] for i in ids] == [
        "the", "quick", "fox", "jump", "##ed", ",", "un", "##aff", "##able", "!", "cafe",
        "中", "文", "[UNK]"]
    # Megatron's convert_tokens_to_string: pieces glued, space before punctuation removed
    assert tok.detokenize(tok.tokenize("the fox jumps over the lazy dog.")) == \
        "the fox jumps over the lazy dog."
    assert (tok.cls, tok.sep, tok.pad, tok.mask, tok.eod) == (
        v["[CLS]"], v["[SEP]"], v["[PAD]"], v["[MASK]"], v["[SEP]"])
    assert tok.vocab_size == len(H.BERT_VOCAB)
    cased = T.build_tokenizer(tokenizer_type="BertWordPieceCase", vocab_file=files["bert"])
    assert [cased.inv_vocab[i] for i in cased.tokenize("Hello hello HELLO")] == \
        ["Hello", "hello", "[UNK]"]
    assert pickle.loads(pickle.dumps(cased)).tokenize("Hello") == [v["Hello"]]


def test_building_tokenizers_imports_neither_torch_nor_megatron_core(files, tmp_path):
    """What keeps tools/preprocess_data.py's start-up short."""
    import subprocess
    import sys

    _hf_dir(str(tmp_path))
    code = (
        "import sys\n"
        "from megatron_moe.data.tokenizers import build_tokenizer\n"
        f"for kw in [dict(tokenizer_model={files['sp']!r}),\n"
        f"           dict(tokenizer_type='GPT2BPETokenizer', vocab_file={files['vocab']!r},\n"
        f"                merge_file={files['merges']!r}),\n"
        f"           dict(tokenizer_type='BertWordPieceLowerCase', vocab_file={files['bert']!r}),\n"
        f"           dict(tokenizer_type='HuggingFaceTokenizer',\n"
        f"                tokenizer_model={str(tmp_path)!r})]:\n"
        "    assert build_tokenizer(**kw).tokenize('Hello, wörld!')\n"
        "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    # and the class is megatron-core's tokenizer type once megatron-core is in use
    tok = T.build_tokenizer(tokenizer_type="BertWordPieceCase", vocab_file=files["bert"])
    assert isinstance(tok, T.megatron_core_base()) and isinstance(tok, T._TokenizerBase)


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
    (dict(tokenizer_type="TikTokenizer", tokenizer_model="/no/vocab.json"), "--tokenizer-model"),
    (dict(tokenizer_type="Llama2Tokenizer"), "--tokenizer-model"),
    (dict(tokenizer_type="GPT2BPETokenizer", tokenizer_special_tokens=["<s>"]),
     "--tokenizer-special-tokens"),
])
def test_bad_settings_name_the_flag(kwargs, flag):
    with pytest.raises(T.TokenizerError, match=flag):
        T.build_tokenizer(**kwargs)


def test_not_a_sentencepiece_model(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(T.TokenizerError, match="not a sentencepiece model"):
        T.build_tokenizer(tokenizer_model=str(bad))


def test_llama2_tokenizer_prepends_bos(files):
    """Megatron's _Llama2Tokenizer: bos + sentencepiece ids, eod = eos, nothing added."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=files["sp"])
    tok = T.build_tokenizer(tokenizer_type="Llama2Tokenizer", tokenizer_model=files["sp"])
    assert (tok.vocab_size, tok.bos, tok.eod, tok.eos, tok.pad) == \
        (sp.get_piece_size(), sp.bos_id(), sp.eos_id(), sp.eos_id(), sp.pad_id()) == (400, 1, 2, 2, 3)
    for text in TEXTS + [""]:
        ids = tok.tokenize(text)
        assert ids == [sp.bos_id()] + sp.encode(text)
        assert tok.detokenize(ids) == text
    assert tok.tokenize_batch(TEXTS + [""]) == [tok.tokenize(t) for t in TEXTS + [""]]
    # offsets: where each piece starts (the bos piece is empty, at 0)
    text = TEXTS[1]
    ids = tok.tokenize(text)
    offsets = tok.offsets(ids, text)
    assert len(offsets) == len(ids) and offsets[0] == 0 and offsets == sorted(offsets)
    assert pickle.loads(pickle.dumps(tok)).tokenize(TEXTS[2]) == tok.tokenize(TEXTS[2])
    assert not hasattr(tok, "cls")
    with pytest.raises(T.TokenizerError, match="no eos"):
        T.build_tokenizer(tokenizer_type="Llama2Tokenizer", tokenizer_model=files["noeos"])


@pytest.fixture(scope="module")
def tik(files, hard):
    path = H.write_tiktoken_vocab(hard["docs"], os.path.join(files["dir"], "tik.json"), 500)
    with open(path) as f:
        n = len(json.load(f))
    return dict(path=path, n=n, docs=hard["docs"])


def _tiktoken_oracle(path, pattern, limit=None):
    """tiktoken's pure-Python reference BPE (tiktoken._educational, run by `regex`) on the
    file's ranks, unshifted: an encoder independent of tiktoken's Rust core."""
    import base64
    import contextlib
    import io

    from tiktoken._educational import SimpleBytePairEncoding

    with open(path) as f:
        entries = json.load(f)[:limit]
    ranks = {base64.b64decode(e["token_bytes"]): e["rank"] for e in entries}
    enc = SimpleBytePairEncoding(pat_str=T.TIKTOKEN_PATTERNS[pattern], mergeable_ranks=ranks)

    def encode(text):
        with contextlib.redirect_stdout(io.StringIO()):  # it prints nothing with visualise=None
            return enc.encode(text, visualise=None)

    return encode


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_ids_are_shifted_ranks_of_the_reference_bpe(tik, pattern):
    pytest.importorskip("regex")
    k = 1000
    tok = T.build_tokenizer(tokenizer_type="TikTokenizer", tokenizer_model=tik["path"],
                            tiktoken_pattern=pattern, vocab_size=k + tik["n"],
                            tiktoken_num_special_tokens=k)
    oracle = _tiktoken_oracle(tik["path"], pattern)
    compared = 0
    for doc in tik["docs"]:
        if "<" in doc:  # special-token strings are checked below
            continue
        assert tok.tokenize(doc) == [r + k for r in oracle(doc)], doc[:80]
        assert tok.detokenize(tok.tokenize(doc)) == doc
        compared += 1
    assert compared > 200
    assert tok.tokenize_batch(tik["docs"][:20]) == [tok.tokenize(d) for d in tik["docs"][:20]]


def test_tiktokenizer_special_tokens_and_vocab_size(tik):
    """Megatron's default system: 1000 special ids first (7 named, then <SPECIAL_i> fillers),
    special-token strings in the text are special, the file is cut at --vocab-size."""
    tok = T.build_tokenizer(tokenizer_type="TikTokenizer", tokenizer_model=tik["path"],
                            vocab_size=1600)
    assert (tok.unk, tok.bos, tok.eod, tok.eos, tok.mask, tok.pad, tok.cls, tok.sep) == \
        (0, 1, 2, 2, 3, 4, 5, 6)
    assert tok.vocab_size == 1600 and len(tok.vocab) == 1600
    assert tok.vocab["<SPECIAL_7>"] == 7 and tok.vocab["<SPECIAL_999>"] == 999
    assert tok.vocab[b"a"] == 1000 + ord("a") and tok.inv_vocab[1599] == tok.inv_vocab[1599]
    assert max(i for d in tik["docs"][:50] for i in tok.tokenize(d)) < 1600  # ranks >= 600 cut
    ids = tok.tokenize("x<s>y</s><SPECIAL_9>")
    assert ids == [1000 + ord("x"), 1, 1000 + ord("y"), 2, 9]
    assert tok.detokenize(ids) == "x<s>y</s><SPECIAL_9>"
    # a custom list (Megatron's --tokenizer-special-tokens; --tiktoken-special-tokens is its
    # deprecated name) and a smaller --tiktoken-num-special-tokens shift every id
    names = ["<pad>", "<unk>", "<s>", "</s>", "<mask>", "<cls>", "<sep>", "<|im_start|>"]
    custom = T.build_tokenizer(tokenizer_type="TikTokenizer", tokenizer_model=tik["path"],
                               vocab_size=700, tiktoken_num_special_tokens=10,
                               tiktoken_special_tokens=names)
    assert (custom.pad, custom.unk, custom.bos, custom.eod) == (0, 1, 2, 3)
    assert custom.vocab["<|im_start|>"] == 7 and custom.vocab["<SPECIAL_9>"] == 9
    assert custom.tokenize("a<|im_start|>") == [10 + ord("a"), 7]
    assert pickle.loads(pickle.dumps(custom)).tokenize("hello there") == \
        custom.tokenize("hello there")
    text = "naïve café"
    ids = custom.tokenize(text)
    # the character holding each token's first byte ("ï" is two byte tokens here)
    raw, starts = text.encode(), [0]
    for i in ids[:-1]:
        starts.append(starts[-1] + len(custom.inv_vocab[i]))
    expected = [len(raw[:b].decode("utf-8", errors="ignore")) for b in starts]
    assert custom.offsets(ids, text) == expected and len(set(expected)) < len(ids)
    assert custom.offsets(ids[:3], text) == expected[:3]  # ends inside "ï": not UTF-8


@pytest.mark.parametrize("kwargs,match", [
    (dict(vocab_size=100000), "has 756 tokens, fewer than"),
    (dict(tokenizer_special_tokens=["<unk>", "<s>", "</s>"]), "must include"),
    (dict(tiktoken_pattern="v3"), "--tiktoken-pattern"),
    (dict(vocab_size=1600, tiktoken_num_special_tokens=5), "--tiktoken-num-special-tokens"),
])
def test_tiktokenizer_bad_settings_name_the_flag(tik, kwargs, match):
    with pytest.raises(T.TokenizerError, match=match):
        T.build_tokenizer(tokenizer_type="TikTokenizer", tokenizer_model=tik["path"], **kwargs)


def test_tiktokenizer_bad_vocabulary_names_the_entry(tmp_path):
    import base64

    entries = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(),
                "token_str": ""} for i in range(256)]
    entries[65]["token_bytes"] = base64.b64encode(b"B").decode()
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(entries))
    with pytest.raises(T.TokenizerError, match="entry 65 must be the single byte 65"):
        T.build_tokenizer(tokenizer_type="TikTokenizer", tokenizer_model=str(path), vocab_size=1256)
    path.write_text('{"a": 1}')
    with pytest.raises(T.TokenizerError, match="expected a JSON list"):
        T.build_tokenizer(tokenizer_type="TikTokenizer", tokenizer_model=str(path))
