"""Placement policies; the interface is in ``base.py`` (see docs/balance.md)."""

from megatron_moe.balance.policies.base import (POLICIES, BalancePolicy, NoBalancePolicy, Placement,  # noqa: F401
                                                balance_degree, default_owner, loads, make_policy,
                                                register_policy)
