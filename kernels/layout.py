"""The routing layout shared by every backend (reference, fast torch, Triton).

A *layout* says where each (token, choice) pair lands in the expert-sorted buffer that the
experts (or the all-to-all) consume:

* rows are grouped by expert, experts ascending; inside one expert, rows follow token order
  (a stable sort of the pairs by expert id) - exactly megatron-core's ``permute`` order;
* ``row_map[r]`` is the token feeding row ``r`` (megatron-core's ``sorted_indices``);
* ``prob_index[r]`` is the flat index into the probs tensor for row ``r``: ``t * k + j`` for the
  top-k form (probs ``[T, k]``), ``t * E + e`` for the routing-map form (probs ``[T, E]``),
  ``-1`` where the row has no prob (padding rows of the top-k form, prob taken as 0).

Capacity (``capacity=C``): an expert keeps its earliest ``C`` routed tokens in token order and
drops the rest - megatron-core's drop policy "position" (``apply_router_token_dropping`` with
``drop_policy="position"``) and what ``permute(..., drop_and_pad=True)`` keeps when a column of the
routing map has more than ``C`` ones.  With ``pad_to_capacity=True`` every expert gets exactly
``min(C, T)`` rows: after its kept tokens come tokens *not* routed to it, ascending, as
megatron-core's drop_and_pad permute does (its descending stable argsort of the 0/1 column); such
padding rows carry prob ``probs[t, e]`` in the routing-map form (normally 0) and prob 0 in the top-k
form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class RoutingLayout:
    row_map: torch.Tensor  # int64 [N]: source token of each permuted row
    prob_index: torch.Tensor  # int64 [N]: flat index into probs, -1 = no prob (0)
    tokens_per_expert: torch.Tensor  # int64 [E]: rows per expert in the permuted buffer
    routed_per_expert: torch.Tensor  # int64 [E]: routed pairs per expert before dropping
    num_tokens: int
    num_experts: int
    topk: Optional[int]  # k for the top-k form, None for the routing-map form
    capacity: Optional[int] = None
    pad_to_capacity: bool = False
    experts_per_rank: Optional[int] = None

    @property
    def num_rows(self) -> int:
        return int(self.row_map.numel())

    @property
    def tokens_per_rank(self) -> Optional[torch.Tensor]:
        """Rows sent to each destination EP rank (experts are laid out rank-major:
        rank r owns experts [r * experts_per_rank, (r + 1) * experts_per_rank))."""
        if self.experts_per_rank is None:
            return None
        return self.tokens_per_expert.view(-1, self.experts_per_rank).sum(dim=1)

    @property
    def kept_per_expert(self) -> torch.Tensor:
        """Routed pairs that survived capacity dropping (padding rows excluded)."""
        if self.capacity is None:
            return self.routed_per_expert
        return self.routed_per_expert.clamp(max=self.capacity)

    def probs_per_row(self, probs: torch.Tensor) -> torch.Tensor:
        """Gather the prob of every permuted row (0 where ``prob_index`` is -1)."""
        flat = probs.reshape(-1)
        if flat.numel() != self.num_tokens * (self.topk or self.num_experts):
            raise ValueError(f"probs has shape {tuple(probs.shape)}, expected "
                             f"[{self.num_tokens}, {self.topk or self.num_experts}] for this layout")
        if not (self.topk is not None and self.pad_to_capacity):
            return flat.index_select(0, self.prob_index)
        # only top-k padding rows have no prob (-1): they get 0
        valid = self.prob_index >= 0
        safe = torch.where(valid, self.prob_index, torch.zeros_like(self.prob_index))
        out = flat.index_select(0, safe)
        return torch.where(valid, out, torch.zeros_like(out))


def check_experts_per_rank(num_experts: int, experts_per_rank: Optional[int]) -> None:
    if experts_per_rank is None:
        return
    if experts_per_rank <= 0 or num_experts % experts_per_rank != 0:
        raise ValueError(
            f"experts_per_rank={experts_per_rank} must be a positive divisor of "
            f"num_experts={num_experts} (kernels.routing_layout)"
        )


def check_topk(topk_idx: torch.Tensor, num_experts: int, on_device: bool = False) -> None:
    """``on_device``: the GPU path checks the values with device-side asserts (reading them back
    would stall the host on every call); the CPU paths raise a ValueError naming the values."""
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [tokens, k], got shape {tuple(topk_idx.shape)}")
    if topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool:
        raise ValueError(f"topk_idx must be an integer tensor, got {topk_idx.dtype}")
    if topk_idx.numel() and on_device:
        torch._assert_async(((topk_idx >= 0) & (topk_idx < num_experts)).all(),
                            f"topk_idx values must lie in [0, num_experts={num_experts})")
        if topk_idx.size(1) > 1:
            s = topk_idx.sort(dim=1).values
            torch._assert_async((s[:, 1:] != s[:, :-1]).all(),
                                "topk_idx has a token choosing the same expert twice")
    elif topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(
                f"topk_idx values must lie in [0, num_experts={num_experts}), got [{lo}, {hi}]"
            )
        if topk_idx.size(1) > 1:
            s = topk_idx.sort(dim=1).values
            if bool((s[:, 1:] == s[:, :-1]).any()):
                raise ValueError("topk_idx has a token choosing the same expert twice")


def check_capacity(capacity: Optional[int], pad_to_capacity: bool) -> None:
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if pad_to_capacity and capacity is None:
        raise ValueError("pad_to_capacity=True needs a capacity")
