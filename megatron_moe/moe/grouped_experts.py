"""--moe-torch-grouped-gemm: the experts of megatron-core's local path as two grouped GEMMs.

Without Transformer Engine megatron-core runs an MoE layer's experts as ``SequentialMLP``: a Python
loop that calls two linear autograd functions per expert. The first GPU run (docs/gpu.md) found the
training-bf16 model host-bound on it: 32 experts x 16 layers x 4 micro-batches = 4228 linear calls
per iteration at 120-230 us of host time each, the device busy 21% of the time, MFU 0.9%.
``--moe-grouped-gemm`` is no way out there: on megatron-core 0.19 it needs Transformer Engine.

``GroupedSequentialMLP`` keeps everything of ``SequentialMLP`` (its ``local_experts``, parameters,
state dict and sharded checkpoint layout, so checkpoints move freely between the two) and replaces
only the loop: the experts' weights stacked, ``torch.nn.functional.grouped_mm`` for fc1 and for fc2
over the tokens grouped by expert, and in between megatron-core's own MLP activation code (every
variant: GLU, clamps, fused bias-activation, the per-token prob scale), run once on the whole batch
instead of once per expert. It also needs no ``tokens_per_expert.tolist()`` (a host sync).
Written here because megatron-core offers grouped experts only through Transformer Engine (its
torch ``grouped_mm`` path is inference-only, megatron/core/inference/moe/fused_moe.py).
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP

FLAG = "--moe-torch-grouped-gemm"


def grouped_mm_available() -> bool:
    return hasattr(torch.nn.functional, "grouped_mm")


def add_arguments(parser):
    g = parser.add_argument_group("MoE experts")
    g.add_argument(FLAG, action="store_true",
                   help="Run the experts of the local (non-Transformer-Engine) path as two torch "
                        "grouped GEMMs per layer (torch.nn.functional.grouped_mm) instead of "
                        "megatron-core's Python loop over experts (SequentialMLP); same parameters "
                        "and checkpoints. On CUDA it needs --bf16 (docs/gpu.md).")
    return parser


def validate_args(args):
    """Refuse what the grouped path cannot run (ValueError names the flag)."""
    if not getattr(args, "moe_torch_grouped_gemm", False):
        return
    if not getattr(args, "num_experts", None):
        raise ValueError(f"{FLAG} needs an MoE model (--num-experts)")
    if not grouped_mm_available():
        raise ValueError(f"{FLAG} needs torch.nn.functional.grouped_mm (torch >= 2.9; this is "
                         f"torch {torch.__version__})")
    for flag, attr in (("--moe-grouped-gemm", "moe_grouped_gemm"),
                       ("--add-bias-linear", "add_bias_linear"),
                       ("--fp8-format", "fp8"), ("--fp4-format", "fp4"),
                       ("--delay-wgrad-compute", "delay_wgrad_compute"),
                       ("--moe-latent-size", "moe_latent_size")):
        if getattr(args, attr, None):
            raise ValueError(f"{FLAG} cannot be combined with {flag}")
    if getattr(args, "transformer_impl", None) == "transformer_engine":
        raise ValueError(f"{FLAG} replaces the local path's expert loop; with Transformer Engine "
                         "use --moe-grouped-gemm (--transformer-impl transformer_engine was given)")
    etp = getattr(args, "expert_tensor_parallel_size", 1) or 1
    if etp != 1:
        raise ValueError(f"{FLAG} needs --expert-tensor-parallel-size 1 (got {etp})")
    if getattr(args, "moe_balance_policy", "none") not in (None, "none"):
        raise ValueError(f"{FLAG}: --moe-balance-policy runs its own expert calls; drop one")
    if getattr(args, "moe_expert_offload", "none") not in (None, "none"):
        raise ValueError(f"{FLAG}: --moe-expert-offload is tested with the expert loop only")
    if torch.cuda.is_available() and not getattr(args, "bf16", False):
        raise ValueError(f"{FLAG} on CUDA needs --bf16 (torch's grouped_mm kernel)")
    ffn = getattr(args, "moe_ffn_hidden_size", None) or getattr(args, "ffn_hidden_size", None)
    for name, size in (("--hidden-size", args.hidden_size), ("--moe-ffn-hidden-size", ffn)):
        if size is not None and size % 8:
            raise ValueError(f"{FLAG} needs {name} a multiple of 8 (grouped_mm's 16-byte row "
                             f"alignment), got {size}")


class _Given(torch.nn.Module):
    """Stands in for a linear layer: returns its input (and no bias)."""

    def forward(self, x):
        return x, None


class GroupedSequentialMLP(SequentialMLP):
    grouped_calls = 0  # forward calls that took the grouped path (tests: proof it ran)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # expert 0's MLP with both linears replaced by _Given: its forward is then exactly the
        # activation part of megatron-core's MLP.forward. Kept off the module tree (not a
        # submodule: no second copy of expert 0 in the state dict or the optimizer)
        act = copy.copy(self.local_experts[0])
        act._modules = dict(act._modules, linear_fc1=_Given(), linear_fc2=_Given())
        object.__setattr__(self, "_activation", act)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if self.num_local_experts == 1:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP.forward
            x = (permuted_probs.unsqueeze(-1) * x).to(x.dtype)
            permuted_probs = torch.ones_like(permuted_probs)
        GroupedSequentialMLP.grouped_calls += 1
        offs = torch.cumsum(tokens_per_expert.to(x.device), 0).to(torch.int32)
        w1 = _StackedWeights.apply(*[e.linear_fc1.weight for e in self.local_experts])  # [E, 2F|F, H]
        w2 = _StackedWeights.apply(*[e.linear_fc2.weight for e in self.local_experts])  # [E, H, F]
        h = torch.nn.functional.grouped_mm(_aligned(x), w1.transpose(1, 2), offs=offs)
        h, _ = MLP.forward(self._activation, h, permuted_probs)
        out = torch.nn.functional.grouped_mm(_aligned(h), w2.transpose(1, 2), offs=offs)
        return out, None


class _StackedWeights(torch.autograd.Function):
    """``torch.stack`` of the experts' weights whose backward is one ``unbind`` (views of the
    stacked gradient) instead of torch.stack's one ``select`` per expert: the layer's op count does
    not grow with the number of experts (tests/test_launch_counts.py)."""

    @staticmethod
    def forward(ctx, *weights):
        return torch.stack(weights)

    @staticmethod
    def backward(ctx, grad):
        return grad.unbind(0)


def _aligned(t):
    """grouped_mm needs a contiguous operand starting on a 16-byte boundary (TMA loads); a slice of
    a larger buffer (a chunk of the permuted tokens) may start anywhere: copied then."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def customize_spec(args, spec):
    """The feature's spec edit (megatron_moe/features.py): SequentialMLP experts ->
    GroupedSequentialMLP under --moe-torch-grouped-gemm."""
    if not getattr(args, "moe_torch_grouped_gemm", False):
        return spec
    import dataclasses

    from megatron_moe.compat import replace_spec, spec_module, spec_submodules

    swapped = 0
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        mlp = getattr(getattr(layer, "submodules", None), "mlp", None)
        sub = spec_submodules(mlp)
        experts = getattr(sub, "experts", None)
        if experts is None:
            continue  # a dense layer
        if spec_module(experts) is GroupedSequentialMLP:  # a spec shared with a previous layer
            swapped += 1
            continue
        if spec_module(experts) is not SequentialMLP:
            raise ValueError(f"{FLAG}: the experts are {spec_module(experts)}, not megatron-core's "
                             "SequentialMLP")
        layer.submodules.mlp = replace_spec(mlp, submodules=dataclasses.replace(
            sub, experts=replace_spec(experts, module=GroupedSequentialMLP)))
        swapped += 1
    if not swapped:
        raise ValueError(f"{FLAG}: the model has no MoE layer")
    return spec
