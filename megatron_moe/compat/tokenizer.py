"""The tokenizer base class megatron-core's datasets consume.

megatron-core <= 0.16 ships ``megatron.core.datasets.megatron_tokenizer.MegatronLegacyTokenizer``
(deprecated there, logging a warning per construction); 0.17 removes that module. The datasets of
every release only read attributes of the tokenizer (``eod``, ``pad``, ``vocab_size``,
``unique_identifiers``, BERT's ``cls``/``sep``/``mask``, ``inv_vocab``; optional ones guarded by
``except (AttributeError, NotImplementedError)``) and annotate it as the public
``megatron.core.tokenizers.MegatronTokenizerBase``, which exists unchanged from 0.16.1 to 0.19.
So on every supported release the legacy interface is declared here on that public base:
abstract ``tokenize``/``vocab``/``inv_vocab``/``vocab_size``; optional attributes raise
NotImplementedError as they did in the legacy class. One code path, no version test.
"""

from abc import abstractmethod
from collections import OrderedDict
from functools import lru_cache
import json
from typing import Any


@lru_cache(maxsize=None)
def megatron_tokenizer_base() -> type:
    """The base class for Megatron-LM-style tokenizers (``--tokenizer-type``)."""
    return _legacy_interface_on_public_base()


def _optional(name):
    def get(self):
        raise NotImplementedError(f"{type(self).__name__} has no attribute '{name}'")

    return property(get)


def _legacy_interface_on_public_base() -> type:
    from megatron.core.tokenizers import MegatronTokenizerBase

    class LegacyTokenizerBase(MegatronTokenizerBase):
        """Megatron-LM's legacy tokenizer interface on megatron-core's public tokenizer base."""

        def __init__(self, *tokenizer_paths: str, **tokenizer_options: Any):
            # The public base's __init__(path, config) sets config entries as attributes; the
            # legacy contract instead records every path and option as a unique identifier
            # (part of the datasets' cache hash).
            self.unique_identifiers = OrderedDict()
            self.unique_identifiers["class"] = type(self).__name__
            self.unique_identifiers["tokenizer_path"] = list(tokenizer_paths)
            for option, value in tokenizer_options.items():
                self.unique_identifiers[option] = str(value)
            self.unique_description = json.dumps(self.unique_identifiers, indent=4)

        @abstractmethod
        def tokenize(self, text: str):
            """Text to token ids."""

        def detokenize(self, ids):
            raise NotImplementedError(f"{type(self).__name__} has no method 'detokenize'")

        def offsets(self, ids, text):
            raise NotImplementedError(f"{type(self).__name__} has no method 'offsets'")

        def apply_chat_template(self, *args, **kwargs):
            raise NotImplementedError(f"{type(self).__name__} has no chat template")

        @property
        @abstractmethod
        def vocab(self):
            """Token -> id."""

        @property
        @abstractmethod
        def inv_vocab(self):
            """Id -> token."""

        @property
        @abstractmethod
        def vocab_size(self):
            """Number of ids."""

        cls = _optional("cls")
        sep = _optional("sep")
        pad = _optional("pad")
        eod = _optional("eod")
        bos = _optional("bos")
        eos = _optional("eos")
        mask = _optional("mask")

    return LegacyTokenizerBase
