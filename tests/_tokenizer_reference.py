"""Test oracles: the algorithms of Megatron-LM's legacy tokenizers, in plain Python.

* ``Gpt2Reference``: OpenAI's GPT-2 encoder (``encoder.py``), which Megatron-LM's
  ``gpt2_tokenization.GPT2Tokenizer`` and transformers' slow ``GPT2Tokenizer`` follow: the
  pre-tokenizer regex run by the ``regex`` package (its ``\\s``, ``\\p{L}``, ``\\p{N}``), byte-to-
  unicode mapping, rank-ordered BPE merges; the merges file's first line and the text after its
  last newline are dropped, unknown symbols map to id 0.
* ``BertReference``: Google BERT's ``FullTokenizer`` (Megatron-LM's ``bert_tokenization.py``):
  clean text (drop NUL, U+FFFD and Cc/Cf controls; tab/newline/CR/Zs -> space), spaces around
  CJK ideographs, ``str.split`` on whitespace, lower-case + NFD accent stripping (Mn), split on
  punctuation (ASCII non-alphanumerics and Unicode P*), greedy longest-match WordPiece with
  ``##`` continuations, words over 200 characters -> [UNK].

These are test-only: the library code runs on the ``tokenizers`` package. Both were checked
token for token against Megatron-LM's own modules (tag core_v0.16.1) on the test corpus.
"""

from __future__ import annotations

import json
import unicodedata
from collections import OrderedDict


def _bytes_to_unicode():
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes, extra = printable[:], 0
    chars = printable[:]
    for b in range(256):
        if b not in printable:
            codes.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(codes, chars)}


class Gpt2Reference:
    def __init__(self, vocab_file, merge_file):
        import regex

        with open(vocab_file, encoding="utf-8") as f:
            self.encoder = json.load(f)
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")[1:-1]
        self.ranks = {tuple(line.split()): i for i, line in enumerate(lines)}
        self.byte_encoder = _bytes_to_unicode()
        self.pattern = regex.compile(
            r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
        self.cache = {}

    def bpe(self, token):
        if token in self.cache:
            return self.cache[token]
        word = list(token)
        while len(word) > 1:
            pairs = set(zip(word, word[1:]))
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        self.cache[token] = word
        return word

    def tokenize(self, text):
        ids = []
        for piece in self.pattern.findall(text):
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder.get(sym, 0) for sym in self.bpe(mapped))
        return ids


def _is_whitespace(ch):
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_control(ch):
    return ch not in "\t\n\r" and unicodedata.category(ch) in ("Cc", "Cf")


def _is_punctuation(ch):
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp):
    return any(lo <= cp <= hi for lo, hi in (
        (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
        (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)))


class BertReference:
    def __init__(self, vocab_file, lower_case=True):
        self.vocab = OrderedDict()
        with open(vocab_file, encoding="utf-8") as f:
            for index, line in enumerate(f):
                self.vocab[line.strip()] = index  # BERT's load_vocab: a later duplicate wins
        self.lower_case = lower_case

    def basic(self, text):
        chars = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD or _is_control(ch):
                continue
            chars.append(" " if _is_whitespace(ch) else (f" {ch} " if _is_cjk(cp) else ch))
        out = []
        for word in "".join(chars).split():
            if self.lower_case:
                word = unicodedata.normalize("NFD", word.lower())
                word = "".join(c for c in word if unicodedata.category(c) != "Mn")
            piece = []
            for ch in word:
                if _is_punctuation(ch):
                    if piece:
                        out.append("".join(piece))
                        piece = []
                    out.append(ch)
                else:
                    piece.append(ch)
            if piece:
                out.append("".join(piece))
        return " ".join(out).split()

    def wordpiece(self, word):
        if len(word) > 200:
            return ["[UNK]"]
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                sub = word[start:end] if start == 0 else "##" + word[start:end]
                if sub in self.vocab:
                    pieces.append(sub)
                    break
                end -= 1
            if end == start:
                return ["[UNK]"]
            start = end
        return pieces

    def tokenize(self, text):
        return [self.vocab[p] for w in self.basic(text) for p in self.wordpiece(w)]


# Pieces of hard text: scripts, combining marks, zero-width and control characters, every kind of
# Unicode space, numerals that are not decimal digits, contractions, code and whitespace runs.
HARD_FRAGMENTS = [
    "Ünïcödé café naïve façade résumé", "Ελληνικά κείμενα", "Русский текст, ёжик",
    "العربية ١٢٣ نص", "עברית טקסט", "हिन्दी पाठ", "ภาษาไทยไม่มีช่องว่าง", "中文文本和標點。",
    "日本語のテキスト、カタカナ", "한국어 텍스트", "e\u0301te\u0301 (combining acute)",
    "zero\u200bwidth\u200cnon\u200djoiner\ufeffbom\u2060wj", "soft\u00adhyphen",
    "ctrl\x00nul\x01soh\x07bel\x08bs\x0bvt\x0cff\x1bsc\x1cfs\x1dgs\x1ers\x1fus\x7fdel\x85nel",
    "nbsp\u00a0thin\u2009em\u2003ideo\u3000ogham\u1680nnbsp\u202fmmsp\u205fsep\u2028par\u2029",
    "mongolian\u180evs", "bidi\u200e\u200f\u202a\u202e\u2066marks", "private\ue000use \ufffd",
    "½ ² Ⅻ ⑦ ٣ ۴ ߅ 𝟘 ¹²³", "I'm we're they've she'll he'd it's IT'S Don't 'twas",
    "emoji 🙂👍🏽 👩‍👩‍👧 🇩🇪 ❤️ ⚙︎", "math ∑∫√ ≤≥ ∞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "ﬁ ligature Ⅸ Å Ω K",
    "İstanbul ıi ß ẞ ǅ", "tab\tsep\t\tdouble", "   leading and trailing   ",
    "line\n\nbreaks\r\nwindows\rmac\n   \n\t\n", "a  b   c    d     e", "x\u3000\u3000y",
    "def f(x):\n    return {'a': [1, 2.5e-3, 0x1F], \"b\": None}  # comment\n",
    "for (int i = 0; i < n; ++i) { s += a[i] * b[i]; }\n\t\t// done",
    "if __name__ == '__main__':\n\tmain()\n", "s = r'\\d+\\s*' ; path = 'C:\\\\Users\\\\x'",
    "<html><body class=\"x\">&amp;&lt;&#x27;</body></html>", "$ ls -la | grep '^d' && echo ok",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" * 5, "--" * 30, "    " * 10,
    "'s's 't 're've'm'll'd", " 123 4567 89", "..., ?!; :)", "~`!@#$%^&*()_+-=[]{}|;':\",./<>?",
]


def hard_corpus(n_docs=300, seed=0, plain=()):
    """Deterministic documents mixing HARD_FRAGMENTS (and the given plain texts) with random
    whitespace runs between them."""
    import random

    rng = random.Random(seed)
    joiners = ["", " ", "  ", "\n", "\n\n", "\t", " \n ", "\u00a0", "   \t  "]
    pool = list(HARD_FRAGMENTS) + list(plain)
    docs = list(HARD_FRAGMENTS)  # each fragment alone too
    for _ in range(n_docs):
        parts = rng.sample(pool, rng.randint(1, 6))
        doc = ""
        for p in parts:
            doc += p + rng.choice(joiners)
        docs.append(doc)
    return docs
