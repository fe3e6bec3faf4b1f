"""megatron-core's split of a micro-batch over the context-parallel ranks.

``megatron.core.utils.get_batch_on_this_cp_rank`` keeps, on CP rank r of cp, the sequence chunks r
and 2*cp-1-r of 2*cp (load-balanced causal work). Its signature changed: megatron-core 0.16 takes
``(batch, cp_group=None)``; 0.19 adds a required ``is_hybrid_cp`` (Megatron's
--hybrid-context-parallel, refused here) before ``cp_group``, and reads a missing ``cp_group`` as
the default (world) group, where 0.16 reads parallel_state's CP group: the group is always passed.
"""

from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=None)
def _takes_hybrid_cp_flag() -> bool:
    """Whether the installed megatron-core's split takes ``is_hybrid_cp`` (0.19); read once, not
    per micro-batch."""
    from megatron.core import utils

    return "is_hybrid_cp" in inspect.signature(utils.get_batch_on_this_cp_rank).parameters


def batch_on_this_cp_rank(batch: dict, cp_group=None) -> dict:
    """This CP rank's chunks of every tensor in ``batch`` (sequence dim 1; the attention mask's
    query dim 2), by megatron-core's own function. Identity with one CP rank."""
    from megatron.core import parallel_state, utils

    if cp_group is None:
        cp_group = parallel_state.get_context_parallel_group()
    if _takes_hybrid_cp_flag():
        return utils.get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return utils.get_batch_on_this_cp_rank(batch, cp_group=cp_group)
