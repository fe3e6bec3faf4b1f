"""Placement policies; the interface is in ``base.py`` (see docs/balance.md). Each policy module
registers itself in ``base.POLICIES`` when imported here (base never imports a policy)."""

from megatron_moe.balance.policies.base import (POLICIES, BalancePolicy, NoBalancePolicy, Placement,  # noqa: F401
                                                balance_degree, default_owner, loads, make_policy,
                                                register_policy)
from megatron_moe.balance.policies import fastermoe, flexmoe, proprophet  # noqa: F401,E402 (register)
from megatron_moe.balance.policies import auto  # noqa: F401,E402 (register; uses the three above)
