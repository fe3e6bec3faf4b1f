"""The tokenizer base class megatron-core's datasets consume, per megatron-core version.

megatron-core <= 0.16: ``megatron.core.datasets.megatron_tokenizer.MegatronLegacyTokenizer`` (the
    legacy interface Megatron-LM's own tokenizers subclass); used as is.
megatron-core >= 0.17: that module is gone. The datasets only read attributes of the tokenizer
    (``eod``, ``pad``, ``vocab_size``, ``unique_identifiers``, BERT's ``cls``/``sep``/``mask``,
    ``inv_vocab``; optional ones guarded by ``except (AttributeError, NotImplementedError)``) and
    annotate it as the public ``megatron.core.tokenizers.MegatronTokenizerBase``. So the same
    interface is declared here on that public base: abstract ``tokenize``/``vocab``/``inv_vocab``/
    ``vocab_size``; optional attributes raise NotImplementedError as they did in the legacy class.
"""

from abc import abstractmethod
from collections import OrderedDict
from functools import lru_cache
import json
from typing import Any

from megatron_moe.compat.versions import mcore_at_least


@lru_cache(maxsize=None)
def megatron_tokenizer_base() -> type:
    """The base class for Megatron-LM-style tokenizers (``--tokenizer-type``) on this megatron-core."""
    if not mcore_at_least("0.17"):
        from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

        return MegatronLegacyTokenizer
    return _legacy_interface_on_public_base()


def _optional(name):
    def get(self):
        raise NotImplementedError(f"{type(self).__name__} has no attribute '{name}'")

    return property(get)


def _legacy_interface_on_public_base() -> type:
    from megatron.core.tokenizers import MegatronTokenizerBase

    class LegacyTokenizerBase(MegatronTokenizerBase):
        """Megatron-LM's legacy tokenizer interface (megatron-core <= 0.16) on the public base."""

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
