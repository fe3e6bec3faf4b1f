"""Megatron-LM's tokenizers by ``--tokenizer-type``, with megatron-core's legacy tokenizer API.

``build_tokenizer(args)`` takes an argparse namespace, a dict or keyword arguments with Megatron's
field names (``tokenizer_type``, ``tokenizer_model``, ``vocab_file``, ``merge_file``,
``vocab_size``) and returns an object with the interface ``GPTDataset``/
``BERTMaskedWordPieceDataset`` consume: ``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``,
``tokenize(text) -> list[int]``, ``detokenize(ids) -> str`` (BERT: also ``cls``/``sep``/``mask``).

Types:
  SentencePieceTokenizer (default)  --tokenizer-model m.model. eod = the model's eos id (``</s>``),
      pad = the model's pad id; for BERT also cls/sep/mask (``<CLS>``, ``<SEP>``, ``<MASK>``).
      Pieces the model lacks (those three, and ``<EOD>``/``<PAD>`` without eos/pad) are added
      after its vocabulary, as Megatron does, which grows ``vocab_size`` by up to 5.
  GPTSentencePieceTokenizer         --tokenizer-model; Megatron's variant: nothing is added,
      eod = eos id, pad = the model's pad id (-1 when the model has none).
  Llama2Tokenizer                   --tokenizer-model; Megatron's _Llama2Tokenizer: as
      GPTSentencePieceTokenizer, and every tokenize() call starts with the model's bos id.
  TikTokenizer                      --tokenizer-model vocab.json (Megatron's tiktoken JSON: a list
      of {rank, token_bytes (base64), token_str}) --tiktoken-pattern v1|v2 --vocab-size N
      --tiktoken-num-special-tokens K --tokenizer-special-tokens ...: tiktoken's BPE, the K
      special tokens take ids 0..K-1 and the file's ranks are shifted by K; eod = ``</s>``.
  GPT2BPETokenizer                  --vocab-file vocab.json --merge-file merges.txt: GPT-2's
      byte-level BPE on the ``tokenizers`` library (Rust); eod = ``<|endoftext|>``, pad = -1.
  HuggingFaceTokenizer              --tokenizer-model DIR: a local Hugging Face tokenizer
      directory. DIR/tokenizer.json runs on ``tokenizers`` directly (eos/bos/pad names from
      tokenizer_config.json or special_tokens_map.json, as AutoTokenizer reads them); a
      directory without tokenizer.json needs ``transformers`` (AutoTokenizer).
  BertWordPieceLowerCase / BertWordPieceCase   --vocab-file vocab.txt: Google BERT's
      FullTokenizer (basic tokenizer + greedy WordPiece); the WordPiece step on ``tokenizers``.
      cls/sep/mask/pad from the vocab, eod = [SEP].
  NullTokenizer                     --vocab-size N: text is space-separated ids; eod = N,
      vocab_size = N + 1 (Megatron's convention).

Token ids are those of Megatron-LM's own implementations: for GPT-2 the OpenAI encoder (regex +
byte-level BPE) that Megatron's ``gpt2_tokenization.py`` follows, for BERT Megatron's
``bert_tokenization.FullTokenizer`` (tests/test_tokenizers.py compares them on mixed-script,
control-character, whitespace-run and code text). Where Megatron-LM 0.16's two tokenizer
systems differ, the default (non ``--legacy-tokenizer``) one's special ids are used: BERT's eod
is [SEP] and nothing is added to its vocab; HuggingFaceTokenizer adds no special tokens to the
text. A pad of -1 means "no pad token": megatron-core's datasets then pad with their own id.

Importing this module and building a tokenizer import neither torch nor megatron-core (the
preprocessing tool's start-up). The classes are registered as virtual subclasses of
megatron-core's tokenizer base (``megatron_moe.compat.megatron_tokenizer_base()``) as soon as
megatron-core is in use (see ``megatron_core_base``); megatron-core's datasets read only the
attributes above.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
import unicodedata
from collections import OrderedDict
from functools import lru_cache
from typing import Any, Iterable, List, Optional

from megatron_moe.compat import megatron_tokenizer_base

TOKENIZER_TYPES = (
    "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "GPT2BPETokenizer",
    "HuggingFaceTokenizer", "BertWordPieceLowerCase", "BertWordPieceCase", "TikTokenizer",
    "NullTokenizer",
)


class TokenizerError(ValueError):
    """Bad tokenizer settings or files; the message names the flag."""


def vocab_size_with_padding(orig_vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1) -> int:
    """Megatron's padded vocab: the next multiple of divisible_by x TP (so each TP shard of the
    embedding/output layer is equal and aligned)."""
    multiple = max(1, int(make_vocab_size_divisible_by)) * max(1, int(tensor_model_parallel_size))
    return ((int(orig_vocab_size) + multiple - 1) // multiple) * multiple


def _import_tokenizers(kind: str):
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError(f"--tokenizer-type {kind} needs the `tokenizers` package "
                             f"(pip install tokenizers)") from None
    return tokenizers


def _absent(name):
    def get(self):
        raise NotImplementedError(f"{type(self).__name__} has no attribute '{name}'")

    return property(get)


class _Tokenizer:
    """Megatron-core's legacy tokenizer interface (``MegatronLegacyTokenizer``): the same
    ``unique_identifiers`` (part of the datasets' cache hash) and optional attributes that raise
    NotImplementedError, without importing megatron-core (and torch) at start-up."""

    def __init__(self, *paths: str, **options: Any):
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = list(paths)
        for k, v in options.items():
            self.unique_identifiers[k] = str(v)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    def __repr__(self):
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"

    def tokenize(self, text: str) -> List[int]:
        raise NotImplementedError

    def tokenize_batch(self, texts: List[str]) -> List[List[int]]:
        """``tokenize`` of each text (one call into the tokenizer library where it has one)."""
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids):
        raise NotImplementedError(f"{type(self).__name__} has no method 'detokenize'")

    def offsets(self, ids, text):
        raise NotImplementedError(f"{type(self).__name__} has no method 'offsets'")

    cls, sep, eod = _absent("cls"), _absent("sep"), _absent("eod")
    bos, eos, mask = _absent("bos"), _absent("eos"), _absent("mask")

    @property
    def pad(self) -> int:
        return -1


def megatron_core_base() -> type:
    """megatron-core's tokenizer base class, with this module's tokenizers registered as its
    (virtual) subclasses, so ``isinstance(tokenizer, base)`` holds. Imports megatron-core."""
    base = megatron_tokenizer_base()
    if not issubclass(_Tokenizer, base):
        base.register(_Tokenizer)
    return base


def __getattr__(name):  # `tokenizers._TokenizerBase`, resolved on first use (imports megatron-core)
    if name == "_TokenizerBase":
        return megatron_core_base()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _DictVocabTokenizer(_Tokenizer):
    """Tokenizers whose vocabulary is a Python dict: ``_vocab`` (token -> id), ``_inv`` (id ->
    token) and ``_eod`` are set by the subclass."""

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self):
        return self._vocab

    @property
    def inv_vocab(self):
        return self._inv

    @property
    def eod(self) -> int:
        return self._eod


# --------------------------------------------------------------------------------- sentencepiece
class SentencePieceTokenizer(_Tokenizer):
    """A sentencepiece model; missing eos/pad pieces are appended after the model's vocabulary."""

    _add_missing = True

    def __init__(self, model_file: str):
        import sentencepiece

        if not model_file or not os.path.isfile(model_file):
            raise TokenizerError(f"--tokenizer-model: sentencepiece model {model_file!r} not found")
        super().__init__(model_file)
        self._model_file = model_file
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(model_file)
        except (OSError, RuntimeError) as exc:
            raise TokenizerError(f"--tokenizer-model: {model_file} is not a sentencepiece model "
                                 f"({exc})") from None
        n = self._sp.GetPieceSize()
        self._added: "OrderedDict[str, int]" = OrderedDict()
        self._eod = self._sp.eos_id()
        self._pad = self._sp.pad_id()
        self._n_model = n
        self._cls = self._sep = self._mask = None
        if self._add_missing:
            # Megatron's SentencePieceTokenizer: BERT's specials are the model's pieces when it
            # has them, else new ids after its vocabulary (so BERT runs on sentencepiece too)
            self._cls = self._special("<CLS>")
            self._sep = self._special("<SEP>")
            self._mask = self._special("<MASK>")
            if self._eod < 0:
                self._eod = self._special("<EOD>")
            if self._pad < 0:
                self._pad = self._special("<PAD>")

    def _special(self, piece: str) -> int:
        i = self._sp.PieceToId(piece)
        if i != self._sp.unk_id() or piece == self._sp.IdToPiece(i):
            return i
        return self._added.setdefault(piece, self._n_model + len(self._added))

    def __getstate__(self):  # the C++ processor does not pickle; reload from the file instead
        return {"model_file": self._model_file}

    def __setstate__(self, state):
        self.__init__(state["model_file"])

    @property
    def vocab_size(self) -> int:
        return self._n_model + len(self._added)

    @property
    def vocab(self):
        v = {self._sp.IdToPiece(i): i for i in range(self._n_model)}
        v.update(self._added)
        return v

    @property
    def inv_vocab(self):
        return {i: p for p, i in self.vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        return self._sp.EncodeAsIds(text)

    def tokenize_batch(self, texts: List[str]) -> List[List[int]]:
        return self._sp.encode(texts, out_type=int)

    def detokenize(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        return self._sp.DecodeIds([i for i in ids if 0 <= i < self._n_model])

    def offsets(self, ids, text):
        """Character offset where each piece of ``ids`` starts (Megatron's sentencepiece
        tokenizers: sentencepiece's own decoding spans)."""
        proto = self._sp.decode_ids_as_proto([int(i) for i in ids])
        return [p.begin for p in proto.pieces]

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        return self._pad

    def _bert_special(self, name):
        value = getattr(self, "_" + name)
        if value is None:
            raise AttributeError(f"{type(self).__name__} has no {name} token "
                                      f"(use SentencePieceTokenizer)")
        return value

    cls = property(lambda self: self._bert_special("cls"))
    sep = property(lambda self: self._bert_special("sep"))
    mask = property(lambda self: self._bert_special("mask"))


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron's GPT variant: the model's own eos/pad only (pad -1 if the model has none)."""

    _add_missing = False

    def __init__(self, model_file: str):
        super().__init__(model_file)
        if self._eod < 0:
            raise TokenizerError(f"--tokenizer-model: {model_file} has no eos piece, which "
                                 f"{type(self).__name__} uses as end-of-document; use "
                                 f"SentencePieceTokenizer (adds one)")


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's ``_Llama2Tokenizer`` (its legacy tokenizer system; the default system has no
    Llama2 class and builds its plain sentencepiece wrapper = GPTSentencePieceTokenizer here):
    the model's pieces only, eod = eos, pad = the model's pad id (-1 without one), and each
    ``tokenize`` call (one document, or one sentence under --split-sentences) starts with bos,
    as ``_Llama2Tokenizer.tokenize(s, bos=True, eos=False)``."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        if self._sp.bos_id() < 0:
            raise TokenizerError(f"--tokenizer-model: {model_file} has no bos piece, which "
                                 f"Llama2Tokenizer puts before every text")

    def tokenize(self, text: str) -> List[int]:
        return [self._sp.bos_id()] + self._sp.EncodeAsIds(text)

    def tokenize_batch(self, texts: List[str]) -> List[List[int]]:
        bos = self._sp.bos_id()
        return [[bos] + ids for ids in self._sp.encode(texts, out_type=int)]


# ----------------------------------------------------------------------------- GPT-2 byte BPE
@lru_cache(maxsize=None)
def bytes_to_unicode():
    """GPT-2's reversible map from the 256 byte values to printable unicode characters (the
    symbols of vocab.json); the ``tokenizers`` ByteLevel pre-tokenizer uses the same map."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# OpenAI's GPT-2 pre-tokenizer (encoder.py), as Megatron's gpt2_tokenization.py compiles it
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class GPT2BPETokenizer(_DictVocabTokenizer):
    """GPT-2's byte-level BPE (vocab.json + merges.txt); the merges run in ``tokenizers``' BPE
    model (Rust), ranked as Megatron's ``gpt2_tokenization.py`` ranks them.

    Pre-tokenization is OpenAI's regex run by the ``regex`` package, as in Megatron, with the
    ids of each piece cached (bounded): that is ~2x faster than ``tokenizers``' own ByteLevel
    pre-tokenizer (Oniguruma), which matches it on every character assigned in this Python's
    Unicode data and is used when ``regex`` is not installed. The files are read as Megatron
    reads them: the merges file's first line (``#version``) and whatever follows its last
    newline are skipped."""

    _CACHE_ENTRIES = 200_000  # pieces; bounded so that memory stays flat on any corpus

    def __init__(self, vocab_file: str, merge_file: str):
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise TokenizerError(f"{flag}: {path!r} not found (GPT2BPETokenizer needs "
                                     f"--vocab-file vocab.json and --merge-file merges.txt)")
        tk = _import_tokenizers("GPT2BPETokenizer")
        super().__init__(vocab_file, merge_file)
        try:
            with open(vocab_file, encoding="utf-8") as f:
                self.encoder = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"--vocab-file: {vocab_file} is not JSON ({exc})") from None
        missing = [s for s in bytes_to_unicode().values() if s not in self.encoder]
        if missing:
            raise TokenizerError(f"--vocab-file: {vocab_file} lacks {len(missing)} of the 256 "
                                 f"byte symbols (e.g. {missing[0]!r})")
        if "<|endoftext|>" not in self.encoder:
            raise TokenizerError(f"--vocab-file: {vocab_file} has no '<|endoftext|>' token "
                                 f"(GPT-2's end-of-document)")
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")[1:-1]
        merges = []
        for lineno, line in enumerate(lines, 2):
            pair = tuple(line.split())
            if len(pair) != 2:  # Megatron ranks it too, but a non-pair never matches: skip
                continue
            if pair[0] + pair[1] not in self.encoder:
                raise TokenizerError(f"--merge-file: {merge_file}:{lineno}: the merge result "
                                     f"{pair[0] + pair[1]!r} is not in --vocab-file")
            merges.append(pair)
        self.decoder = {v: k for k, v in self.encoder.items()}
        self._vocab, self._inv = self.encoder, self.decoder  # Megatron's names kept as aliases
        self._eod = self.encoder["<|endoftext|>"]
        self._paths = (vocab_file, merge_file)
        self._tok = tk.Tokenizer(tk.models.BPE(self.encoder, merges))
        self._tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                              use_regex=True)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        try:
            import regex
        except ImportError:
            self._pattern = None
        else:
            self._pattern = regex.compile(GPT2_PATTERN)
        self._cache = {}

    def __getstate__(self):  # the Rust tokenizer is rebuilt from the files
        return {"paths": self._paths}

    def __setstate__(self, state):
        self.__init__(*state["paths"])

    def _piece_ids(self, piece: str) -> List[int]:
        mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
        ids = [t.id for t in self._tok.model.tokenize(mapped)]
        if len(self._cache) < self._CACHE_ENTRIES:
            self._cache[piece] = ids
        return ids

    def tokenize(self, text: str) -> List[int]:
        if self._pattern is None:
            return self._tok.encode(text, add_special_tokens=False).ids
        ids, cache = [], self._cache
        for piece in self._pattern.findall(text):
            hit = cache.get(piece)
            ids += hit if hit is not None else self._piece_ids(piece)
        return ids

    def tokenize_batch(self, texts: List[str]) -> List[List[int]]:
        if self._pattern is None:
            return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------ BERT WordPiece
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
               (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


@lru_cache(maxsize=None)
def _bert_tables():
    """``str.translate`` tables for BERT's basic tokenizer, from this Python's unicodedata (what
    Megatron's bert_tokenization.py consults), so the per-character rules run in C:

    clean: NUL, U+FFFD and Cc/Cf controls (but tab, newline, CR) removed; tab/newline/CR and
        Zs spaces -> " "; CJK ideographs -> " c " (the next step in BERT, and disjoint);
    punct: ASCII non-alphanumerics and P* -> " p ";  accents: Mn marks removed (after NFD).

    ``tokenizers``' BertNormalizer/BertPreTokenizer are not used for these steps because they
    differ from BERT's: they also drop Co/Cn characters, lower-case without Python's final-sigma
    rule, and miss the CJK block U+2B820-U+2B91F.
    """
    clean = {0: None, 0xFFFD: None}
    punct, accents = {}, {}
    # planes 4-13 hold no characters in any Unicode version (roadmap: unassigned) and 15-16 are
    # private use (Co): scanning only planes 0-3 and 14 makes this ~3x cheaper
    for cp in itertools.chain(range(0x40000), range(0xE0000, 0xF0000)):
        cat = unicodedata.category(chr(cp))
        if cat in ("Cc", "Cf"):
            clean[cp] = None
        elif cat == "Zs":
            clean[cp] = " "
        elif cat == "Mn":
            accents[cp] = None
        elif cat[0] == "P":
            punct[cp] = f" {chr(cp)} "
    for ch in "\t\n\r":
        clean[ord(ch)] = " "
    for lo, hi in _CJK_RANGES:
        for cp in range(lo, hi + 1):
            clean[cp] = f" {chr(cp)} "
    for lo, hi in ((33, 47), (58, 64), (91, 96), (123, 126)):
        for cp in range(lo, hi + 1):
            punct[cp] = f" {chr(cp)} "
    return clean, punct, {**punct, **accents}


def load_bert_vocab(vocab_file: str) -> "OrderedDict[str, int]":
    """BERT's load_vocab: token = stripped line, id = line number (a repeated token keeps its
    last line)."""
    vocab = OrderedDict()
    with open(vocab_file, encoding="utf-8") as f:
        for index, line in enumerate(f):
            vocab[line.strip()] = index
    return vocab


class BertWordPieceTokenizer(_DictVocabTokenizer):
    """Google BERT's FullTokenizer over a vocab.txt, as Megatron's bert_tokenization.py: basic
    tokenization (clean, CJK, lower-case + NFD accent stripping when ``lower_case``, punctuation
    split) with ``str.translate`` tables, then greedy longest-match WordPiece (``##``
    continuations, words over 200 characters -> [UNK]) on ``tokenizers``' WordPiece model."""

    def __init__(self, vocab_file: str, lower_case: bool = True):
        if not vocab_file or not os.path.isfile(vocab_file):
            raise TokenizerError(f"--vocab-file: {vocab_file!r} not found (BERT WordPiece "
                                 f"tokenizers need a vocab.txt, one token per line)")
        tk = _import_tokenizers("BertWordPiece")
        super().__init__(vocab_file, lower_case=lower_case)
        self.lower_case = lower_case
        self._vocab_file = vocab_file
        self._vocab = load_bert_vocab(vocab_file)
        self._inv = {i: t for t, i in self._vocab.items()}
        missing = [t for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]")
                   if t not in self._vocab]
        if missing:
            raise TokenizerError(f"--vocab-file: {vocab_file} lacks {', '.join(missing)}")
        self._tok = tk.Tokenizer(tk.models.WordPiece(
            dict(self._vocab), unk_token="[UNK]", continuing_subword_prefix="##",
            max_input_chars_per_word=200))
        # what remains after basic() is words separated by spaces (or U+2028/U+2029, which
        # BERT's str.split() also splits on)
        self._tok.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()

    def __getstate__(self):
        return {"vocab_file": self._vocab_file, "lower_case": self.lower_case}

    def __setstate__(self, state):
        self.__init__(state["vocab_file"], state["lower_case"])

    def basic(self, text: str) -> str:
        """BERT's basic tokenizer; its words joined by spaces."""
        clean, punct, punct_accents = _bert_tables()
        text = text.translate(clean)
        if not self.lower_case:
            return text.translate(punct)
        # lower-casing the whole text equals BERT's per-word lower(): words are bounded by
        # whitespace, which is neither cased nor case-ignorable (the final-sigma context)
        text = unicodedata.normalize("NFD", text.lower())
        return text.translate(punct_accents)

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(self.basic(text), add_special_tokens=False).ids

    def tokenize_batch(self, texts: List[str]) -> List[List[int]]:
        encs = self._tok.encode_batch([self.basic(t) for t in texts], add_special_tokens=False)
        return [e.ids for e in encs]

    def detokenize(self, ids: Iterable[int]) -> str:
        """Megatron's convert_tokens_to_string: join, glue ``##`` pieces, tidy punctuation."""
        text = " ".join(self._inv[int(i)] for i in ids).replace(" ##", "").strip()
        for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                     (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                     (" 're", "'re")):
            text = text.replace(a, b)
        return text

    @property
    def cls(self) -> int:
        return self._vocab["[CLS]"]

    @property
    def sep(self) -> int:
        return self._vocab["[SEP]"]

    @property
    def pad(self) -> int:
        return self._vocab["[PAD]"]

    @property
    def mask(self) -> int:
        return self._vocab["[MASK]"]

    @property
    def eod(self) -> int:
        return self._vocab["[SEP]"]


# ------------------------------------------------------------------------------- HuggingFace
def _token_name(value):
    """A special token in tokenizer_config.json: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


class HuggingFaceTokenizer(_DictVocabTokenizer):
    """A local Hugging Face tokenizer directory, Megatron's ``_HuggingFaceTokenizer`` interface.

    With DIR/tokenizer.json (every fast tokenizer saves one) it runs on ``tokenizers`` directly;
    eos/bos/pad are the names in DIR/tokenizer_config.json or DIR/special_tokens_map.json, as
    AutoTokenizer reads them. Otherwise ``transformers.AutoTokenizer`` (local files only).
    ``vocab_size`` counts added tokens (``len(tokenizer)``); text is encoded without adding
    special tokens (megatron-core's HuggingFaceTokenizer default) unless
    ``include_special_tokens`` (``--tokenizer-hf-include-special-tokens``: the tokenizer's
    post-processor adds them, e.g. a BOS per document)."""

    def __init__(self, path: str, include_special_tokens: bool = False,
                 trust_remote_code: bool = False):
        # trust_remote_code (--trust-remote-code): AutoTokenizer may run the directory's own
        # tokenizer code (Kimi-K2's), as Megatron passes it; a tokenizer.json never needs it
        if not path or not os.path.exists(path):
            raise TokenizerError(f"--tokenizer-model: HuggingFace tokenizer directory {path!r} "
                                 f"not found (only local paths are supported)")
        super().__init__(path, **({"include_special_tokens": True} if include_special_tokens
                                  else {}))
        self._path = path
        self._special = bool(include_special_tokens)
        self._hf = self._fast = None
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if os.path.isfile(file):
            tk = _import_tokenizers("HuggingFaceTokenizer")
            try:
                self._fast = tk.Tokenizer.from_file(file)
            except Exception as exc:  # the Rust error (a JSON/format problem) names no file
                raise TokenizerError(f"--tokenizer-model: {file} is not a tokenizers "
                                     f"tokenizer.json ({exc})") from None
            self._vocab = self._fast.get_vocab(with_added_tokens=True)
            self._size = self._fast.get_vocab_size(with_added_tokens=True)
            names = {}
            for cfg_name in ("special_tokens_map.json", "tokenizer_config.json"):  # later wins
                cfg_file = os.path.join(directory, cfg_name)
                if os.path.isfile(cfg_file):
                    with open(cfg_file, encoding="utf-8") as f:
                        cfg = json.load(f)
                    names.update({k: _token_name(cfg[k]) for k in ("eos_token", "bos_token",
                                                                   "pad_token") if cfg.get(k)})
            self._eos, self._bos, self._pad = (
                self._fast.token_to_id(names[k]) if k in names else None
                for k in ("eos_token", "bos_token", "pad_token"))
        else:
            try:
                import transformers
            except ImportError:
                raise TokenizerError(
                    f"--tokenizer-model: {file} not found; a directory without tokenizer.json "
                    f"needs the `transformers` package (pip install transformers)") from None
            self._hf = transformers.AutoTokenizer.from_pretrained(
                path, local_files_only=True, trust_remote_code=trust_remote_code)
            self._vocab = self._hf.get_vocab()
            self._size = len(self._hf)
            self._eos, self._bos = self._hf.eos_token_id, self._hf.bos_token_id
            self._pad = self._hf.pad_token_id
        self._inv = {i: t for t, i in self._vocab.items()}

    def __getstate__(self):
        return {"path": self._path, "include_special_tokens": self._special}

    def __setstate__(self, state):
        self.__init__(state["path"], state["include_special_tokens"])

    @property
    def vocab_size(self) -> int:
        return self._size

    def tokenize(self, text: str) -> List[int]:
        if self._hf is not None:
            return self._hf.encode(text, add_special_tokens=self._special)
        return self._fast.encode(text, add_special_tokens=self._special).ids

    def tokenize_batch(self, texts: List[str]) -> List[List[int]]:
        if self._hf is not None:
            return [self.tokenize(t) for t in texts]
        return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=self._special)]

    def detokenize(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        return self._hf.decode(ids) if self._hf is not None else self._fast.decode(ids)

    @property
    def decoder(self):
        return self._inv

    def offsets(self, ids: List[int], text: str) -> List[int]:
        """Character offset where each of ``ids`` (``tokenize(text)``) starts, as Megatron's
        ``_HuggingFaceTokenizer.offsets`` (a token without a span starts where the last ended)."""
        if self._hf is not None:
            spans = self._hf(text, add_special_tokens=self._special,
                             return_offsets_mapping=True)
            spans = spans["offset_mapping"]
        else:
            spans = self._fast.encode(text, add_special_tokens=self._special).offsets
        out, next_start = [], 0
        for i in range(len(ids)):
            span = spans[i] if i < len(spans) else None
            if span is not None and span[1] > span[0]:
                out.append(span[0])
                next_start = span[1]
            else:
                out.append(next_start)
        return out

    @property
    def eod(self) -> int:
        if self._eos is None:
            raise TokenizerError(f"--tokenizer-model: {self._path} defines no eos_token (its "
                                 f"end-of-document; set it in tokenizer_config.json)")
        return self._eos

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def bos(self):
        return self._bos

    @property
    def pad(self) -> int:
        return -1 if self._pad is None else self._pad


# ----------------------------------------------------------------------------------- tiktoken
# Megatron's pre-tokenizer patterns (--tiktoken-pattern v1 / v2), as its tokenizer modules define
# them (the default system's default is v2).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# the special tokens of Megatron's default tokenizer system (its legacy class needs only the first
# three); a custom --tokenizer-special-tokens list must contain them all
TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
TIKTOKEN_DEFAULT_VOCAB = 2 ** 17


def load_tiktoken_ranks(path: str, max_vocab: int) -> "dict[bytes, int]":
    """Megatron's tiktoken vocabulary file: a JSON list whose i-th entry is
    ``{"rank": i, "token_bytes": base64, "token_str": str}``, the first 256 being the single bytes
    0..255 in order. Returns token bytes -> rank of the first ``max_vocab`` entries. Megatron
    asserts these properties; here a violation names the file and the entry."""
    import base64

    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"--tokenizer-model: {path} is not a tiktoken JSON vocabulary "
                             f"({exc})") from None
    if not isinstance(entries, list):
        raise TokenizerError(f"--tokenizer-model: {path}: expected a JSON list of "
                             f"{{rank, token_bytes, token_str}} entries")
    ranks = {}
    for i, entry in enumerate(entries[:max_vocab]):
        if not isinstance(entry, dict) or entry.keys() != {"rank", "token_bytes", "token_str"} \
                or entry["rank"] != i:
            raise TokenizerError(f"--tokenizer-model: {path}: entry {i} is not "
                                 f"{{\"rank\": {i}, \"token_bytes\": ..., \"token_str\": ...}}")
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise TokenizerError(f"--tokenizer-model: {path}: entry {i} must be the single "
                                 f"byte {i} (the first 256 ranks are the bytes)")
        if token in ranks:
            raise TokenizerError(f"--tokenizer-model: {path}: entry {i} repeats the token of "
                                 f"entry {ranks[token]}")
        ranks[token] = i
    return ranks


class TikTokenizer(_DictVocabTokenizer):
    """Megatron's TikTokenizer on the ``tiktoken`` library, with the default tokenizer system's
    conventions (Megatron-LM 0.16, ``megatron.core.tokenizers`` TikTokenTokenizer):

    * ids 0..K-1 (K = --tiktoken-num-special-tokens, default 1000) are the special tokens:
      --tokenizer-special-tokens (default ``<unk> <s> </s> <mask> <pad> <cls> <sep>``, which a
      custom list must contain) then fillers ``<SPECIAL_i>`` up to K; the file's rank r is id
      r + K; the file is cut to --vocab-size - K entries (default vocab 2**17 = 131072);
    * ``tokenize`` recognises special-token strings in the text (tiktoken's
      ``allowed_special="all"``), as the default system's ``text_to_ids``;
    * eod = eos = ``</s>``, bos = ``<s>``, pad = ``<pad>``, unk/mask/cls/sep likewise.

    Megatron's legacy class (``--legacy-tokenizer``) differs in two places only: its default
    list is ``<unk> <s> </s>`` (so the ids of ordinary text and of unk/bos/eos are the same) and
    it encodes special-token strings as ordinary text. ``detokenize`` decodes the bytes of all
    ids at once (the legacy class's; the default system decodes each token on its own, which
    breaks characters split across tokens)."""

    def __init__(self, path: str, pattern: Optional[str] = None, vocab_size: Optional[int] = None,
                 num_special_tokens: int = 1000, special_tokens: Optional[List[str]] = None):
        if not path or not os.path.isfile(path):
            raise TokenizerError(f"--tokenizer-model: tiktoken vocabulary {path!r} not found "
                                 f"(TikTokenizer needs Megatron's JSON vocabulary file)")
        pattern = pattern or "v2"
        if pattern not in TIKTOKEN_PATTERNS:
            raise TokenizerError(f"--tiktoken-pattern: {pattern!r} (choose v1 or v2)")
        vocab_size = int(vocab_size or TIKTOKEN_DEFAULT_VOCAB)
        num_special_tokens = int(num_special_tokens)
        special = list(special_tokens) if special_tokens else list(TIKTOKEN_SPECIAL_TOKENS)
        if len(set(special)) != len(special):
            raise TokenizerError(f"--tokenizer-special-tokens: repeated tokens in {special}")
        lacking = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in special]
        if lacking:
            raise TokenizerError(f"--tokenizer-special-tokens must include "
                                 f"{' '.join(TIKTOKEN_SPECIAL_TOKENS)} (lacks {' '.join(lacking)})")
        if not len(special) <= num_special_tokens < vocab_size:
            raise TokenizerError(f"--tiktoken-num-special-tokens {num_special_tokens} must be at "
                                 f"least the {len(special)} special tokens and below --vocab-size "
                                 f"{vocab_size}")
        try:
            import tiktoken
        except ImportError:
            raise TokenizerError("--tokenizer-type TikTokenizer needs the `tiktoken` package "
                                 "(pip install tiktoken)") from None
        super().__init__(path, pattern=TIKTOKEN_PATTERNS[pattern], vocab_size=vocab_size,
                         num_special_tokens=num_special_tokens, special_tokens=special_tokens)
        self._args = (path, pattern, vocab_size, num_special_tokens, special_tokens)
        special += [f"<SPECIAL_{i}>" for i in range(len(special), num_special_tokens)]
        if len(set(special)) != len(special):
            raise TokenizerError(f"--tokenizer-special-tokens: a token repeats one of the fillers "
                                 f"<SPECIAL_{len(special_tokens or ())}>..<SPECIAL_"
                                 f"{num_special_tokens - 1}>")
        inner = vocab_size - num_special_tokens
        ranks = load_tiktoken_ranks(path, inner)
        if len(ranks) < inner:
            raise TokenizerError(f"--vocab-size {vocab_size}: {path} has {len(ranks)} tokens, "
                                 f"fewer than --vocab-size minus --tiktoken-num-special-tokens "
                                 f"({inner})")
        shifted = {t: r + num_special_tokens for t, r in ranks.items()}
        self._special = {t: i for i, t in enumerate(special)}
        self._eod = self._special["</s>"]
        self._model = tiktoken.Encoding(name=os.path.basename(os.path.dirname(
            os.path.abspath(path))), pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks=shifted, special_tokens=self._special)
        # str keys for the specials, bytes for the BPE tokens: vocab_size entries, ids 0..N-1
        self._vocab = dict(shifted)
        self._vocab.update(self._special)
        self._inv = {i: t for t, i in self._vocab.items()}

    def __getstate__(self):  # tiktoken's Rust core is rebuilt from the file
        return {"args": self._args}

    def __setstate__(self, state):
        self.__init__(*state["args"])

    encoder, decoder = _DictVocabTokenizer.vocab, _DictVocabTokenizer.inv_vocab

    def tokenize(self, text: str) -> List[int]:
        return self._model.encode(text, allowed_special="all")

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._model.decode([int(i) for i in ids])

    def offsets(self, ids, text):
        """Character offset where each of ``ids`` starts. tiktoken's decode_with_offsets refuses
        byte sequences that are not UTF-8; then count characters from the bytes directly (a
        token that starts inside a character starts at that character)."""
        ids = [int(i) for i in ids]
        try:
            return self._model.decode_with_offsets(ids)[1]
        except UnicodeDecodeError:
            out, chars = [], 0
            for token in self._model.decode_tokens_bytes(ids):
                continuation = [0x80 <= b < 0xC0 for b in token]
                out.append(max(0, chars - int(bool(token) and continuation[0])))
                chars += continuation.count(False)
            return out

    def _id(self, name):
        return self._special[name]

    eos = property(lambda self: self._id("</s>"))
    bos = property(lambda self: self._id("<s>"))
    pad = property(lambda self: self._id("<pad>"))
    unk = property(lambda self: self._id("<unk>"))
    mask = property(lambda self: self._id("<mask>"))
    cls = property(lambda self: self._id("<cls>"))
    sep = property(lambda self: self._id("<sep>"))


# ------------------------------------------------------------------------------------- Null
class NullTokenizer(_Tokenizer):
    """Text is space-separated integer ids (Megatron's NullTokenizer); eod = vocab_size - 1."""

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) <= 0:
            raise TokenizerError("--vocab-size: NullTokenizer needs a positive --vocab-size")
        super().__init__(vocab_size=vocab_size)
        self._n = int(vocab_size)

    def tokenize(self, text: str) -> List[int]:
        try:
            return [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer: text must be space-separated integers, got "
                             f"{text[:40]!r}") from None

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    @property
    def vocab(self):
        raise NotImplementedError("NullTokenizer has no vocab")

    @property
    def inv_vocab(self):
        raise NotImplementedError("NullTokenizer has no inv_vocab")

    @property
    def eod(self) -> int:
        return self._n


# ------------------------------------------------------------------------------------ build
_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size",
           "tokenizer_hf_include_special_tokens", "tiktoken_pattern",
           "tiktoken_num_special_tokens", "tokenizer_special_tokens", "tiktoken_special_tokens",
           "trust_remote_code")


def build_tokenizer(args_or_kwargs: Any = None, **kwargs: Any) -> _Tokenizer:
    """Megatron's ``build_tokenizer``: the tokenizer named by ``tokenizer_type``.

    Accepts an argparse namespace, a dict, or keyword arguments (``tokenizer_type`` defaults to
    SentencePieceTokenizer). Raises TokenizerError (a ValueError) naming the flag on bad input.
    """
    if args_or_kwargs is None:
        opts = {}
    elif isinstance(args_or_kwargs, dict):
        opts = dict(args_or_kwargs)
    else:
        opts = {f: getattr(args_or_kwargs, f) for f in _FIELDS if hasattr(args_or_kwargs, f)}
    opts.update(kwargs)
    if "megatron.core" in sys.modules:  # in use: make isinstance(tok, its base) hold
        megatron_core_base()
    kind = opts.get("tokenizer_type") or "SentencePieceTokenizer"
    model, vocab = opts.get("tokenizer_model"), opts.get("vocab_file")
    if opts.get("tokenizer_hf_include_special_tokens") and kind != "HuggingFaceTokenizer":
        raise TokenizerError(f"--tokenizer-hf-include-special-tokens applies to "
                             f"HuggingFaceTokenizer only (got --tokenizer-type {kind})")
    special = opts.get("tokenizer_special_tokens") or opts.get("tiktoken_special_tokens")
    if special and kind != "TikTokenizer":  # Megatron's SP/HF uses of the list are not built here
        raise TokenizerError(f"--tokenizer-special-tokens applies to TikTokenizer only (got "
                             f"--tokenizer-type {kind})")
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(model)
    if kind == "Llama2Tokenizer":
        return Llama2Tokenizer(model)
    if kind == "TikTokenizer":
        return TikTokenizer(model, opts.get("tiktoken_pattern"), opts.get("vocab_size"),
                            opts.get("tiktoken_num_special_tokens") or 1000, special)
    if kind == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(model)
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab, opts.get("merge_file"))
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(model, bool(opts.get("tokenizer_hf_include_special_tokens")),
                                    trust_remote_code=bool(opts.get("trust_remote_code")))
    if kind == "BertWordPieceLowerCase":
        return BertWordPieceTokenizer(vocab, lower_case=True)
    if kind == "BertWordPieceCase":
        return BertWordPieceTokenizer(vocab, lower_case=False)
    if kind == "NullTokenizer":
        return NullTokenizer(opts.get("vocab_size"))
    raise TokenizerError(f"--tokenizer-type: unsupported {kind!r} (choose from "
                         f"{', '.join(TOKENIZER_TYPES)})")


def add_tokenizer_args(parser, default_type: Optional[str] = "SentencePieceTokenizer"):
    """Megatron's tokenizer flags, for tools."""
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default=default_type, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece .model, or a HuggingFace tokenizer directory")
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json or BERT vocab.txt")
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer vocab size; TikTokenizer's (default 131072)")
    g.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                   help="HuggingFaceTokenizer: add the tokenizer's special tokens (its "
                        "post-processor, e.g. BOS) to each text")
    add_tiktoken_args(g)
    return parser


def add_tiktoken_args(group):
    """Megatron's TikTokenizer flags (tools and training share them)."""
    group.add_argument("--tiktoken-pattern", default=None, choices=sorted(TIKTOKEN_PATTERNS),
                       help="TikTokenizer's pre-tokenizer pattern (default v2)")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="TikTokenizer: ids 0..N-1 are special tokens")
    group.add_argument("--tokenizer-special-tokens", nargs="+", default=None,
                       help="TikTokenizer's special tokens (must include "
                            f"{' '.join(TIKTOKEN_SPECIAL_TOKENS)})")
    group.add_argument("--tiktoken-special-tokens", nargs="+", default=None,
                       help="Deprecated name of --tokenizer-special-tokens (Megatron's)")
