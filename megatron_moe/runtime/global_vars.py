"""Process-wide args and tokenizer, as Megatron-LM's ``get_args()`` / ``get_tokenizer()``.

Entry scripts written for Megatron-LM read them from inside ``forward_step``; keeping the same
accessors lets those scripts port with an import change.
"""

_ARGS = None
_TOKENIZER = None


def set_args(args):
    global _ARGS
    _ARGS = args


def get_args():
    if _ARGS is None:
        raise RuntimeError("args are not set: call megatron_moe.training.loop.pretrain() first")
    return _ARGS


def set_tokenizer(tokenizer):
    global _TOKENIZER
    _TOKENIZER = tokenizer


def get_tokenizer():
    if _TOKENIZER is None:
        raise RuntimeError("tokenizer is not built yet")
    return _TOKENIZER
