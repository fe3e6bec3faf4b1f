"""Megatron-LM's tokenizers, by ``--tokenizer-type``, as megatron-core tokenizer objects.

``build_tokenizer(args)`` takes an argparse namespace, a dict or keyword arguments with Megatron's
field names (``tokenizer_type``, ``tokenizer_model``, ``vocab_file``, ``merge_file``,
``vocab_size``) and returns a subclass of megatron-core's legacy tokenizer base
(``MegatronLegacyTokenizer`` in 0.16; ``MegatronTokenizer`` in older releases), which is what
``GPTDataset``/``BERTMaskedWordPieceDataset`` consume: ``vocab_size``, ``eod``, ``pad``,
``unique_identifiers``, ``tokenize(text) -> list[int]``, ``detokenize(ids) -> str``.

Types:
  SentencePieceTokenizer (default)  --tokenizer-model m.model. eod = the model's eos id (``</s>``),
      pad = the model's pad id; for BERT also cls/sep/mask (``<CLS>``, ``<SEP>``, ``<MASK>``).
      Pieces the model lacks (those three, and ``<EOD>``/``<PAD>`` without eos/pad) are added
      after its vocabulary, as Megatron does, which grows ``vocab_size`` by up to 5.
  GPTSentencePieceTokenizer         --tokenizer-model; Megatron's variant: nothing is added,
      eod = eos id, pad = the model's pad id (-1 when the model has none).
  GPT2BPETokenizer                  --vocab-file vocab.json --merge-file merges.txt (byte-level BPE,
      GPT-2's algorithm; eod = ``<|endoftext|>``; no pad token: pad = -1).
  HuggingFaceTokenizer              --tokenizer-model DIR (a local directory), via ``transformers``
      or, without it, ``tokenizers`` and DIR/tokenizer.json.
  BertWordPieceLowerCase / BertWordPieceCase   --vocab-file vocab.txt (Google BERT's WordPiece;
      cls/sep/mask/pad from the vocab, eod = [SEP]).
  NullTokenizer                     --vocab-size N: text is space-separated ids; eod = N,
      vocab_size = N + 1 (Megatron's convention).

A pad of -1 means "no pad token": megatron-core's datasets then pad with their own id and
``tokens == pad`` never matches a real token.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from collections import OrderedDict
from functools import lru_cache
from typing import Any, Iterable, List, Optional

from megatron_moe.compat import megatron_tokenizer_base

_TokenizerBase = megatron_tokenizer_base()  # megatron-core's legacy base moved in 0.17: compat/tokenizer.py

TOKENIZER_TYPES = (
    "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "GPT2BPETokenizer",
    "HuggingFaceTokenizer", "BertWordPieceLowerCase", "BertWordPieceCase", "NullTokenizer",
)


class TokenizerError(ValueError):
    """Bad tokenizer settings or files; the message names the flag."""


def vocab_size_with_padding(orig_vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1) -> int:
    """Megatron's padded vocab: the next multiple of divisible_by x TP (so each TP shard of the
    embedding/output layer is equal and aligned)."""
    multiple = max(1, int(make_vocab_size_divisible_by)) * max(1, int(tensor_model_parallel_size))
    return ((int(orig_vocab_size) + multiple - 1) // multiple) * multiple


class _Tokenizer(_TokenizerBase):
    """Common base. Sets megatron-core's ``unique_identifiers`` itself instead of calling the
    legacy base ``__init__`` (identical fields) because that one logs a deprecation warning on
    every construction, i.e. in every preprocessing worker."""

    def __init__(self, *paths: str, **options: Any):
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = list(paths)
        for k, v in options.items():
            self.unique_identifiers[k] = str(v)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    def __repr__(self):
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"

    @property
    def pad(self) -> int:
        return -1


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

    def detokenize(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        return self._sp.DecodeIds([i for i in ids if 0 <= i < self._n_model])

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
                                 f"GPTSentencePieceTokenizer uses as end-of-document; use "
                                 f"SentencePieceTokenizer (adds one)")


# ----------------------------------------------------------------------------- GPT-2 byte BPE
try:  # GPT-2's exact pre-tokenizer needs Unicode classes; `re` approximates them (see below)
    import regex as _regex

    _GPT2_PATTERN = _regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
except ImportError:
    # Without the `regex` package: \p{L} ~ [^\W\d_] and \p{N} ~ \d. Identical for letters,
    # decimal digits, punctuation and whitespace; only non-decimal numerals (e.g. '½', 'Ⅻ') are
    # grouped with letters instead of numbers.
    _GPT2_PATTERN = re.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


@lru_cache(maxsize=None)
def bytes_to_unicode():
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
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


class GPT2BPETokenizer(_DictVocabTokenizer):
    """Byte-level BPE with GPT-2's vocab.json/merges.txt and merge algorithm."""

    def __init__(self, vocab_file: str, merge_file: str):
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise TokenizerError(f"{flag}: {path!r} not found (GPT2BPETokenizer needs "
                                     f"--vocab-file vocab.json and --merge-file merges.txt)")
        super().__init__(vocab_file, merge_file)
        try:
            with open(vocab_file, encoding="utf-8") as f:
                self.encoder = json.load(f)
        except json.JSONDecodeError as exc:
            raise TokenizerError(f"--vocab-file: {vocab_file} is not JSON ({exc})") from None
        self.decoder = {v: k for k, v in self.encoder.items()}
        self._vocab, self._inv = self.encoder, self.decoder  # Megatron's names kept as aliases
        merges = []
        with open(merge_file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line or (lineno == 1 and line.startswith("#version")):
                    continue
                parts = line.split()
                if len(parts) != 2:
                    raise TokenizerError(f"--merge-file: {merge_file}:{lineno}: expected two "
                                         f"symbols, got {line!r}")
                merges.append(tuple(parts))
        self.bpe_ranks = {m: i for i, m in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self._cache = {}
        if "<|endoftext|>" not in self.encoder:
            raise TokenizerError(f"--vocab-file: {vocab_file} has no '<|endoftext|>' token "
                                 f"(GPT-2's end-of-document)")
        self._eod = self.encoder["<|endoftext|>"]

    def _bpe(self, token: str) -> List[str]:
        cached = self._cache.get(token)
        if cached is not None:
            return cached
        word = list(token)
        while len(word) > 1:
            # merge the lowest-ranked adjacent pair everywhere it occurs, as GPT-2 does
            best, best_rank = None, None
            for pair in zip(word, word[1:]):
                r = self.bpe_ranks.get(pair)
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = pair, r
            if best is None:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == best[0] and word[i + 1] == best[1]:
                    merged.append(best[0] + best[1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        if len(self._cache) < 100_000:
            self._cache[token] = word
        return word

    def tokenize(self, text: str) -> List[int]:
        ids = []
        for piece in _GPT2_PATTERN.findall(text):
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            for sym in self._bpe(mapped):
                try:
                    ids.append(self.encoder[sym])
                except KeyError:
                    raise ValueError(f"GPT2BPETokenizer: symbol {sym!r} is not in the vocab "
                                     f"(vocab.json must contain all 256 byte symbols)") from None
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")



# ------------------------------------------------------------------------------ BERT WordPiece
def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


class BertWordPieceTokenizer(_DictVocabTokenizer):
    """Google BERT's basic (whitespace/punctuation/CJK, optional lower-casing and accent
    stripping) + greedy longest-match WordPiece tokenizer over a vocab.txt."""

    def __init__(self, vocab_file: str, lower_case: bool = True):
        if not vocab_file or not os.path.isfile(vocab_file):
            raise TokenizerError(f"--vocab-file: {vocab_file!r} not found (BERT WordPiece "
                                 f"tokenizers need a vocab.txt, one token per line)")
        super().__init__(vocab_file, lower_case=lower_case)
        self.lower_case = lower_case
        self._vocab = OrderedDict()
        with open(vocab_file, encoding="utf-8") as f:
            for line in f:
                tok = line.rstrip("\n").strip()
                if tok and tok not in self._vocab:
                    self._vocab[tok] = len(self._vocab)
        self._inv = {i: t for t, i in self._vocab.items()}
        missing = [t for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]")
                   if t not in self._vocab]
        if missing:
            raise TokenizerError(f"--vocab-file: {vocab_file} lacks {', '.join(missing)}")

    def _basic(self, text: str) -> List[str]:
        out = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD or (unicodedata.category(ch).startswith("C")
                                           and ch not in "\t\n\r"):
                continue
            if _is_cjk(cp):
                out.append(f" {ch} ")
            elif ch.isspace():
                out.append(" ")
            else:
                out.append(ch)
        tokens = []
        for word in "".join(out).split():
            if self.lower_case:
                word = unicodedata.normalize("NFD", word.lower())
                word = "".join(c for c in word if unicodedata.category(c) != "Mn")
            cur = ""
            for ch in word:
                if _is_punctuation(ch):
                    if cur:
                        tokens.append(cur)
                    tokens.append(ch)
                    cur = ""
                else:
                    cur += ch
            if cur:
                tokens.append(cur)
        return tokens

    def _wordpiece(self, word: str) -> List[int]:
        if len(word) > 100:
            return [self._vocab["[UNK]"]]
        ids, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                sub = word[start:end] if start == 0 else "##" + word[start:end]
                if sub in self._vocab:
                    ids.append(self._vocab[sub])
                    break
                end -= 1
            if end == start:
                return [self._vocab["[UNK]"]]
            start = end
        return ids

    def tokenize(self, text: str) -> List[int]:
        ids = []
        for word in self._basic(text):
            ids.extend(self._wordpiece(word))
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        text = " ".join(self._inv[int(i)] for i in ids)
        return text.replace(" ##", "").replace("##", "")


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
class HuggingFaceTokenizer(_DictVocabTokenizer):
    """A local HuggingFace tokenizer directory (``transformers`` or ``tokenizers``)."""

    def __init__(self, path: str):
        if not path or not os.path.exists(path):
            raise TokenizerError(f"--tokenizer-model: HuggingFace tokenizer directory {path!r} "
                                 f"not found (only local paths are supported)")
        super().__init__(path)
        self._path = path
        self._hf = self._fast = None
        try:
            import transformers  # noqa: F401
        except ImportError:
            transformers = None
        if transformers is not None:
            self._hf = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
            self._vocab = self._hf.get_vocab()
            self._eod = self._hf.eos_token_id
            self._pad = self._hf.pad_token_id
        else:
            try:
                import tokenizers
            except ImportError:
                raise TokenizerError(
                    "--tokenizer-type HuggingFaceTokenizer needs the `transformers` or the "
                    "`tokenizers` package (pip install tokenizers)") from None
            file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
            if not os.path.isfile(file):
                raise TokenizerError(f"--tokenizer-model: {file} not found (without `transformers` "
                                     f"the directory must contain tokenizer.json)")
            self._fast = tokenizers.Tokenizer.from_file(file)
            self._vocab = self._fast.get_vocab(with_added_tokens=True)
            cfg = {}
            cfg_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
            if os.path.isfile(cfg_file):
                with open(cfg_file, encoding="utf-8") as f:
                    cfg = json.load(f)

            def _special(name, guesses):
                tok = cfg.get(name)
                tok = tok.get("content") if isinstance(tok, dict) else tok
                for t in ([tok] if tok else []) + guesses:
                    if t in self._vocab:
                        return self._vocab[t]
                return None

            self._eod = _special("eos_token", ["</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>"])
            self._pad = _special("pad_token", ["<pad>", "[PAD]", "<|pad|>"])
        if self._eod is None:
            raise TokenizerError(f"--tokenizer-model: {path} defines no eos token (needed as "
                                 f"end-of-document)")
        self._inv = {i: t for t, i in self._vocab.items()}

    def __getstate__(self):
        return {"path": self._path}

    def __setstate__(self, state):
        self.__init__(state["path"])

    def tokenize(self, text: str) -> List[int]:
        if self._hf is not None:
            return self._hf.encode(text, add_special_tokens=False)
        return self._fast.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        return self._hf.decode(ids) if self._hf is not None else self._fast.decode(ids)


    @property
    def pad(self) -> int:
        return -1 if self._pad is None else self._pad


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
_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size")


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
    kind = opts.get("tokenizer_type") or "SentencePieceTokenizer"
    model, vocab = opts.get("tokenizer_model"), opts.get("vocab_file")
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(model)
    if kind == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(model)
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab, opts.get("merge_file"))
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(model)
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
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocab size")
    return parser
