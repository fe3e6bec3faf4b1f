"""megatron-moe: Megatron-LM-style Mixture-of-Experts pretraining on megatron-core."""

__version__ = "0.1.0"

from megatron_moe.compat import defer_wandb_import as _defer_wandb
from megatron_moe.compat import quiet_known_warnings as _quiet

_quiet()  # megatron-core's import-time notices about optional GPU packages, on every rank
_defer_wandb()  # megatron-core imports wandb eagerly; only --wandb-project loads it here
