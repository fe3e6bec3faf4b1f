"""``--moe-grouped-gemm`` on the local path: the experts as two torch grouped GEMMs.

Without Transformer Engine megatron-core runs an MoE layer's experts as ``SequentialMLP``: a Python
loop that calls two linear autograd functions per expert. The first GPU run (docs/gpu.md) found the
training-bf16 model host-bound on it: 32 experts x 16 layers x 4 micro-batches = 4228 linear calls
per iteration at 120-230 us of host time each, the device busy 21% of the time, MFU 0.9%.
megatron-core's own ``--moe-grouped-gemm`` needs Transformer Engine (TEGroupedMLP; 0.16's legacy
GroupedMLP needs the ``grouped_gemm`` package, 0.19's local spec ignores the flag).

So on the local path (``--transformer-impl local``, or no Transformer Engine) ``--moe-grouped-gemm``
means ``GroupedSequentialMLP``: it keeps everything of ``SequentialMLP`` (its ``local_experts``,
parameters, state dict and sharded checkpoint layout, so checkpoints move freely between the two)
and replaces only the loop: the experts' weights stacked, ``torch.nn.functional.grouped_mm`` for
fc1 and for fc2 over the tokens grouped by expert, and in between megatron-core's own MLP
activation code (every variant: GLU, clamps, fused bias-activation, the per-token prob scale), run
once on the whole batch instead of once per expert. Group offsets come from a device cumsum (no
``tokens_per_expert.tolist()``, a host sync). With Transformer Engine ``--moe-grouped-gemm`` stays
megatron-core's TEGroupedMLP. ``--moe-torch-grouped-gemm`` is kept as an alias of
``--moe-grouped-gemm`` for the local path (scripts and the GPU kit written before name it).
Written here because megatron-core offers grouped experts only through Transformer Engine (its
torch ``grouped_mm`` path is inference-only, megatron/core/inference/moe/fused_moe.py).

The same grouped call runs extra groups when a caller stacks more weights than the local experts
(the balanced layer's replicas, :func:`grouped_mlp`).

``--moe-single-grouped-weight`` (Megatron-LM's flag; with Transformer Engine it is megatron-core's
GroupedTensor weight) keeps each linear's expert weights as ONE parameter [local experts, out, in]
(``experts.linear_fc1.weight``; ``--moe-single-grouped-bias`` the biases [local experts, out]):
megatron-core's DDP, optimizer, gradient norm and clipping then walk 2 expert parameters per layer
instead of 2 per expert (their Python loops and hooks run per parameter: host time that grew with
the experts, docs/gpu.md), and the grouped GEMMs read the weights without stacking a copy in every
forward and backward. Initial values are the per-expert MLPs' (stacked at construction), and the
checkpoint layout stays SequentialMLP's (one factory per stacked parameter, built from megatron-core's
own per-expert entries), so checkpoints move between the loop, the grouped and the single-weight
experts both ways; a plain ``state_dict()`` has SequentialMLP's per-expert keys too. With every
expert parameter stacked (the weights, and the biases stacked or absent) the per-expert MLPs hold
nothing and are kept out of the module tree (``local_experts`` a plain attribute, still read for the
checkpoint entries, the balance layer and the activation): megatron-core walks the whole tree every
iteration (``finalize_model_grads``), so the module count and the Python calls per iteration then
do not grow with the experts either (tests/test_host_calls.py).
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.utils.checkpoint
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP

FLAG = "--moe-grouped-gemm"
ALIAS = "--moe-torch-grouped-gemm"
SINGLE_WEIGHT = "--moe-single-grouped-weight"
SINGLE_BIAS = "--moe-single-grouped-bias"


def grouped_mm_available() -> bool:
    return hasattr(torch.nn.functional, "grouped_mm")


def add_arguments(parser):
    g = parser.add_argument_group("MoE experts")
    g.add_argument(ALIAS, action="store_true",
                   help="Alias of --moe-grouped-gemm on the local (non-Transformer-Engine) path: "
                        "the experts as two torch grouped GEMMs per layer "
                        "(torch.nn.functional.grouped_mm) instead of megatron-core's Python loop "
                        "over experts (SequentialMLP); same parameters and checkpoints. On CUDA it "
                        "needs --bf16 (docs/gpu.md).")
    g.add_argument(SINGLE_WEIGHT, action="store_true",
                   help="Megatron-LM: store each linear's expert weights as one grouped parameter. "
                        "On the local path: one [local experts, out, in] parameter per linear per "
                        "layer for the torch grouped GEMMs (per-parameter host work of DDP and the "
                        "optimizer no longer grows with the experts); checkpoints keep "
                        "SequentialMLP's layout. Needs --moe-grouped-gemm.")
    g.add_argument(SINGLE_BIAS, action="store_true",
                   help="Megatron-LM: the expert biases as one grouped parameter (local path: "
                        "[local experts, out] per linear). Needs --moe-grouped-gemm and "
                        "--add-bias-linear.")
    return parser


def local_grouped(args) -> bool:
    """Whether the experts run as GroupedSequentialMLP: --moe-grouped-gemm (or its alias) without
    Transformer Engine. With Transformer Engine --moe-grouped-gemm is megatron-core's TEGroupedMLP."""
    if not (getattr(args, "moe_grouped_gemm", False) or getattr(args, "moe_torch_grouped_gemm", False)):
        return False
    return getattr(args, "transformer_impl", None) != "transformer_engine"


def _single_flags(args) -> tuple:
    """(--moe-single-grouped-weight, --moe-single-grouped-bias) as given."""
    return (bool(getattr(args, "moe_single_grouped_weight", False)),
            bool(getattr(args, "moe_single_grouped_bias", False)))


def single_grouped(args) -> tuple:
    """(weight, bias): whether the local grouped experts hold one parameter per linear."""
    return _single_flags(args) if local_grouped(args) else (False, False)


def _validate_single(args):
    weight, bias = _single_flags(args)
    if not (weight or bias):
        return
    flag = SINGLE_WEIGHT if weight else SINGLE_BIAS
    # megatron-core's own rules (TransformerConfig.__post_init__), checked here with the flags'
    # names so the local path refuses the same command lines
    if not getattr(args, "moe_grouped_gemm", False):
        raise ValueError(f"{flag} needs --moe-grouped-gemm")
    if bias and not getattr(args, "add_bias_linear", True):
        raise ValueError(f"{SINGLE_BIAS} needs --add-bias-linear (the experts have no biases)")
    if not local_grouped(args):
        from megatron_moe.compat.versions import mcore_at_least, megatron_core_version

        if not mcore_at_least("0.19"):
            raise ValueError(f"{flag} with Transformer Engine is megatron-core's (>= 0.19, "
                             f"Transformer Engine >= 2.14); this is megatron-core "
                             f"{megatron_core_version()}")
        return
    # the balance policies' replicas run on slices of the stacked parameters; FlexMoE's persistent
    # replicas (an optimizer state per expert parameter) fall back to transient ones, with the
    # reason in the log, as they do wherever they cannot apply (balance.BalanceManager.set_optimizer)
    if getattr(args, "optimizer", "adam") == "muon":
        raise ValueError(f"{flag} cannot run --optimizer muon (Muon orthogonalises 2-D matrices; "
                         f"a stacked expert weight is 3-D)")


def validate_args(args):
    """Refuse what the grouped path cannot run (ValueError names the flag)."""
    _validate_single(args)
    if getattr(args, "moe_torch_grouped_gemm", False):
        if getattr(args, "transformer_impl", None) == "transformer_engine":
            raise ValueError(f"{ALIAS} replaces the local path's expert loop; with Transformer "
                             "Engine use --moe-grouped-gemm (--transformer-impl transformer_engine "
                             "was given)")
        args.moe_grouped_gemm = True          # the alias: one flag from here on
    if not local_grouped(args):
        return
    flag = ALIAS if getattr(args, "moe_torch_grouped_gemm", False) else FLAG
    if not getattr(args, "num_experts", None):
        raise ValueError(f"{flag} needs an MoE model (--num-experts)")
    if not grouped_mm_available():
        raise ValueError(f"{flag} without Transformer Engine needs torch.nn.functional.grouped_mm "
                         f"(torch >= 2.9; this is torch {torch.__version__})")
    if torch.cuda.is_available() and not getattr(args, "bf16", False):
        raise ValueError(f"{flag} on CUDA without Transformer Engine needs --bf16 (torch's "
                         "grouped_mm kernel)")
    ffn = getattr(args, "moe_ffn_hidden_size", None) or getattr(args, "ffn_hidden_size", None)
    etp = getattr(args, "expert_tensor_parallel_size", 1) or 1
    for name, size in (("--hidden-size", args.hidden_size), ("--moe-ffn-hidden-size", ffn)):
        if size is not None and (size // (etp if name != "--hidden-size" else 1)) % 8:
            raise ValueError(f"{flag} needs {name} (per expert-tensor-parallel rank) a multiple "
                             f"of 8 (grouped_mm's 16-byte row alignment), got {size}")


class _Given(torch.nn.Module):
    """Stands in for a linear layer: returns its input, which is the linear's output already
    computed by grouped_mm, with the per-row bias when the caller passes ``(output, bias)``."""

    def forward(self, x):
        return x if isinstance(x, tuple) else (x, None)


def activation_of(expert: MLP) -> MLP:
    """``expert`` (a megatron-core MLP) with both linears replaced by :class:`_Given`: its forward is
    then exactly the activation part of megatron-core's ``MLP.forward`` (GLU, clamps, bias add, the
    per-token prob scale). A shallow copy sharing the config: never registered as a submodule (no
    second copy of the expert in a state dict or an optimizer)."""
    act = copy.copy(expert)
    act._modules = dict(act._modules, linear_fc1=_Given(), linear_fc2=_Given())
    return act


def grouped_mlp(activation: MLP, x, probs, counts, w1, w2, b1=None, b2=None,
                recompute_activation: bool = False):
    """G experts' MLPs on ``x`` whose rows are grouped by expert, ``counts[g]`` rows for group g
    (a device tensor: offsets from a device cumsum, no host sync): fc1 and fc2 as one
    ``grouped_mm`` each, megatron-core's activation in between (:func:`activation_of`).

    ``w1``: G tensors [fc1 out, H], ``w2``: G tensors [H, F] (the linear weights, any mix of owned
    parameters and balance replicas), or each one stacked tensor [G, out, in] (the single grouped
    weight); ``b1`` / ``b2``: G biases each, one stacked [G, out] tensor, or None. The biases are added
    per row by gathering each row's group bias (ids by ``repeat_interleave`` with the known output
    size: no sync), exactly where megatron-core's MLP adds them: fc1's before the activation, fc2's
    scaled by the row's prob after it (mlp.py, ``output += output_bias * per_token_scale``).

    ``recompute_activation`` (``--recompute-modules moe_act``): the activation's output is not kept
    for backward but recomputed from fc1's output, as megatron-core's grouped-GEMM experts do."""
    # megatron-core's dispatcher hands the counts over on the host (its own D2H copy, made for
    # SequentialMLP's split): copied back without blocking the host where the source is pinned
    counts = counts.to(x.device, non_blocking=True)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    ids = None
    if b1 is not None or b2 is not None:
        b1 = _stacked_bias(b1)
        b2 = _stacked_bias(b2)
        ids = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts,
                                      output_size=x.shape[0])
    h = _linear(x, offs, w1)
    bias1 = None if b1 is None else b1.index_select(0, ids)
    if recompute_activation and torch.is_grad_enabled():
        h = torch.utils.checkpoint.checkpoint(_activate, activation, h, bias1, probs,
                                              use_reentrant=False)
    else:
        h = _activate(activation, h, bias1, probs)
    out = _linear(h, offs, w2)
    if b2 is not None:
        out += b2.index_select(0, ids) * probs.unsqueeze(-1)
    return out


def _activate(activation, h, bias, probs):
    return MLP.forward(activation, (h, bias), probs)[0]


def _linear(x, offs, weights):
    if isinstance(weights, torch.Tensor):          # the single grouped weight [G, out, in]
        return _StackedGroupedLinear.apply(x, offs, weights)
    return _GroupedLinear.apply(x, offs, *weights)


def _stacked_bias(biases):
    if biases is None or isinstance(biases, torch.Tensor):
        return biases
    return _Stack.apply(*biases)


def _grouped_grads(ctx, grad, x, offs, w):
    """Input and weight gradients of ``x @ w_g^T`` per row group (``w`` [G, out, in]): torch's own
    formulas for grouped_mm. The weight gradient is [G, out, in] directly (not the transpose of
    [G, in, out]): each expert's gradient is then a contiguous slice."""
    grad = _aligned(grad)
    dx = torch.nn.functional.grouped_mm(grad, w, offs=offs) if ctx.needs_input_grad[0] else None
    return dx, torch.nn.functional.grouped_mm(grad.t(), x, offs=offs)


class _GroupedLinear(torch.autograd.Function):
    """``x @ W_g^T`` per row group g: one grouped_mm forward, two backward (torch's own formulas
    for grouped_mm). Written as a Function because autograd of ``grouped_mm(x, torch.stack(W))``
    would save the stacked copy until backward: a second copy of every layer's expert weights held
    from forward to backward, and (--moe-expert-offload) a copy of weights the offload moves off the
    device. This saves the weight tensors themselves, as megatron-core's linear layers do (so the
    offload's re-bind before backward is what backward reads), and stacks them again there."""

    @staticmethod
    def forward(ctx, x, offs, *weights):
        x = _aligned(x)
        ctx.save_for_backward(x, offs, *weights)
        return torch.nn.functional.grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, offs, *weights = ctx.saved_tensors
        # each expert's gradient is a slice of dw, which autograd takes as its grad without a copy
        dx, dw = _grouped_grads(ctx, grad, x, offs, torch.stack(weights))
        return (dx, None, *_accumulate_into_main_grads(weights, dw))


class _StackedGroupedLinear(torch.autograd.Function):
    """:class:`_GroupedLinear` on one stacked weight parameter [G, out, in] (the single grouped
    weight): no stacking in forward or backward, and the weight gradient goes into DDP's
    ``main_grad`` as one ``add_`` (what DDP's hook would do, here without a second pass)."""

    @staticmethod
    def forward(ctx, x, offs, weight):
        x = _aligned(x)
        ctx.save_for_backward(x, offs, weight)
        return torch.nn.functional.grouped_mm(x, weight.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, offs, weight = ctx.saved_tensors
        dx, dw = _grouped_grads(ctx, grad, x, offs, weight)
        if _into_main_grad([weight]):
            weight.main_grad.add_(dw)
            weight.grad_added_to_main_grad = True
            GroupedSequentialMLP.wgrads_into_main_grad += 1
        return dx, None, dw


def _slices_into_main_grad(param):
    """``param``'s slices along the expert axis (autograd's unbind: their gradients stack back into
    ``param.grad``), each carrying its slice of DDP's ``main_grad``, so the grouped backward adds
    their gradients into it as for per-expert parameters and marks ``param`` itself as added
    (DDP's hook then skips the stacked gradient, as it does for a micro-batch without replicas)."""
    parts = param.unbind(0)
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None or not hasattr(param, "grad_added_to_main_grad"):
        return parts
    for i, part in enumerate(parts):
        part.main_grad = main_grad[i]
        part.grad_added_to_main_grad = False
        part.zero_out_wgrad = getattr(param, "zero_out_wgrad", False)
        part.stacked_parameter = param
    return parts


def _into_main_grad(weights) -> list:
    """Indices of the weights megatron-core's DDP gave a ``main_grad`` (it sets
    ``grad_added_to_main_grad`` on each); not with ``zero_out_wgrad`` (its hook then adds the
    returned grad). One call for all the weights: this runs per layer per micro-batch, and a Python
    call per expert weight is host time that grows with the experts (tests/test_host_calls.py)."""
    return [i for i, w in enumerate(weights)
            if getattr(w, "main_grad", None) is not None and hasattr(w, "grad_added_to_main_grad")
            and not getattr(w, "zero_out_wgrad", False)]


def _accumulate_into_main_grads(weights, dw):
    """The weight gradients ``dw`` [G, out, in] added to the parameters' DDP ``main_grad`` with
    one foreach add, as megatron-core's linear layers do with --gradient-accumulation-fusion
    (apex's wgrad GEMM, absent on the local path): DDP's per-parameter hook then skips its
    ``main_grad.add_(grad)``, one launch per expert weight per micro-batch (1024 per iteration in
    the GPU kit's 128-expert model). Autograd still gets every slice of ``dw`` (no allocation;
    ``grad_added_to_main_grad`` tells the hook not to add it again, as with megatron-core's
    placeholder gradients); balance replicas and weights outside DDP are left to autograd."""
    grads = list(dw.unbind(0))
    fused = _into_main_grad(weights)
    if not fused:
        return grads
    by_dtype = {}
    for i in fused:
        by_dtype.setdefault(weights[i].main_grad.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        src = grads if dw.dtype == dtype else dw.to(dtype).unbind(0)   # add_'s promotion
        torch._foreach_add_([weights[i].main_grad for i in idx], [src[i] for i in idx])
    for i in fused:
        weights[i].grad_added_to_main_grad = True
        stacked_parameter = getattr(weights[i], "stacked_parameter", None)
        if stacked_parameter is not None:    # a slice of a single grouped weight
            stacked_parameter.grad_added_to_main_grad = True
    GroupedSequentialMLP.wgrads_into_main_grad += len(fused)
    return grads


class _Stack(torch.autograd.Function):
    """``torch.stack`` whose backward is one ``unbind`` (torch's own selects once per tensor: a
    launch per expert in the backward of the biases)."""

    @staticmethod
    def forward(ctx, *tensors):
        return torch.stack(tensors)

    @staticmethod
    def backward(ctx, grad):
        return grad.unbind(0)


_LINEARS = ("linear_fc1", "linear_fc2")
# one expert MLP's parameters in its named_parameters() order
_PARAMETERS = ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")


def _run_forward_pre_hooks(experts):
    """The grouped call reads the experts' weights without calling their linear modules, so the
    forward pre-hooks registered on those modules must run here: megatron-core's DDP waits for a
    bucket's parameter all-gather in one (--overlap-param-gather with the distributed optimizer);
    skipped, the grouped call would read parameters still being gathered. The linears are read
    from ``_modules`` (``expert.linear_fc1`` is a Python ``nn.Module.__getattr__`` call, per expert
    per layer per micro-batch) and one without hooks costs no call."""
    for expert in experts:
        for name in _LINEARS:
            linear = expert._modules[name]
            if linear._forward_pre_hooks:
                for hook in list(linear._forward_pre_hooks.values()):
                    hook(linear, ())


def stacked(experts, name: str):
    """One parameter (``linear_fc1.weight``, ...) of each expert MLP (a module, or a balance
    replica's name -> tensor dict); None when the experts have none (no bias: decided on the first
    expert). A module's parameter is read from its linear's ``_parameters``, where megatron-core's
    linears register it, without ``nn.Module.__getattr__``'s Python call per expert."""
    linear, attr = name.split(".")
    first = experts[0]
    if isinstance(first, torch.nn.Module):
        if getattr(getattr(first, linear), attr, None) is None:
            return None
    elif first.get(name) is None:
        return None
    return [e._modules[linear]._parameters[attr] if isinstance(e, torch.nn.Module) else e[name]
            for e in experts]


class _SingleGroupedLinear(torch.nn.Module):
    """The experts' ``linear_fc1`` / ``linear_fc2`` under ``--moe-single-grouped-weight``: holds the
    stacked parameters, ``weight`` [local experts, out, in] and (``--moe-single-grouped-bias``)
    ``bias`` [local experts, out]; never called (the grouped GEMMs read them)."""


def _stack_parameters(experts, name: str) -> torch.nn.Parameter:
    """The experts' ``name`` parameters (e.g. ``linear_fc1.weight``) as one new parameter stacked
    on a leading expert axis, with megatron-core's attributes (expert-parallel ``allreduce``,
    tensor-parallel partition axis moved by the new axis, ...); each expert's own is set to None,
    which frees it and keeps it out of ``parameters()`` and ``state_dict()``."""
    linear, attr = name.split(".")
    owners = [e._modules[linear] for e in experts]
    params = [o._parameters[attr] for o in owners]
    stacked_param = torch.nn.Parameter(torch.stack([p.detach() for p in params]),
                                       requires_grad=params[0].requires_grad)
    for key, value in vars(params[0]).items():
        setattr(stacked_param, key, value)
    if hasattr(params[0], "partition_dim"):
        stacked_param.partition_dim = params[0].partition_dim + 1
    for owner in owners:
        owner._parameters[attr] = None
    return stacked_param


def _unregister_expert_shells(experts):
    """With every expert parameter stacked, the per-expert MLPs (an MLP and two linears each) hold
    nothing: they are kept as a plain attribute, outside the module tree. megatron-core walks the
    whole tree every iteration (``finalize_model_grads`` -> ``reset_model_temporary_tensors`` calls
    ``modules()``), a walk that grew with experts x layers. Holding no parameters or buffers, the
    shells gave the other walks nothing to do either (``to``/``bfloat16`` casts, ``apply``, DDP's
    pre-hooks, put on modules with parameters only). ``experts.local_experts`` still reads them for
    what needs one MLP per expert: megatron-core's per-expert checkpoint entries
    (:meth:`GroupedSequentialMLP.sharded_state_dict`), the balance layer's identities and slices,
    the activation's template. ``train()``/``eval()`` no longer reach them and nothing reads their
    flag: they are never called (nor is the activation copy, outside the tree already;
    megatron-core's MLP forward reads no training flag). With per-expert biases (the single weight
    without ``--moe-single-grouped-bias``) the shells hold parameters and stay registered."""
    shells = experts._modules.pop("local_experts")
    object.__setattr__(experts, "local_experts", shells)
    # a plain state dict keeps SequentialMLP's keys: the shells' own entries (megatron-core's
    # linears write an empty ``_extra_state``) are written and read by the layer's hooks
    experts.register_state_dict_post_hook(_shells_state_dict)
    experts._register_load_state_dict_pre_hook(_load_shells, with_module=True)


class GroupedSequentialMLP(SequentialMLP):
    grouped_calls = 0   # grouped calls made (tests: proof the grouped path ran)
    replica_groups = 0  # groups of those calls that ran a balance replica (not a local expert)
    wgrads_into_main_grad = 0   # weight gradients added to DDP's main_grad by the grouped backward

    def __init__(self, *args, recompute_activation: bool = False, single_weight: bool = False,
                 single_bias: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "_activation", activation_of(self.local_experts[0]))
        # --recompute-modules moe_act (megatron-core's config cannot carry it without its own
        # grouped GEMM: the spec hands it over, models/builder.py keeps it out of the config)
        self.recompute_activation = recompute_activation
        # --moe-single-grouped-weight / -bias: "linear_fc1.weight", ... held stacked on this module
        self.single_names = tuple(
            f"{linear}.{attr}" for linear in _LINEARS for attr, on in (("weight", single_weight),
                                                                       ("bias", single_bias))
            if on and getattr(self.local_experts[0]._modules[linear], attr, None) is not None)
        for name in self.single_names:
            linear, attr = name.split(".")
            if linear not in self._modules:
                self.add_module(linear, _SingleGroupedLinear())
            self._modules[linear].register_parameter(
                attr, _stack_parameters(self.local_experts, name))
        # whether the experts' own linears still hold parameters (and so DDP's pre-hooks to run)
        self._per_expert_params = any(True for e in self.local_experts for _ in e.parameters())
        if self.single_names:
            self.register_state_dict_post_hook(_per_expert_state_dict)
            self._register_load_state_dict_pre_hook(_stacked_state_dict, with_module=True)
        if self.single_names and not self._per_expert_params:
            _unregister_expert_shells(self)   # after the hooks above: loads stack the keys first

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if self.num_local_experts == 1 and not self.single_names:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP.forward
            x = (permuted_probs.unsqueeze(-1) * x).to(x.dtype)
            permuted_probs = torch.ones_like(permuted_probs)
        if self._per_expert_params:
            _run_forward_pre_hooks(self.local_experts)
        return self.run_groups(list(self.local_experts), x, permuted_probs, tokens_per_expert), None

    def run_groups(self, experts, x, probs, counts):
        """``experts`` (MLP modules or name -> tensor dicts of the same shapes: balance replicas)
        on ``x`` grouped by ``counts``, in one grouped call per linear."""
        GroupedSequentialMLP.grouped_calls += 1
        own = experts == list(self.local_experts)    # identities, in C
        if not own:   # (the replicas counted only here: an isinstance call per expert otherwise)
            GroupedSequentialMLP.replica_groups += sum(
                1 for e in experts if not isinstance(e, torch.nn.Module))
        if self.single_names and not own:
            # a balanced layer's selection (local experts in its order, replicas): the stacked
            # parameters' slices (autograd's unbind: the gradients stack back into them)
            experts = self._with_slices(experts)
        w1, b1, w2, b2 = (self._single(name) if name in self.single_names and own
                          else stacked(experts, name) for name in _PARAMETERS)
        return grouped_mlp(self._activation, x, probs, counts, w1, w2, b1, b2,
                           recompute_activation=self.recompute_activation)

    def _with_slices(self, experts):
        """``experts`` with each local MLP module replaced by a name -> tensor dict: its slices of
        the stacked parameters, and its own parameters for the rest."""
        index = {id(m): i for i, m in enumerate(self.local_experts)}
        slices = {name: _slices_into_main_grad(self._single(name)) for name in self.single_names}
        own = [(name, *name.split(".")) for name in self.expert_parameter_names()
               if name not in slices]        # the expert's own parameters (e.g. its biases)
        out = []
        for e in experts:
            if isinstance(e, torch.nn.Module):
                i = index[id(e)]
                part = {name: s[i] for name, s in slices.items()}
                part.update({name: e._modules[linear]._parameters[attr] for name, linear, attr in own})
                out.append(part)
            else:
                out.append(e)
        return out

    def expert_parameter_names(self) -> list:
        """The names of one expert's parameters, in an MLP's ``named_parameters()`` order
        (``linear_fc1.weight``, ``linear_fc1.bias``, ...), stacked or not."""
        first = self.local_experts[0]
        return [name for name in _PARAMETERS if name in self.single_names or
                first._modules[name.split(".")[0]]._parameters.get(name.split(".")[1]) is not None]

    def expert_parameters(self, i: int) -> list:
        """Local expert ``i``'s parameters in :meth:`expert_parameter_names` order: its own, or
        detached slices of the stacked ones carrying the slice of DDP's ``main_grad`` (what the
        balance layer sends to replica holders and adds replica gradients into)."""
        out = []
        for name in self.expert_parameter_names():
            linear, attr = name.split(".")
            if name not in self.single_names:
                out.append(self.local_experts[i]._modules[linear]._parameters[attr])
                continue
            param = self._modules[linear]._parameters[attr]
            part = param.detach()[i]
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None:
                part.main_grad = main_grad[i]
            out.append(part)
        return out

    def _single(self, name):
        linear, attr = name.split(".")
        module = self._modules[linear]
        # megatron-core's DDP waits for a bucket's parameter all-gather in a module's forward
        # pre-hook (--overlap-param-gather); this module is never called: run them here
        for hook in list(module._forward_pre_hooks.values()):
            hook(module, ())
        return module._parameters[attr]

    @contextlib.contextmanager
    def _per_expert_views(self):
        """Each expert's linears hold views of the stacked parameters for the duration (what
        megatron-core's per-expert checkpoint code reads), then None again."""
        for name in self.single_names:
            linear, attr = name.split(".")
            views = self._modules[linear]._parameters[attr].detach().unbind(0)
            for expert, view in zip(self.local_experts, views):
                expert._modules[linear]._parameters[attr] = view
        try:
            yield
        finally:
            for name in self.single_names:
                linear, attr = name.split(".")
                for expert in self.local_experts:
                    expert._modules[linear]._parameters[attr] = None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """SequentialMLP's checkpoint layout (checkpoints move between the loop, the grouped and the
        single-weight experts). megatron-core's optimizers find a parameter's checkpoint entry by
        its ``data`` (one entry per parameter): each stacked parameter is one ShardedTensorFactory
        that builds megatron-core's own per-expert entries from slices of whatever tensor it holds
        (the parameter, or an optimizer state of its shape) and stacks them again at load."""
        if not self.single_names:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        with self._per_expert_views():
            out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name in self.single_names:
            linear, attr = name.split(".")
            entries = [out.pop(f"{prefix}local_experts.{i}.{name}")
                       for i in range(self.num_local_experts)]
            out[f"{prefix}{name}"] = _expert_stack_factory(
                self._modules[linear]._parameters[attr], entries)
        return out


def _expert_stack_factory(param, entries):
    """One ShardedTensorFactory for a stacked expert parameter: ``entries`` are megatron-core's
    per-expert checkpoint entries (ShardedTensors, or its SwiGLU factories) of the slices; built on
    ``data`` (the parameter, or an optimizer state of its shape, whose key megatron-core prefixes)
    from ``data``'s slices, merged at load by each entry's own merge then a stack."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    base = entries[0].key

    def build(key, data, replica_id, flattened_range):
        if flattened_range is not None:
            raise NotImplementedError(f"{SINGLE_WEIGHT}: flattened checkpoint ranges ({key})")
        # megatron-core re-keys a factory by prefix only (a layer's "decoder.layers.0." becomes
        # "decoder.layers." once the layer axis is in the offsets; an optimizer state gets
        # "optimizer.state.exp_avg."): the entries get the same prefix change
        old, new = _prefix_change(base, key)
        out = []
        for entry, part in zip(entries, data.unbind(0)):
            entry_key = new + entry.key[len(old):]
            if isinstance(entry, ShardedTensorFactory):
                out.append(replace(entry, key=entry_key, data=part, replica_id=replica_id).build())
            else:
                out.append(replace(entry, key=entry_key, data=part, dtype=part.dtype,
                                   replica_id=replica_id))
        return out

    def merge(parts):
        with torch.no_grad():
            return torch.stack([entry.merge_fn(part) if isinstance(entry, ShardedTensorFactory)
                                else part for entry, part in zip(entries, parts)])

    return ShardedTensorFactory(base, param, build, merge, replica_id=entries[0].replica_id)


def _prefix_change(before: str, after: str) -> tuple:
    """(old, new) with ``after == new + before[len(old):]``: the prefixes left when the longest
    common suffix of the two keys is taken off."""
    n = 0
    while n < min(len(before), len(after)) and before[-1 - n] == after[-1 - n]:
        n += 1
    return before[:len(before) - n], after[:len(after) - n]


def _per_expert_state_dict(module, state_dict, prefix, local_metadata):
    """``state_dict()`` post-hook: the stacked parameters under SequentialMLP's per-expert keys."""
    for name in module.single_names:
        stacked_value = state_dict.pop(prefix + name)
        for i, part in enumerate(stacked_value.unbind(0)):
            state_dict[f"{prefix}local_experts.{i}.{name}"] = part


def _shells_state_dict(module, state_dict, prefix, local_metadata):
    """``state_dict()`` post-hook of a layer whose per-expert MLPs are out of the module tree: their
    entries, as if they were in it."""
    module.local_experts.state_dict(destination=state_dict, prefix=prefix + "local_experts.")


def _load_shells(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs):
    """``load_state_dict()`` pre-hook of a layer whose per-expert MLPs are out of the module tree:
    their entries loaded into them, what they miss or do not expect reported as torch would if they
    were in it (after :func:`_stacked_state_dict` took the stacked parameters' keys)."""
    head = prefix + "local_experts."
    shell_state = {key[len(head):]: state_dict.pop(key)
                   for key in [key for key in state_dict if key.startswith(head)]}
    result = module.local_experts.load_state_dict(shell_state, strict=False)
    missing_keys.extend(head + key for key in result.missing_keys)
    unexpected_keys.extend(head + key for key in result.unexpected_keys)


def _stacked_state_dict(module, state_dict, prefix, *unused):
    """``load_state_dict()`` pre-hook: SequentialMLP's per-expert keys stacked into the parameter's
    (a state dict with the stacked key is loaded as it is)."""
    for name in module.single_names:
        keys = [f"{prefix}local_experts.{i}.{name}" for i in range(module.num_local_experts)]
        if prefix + name not in state_dict and all(k in state_dict for k in keys):
            state_dict[prefix + name] = torch.stack([state_dict.pop(k) for k in keys])


def _aligned(t):
    """grouped_mm needs a contiguous operand starting on a 16-byte boundary (TMA loads); a slice of
    a larger buffer (a chunk of the permuted tokens) may start anywhere: copied then."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def recompute_activation(args) -> bool:
    """--recompute-modules moe_act on the local grouped path: recomputed here, not by megatron-core."""
    return local_grouped(args) and "moe_act" in (getattr(args, "recompute_modules", None) or ())


def customize_spec(args, spec):
    """The feature's spec edit (megatron_moe/features.py): SequentialMLP experts ->
    GroupedSequentialMLP under --moe-grouped-gemm on the local path."""
    if not local_grouped(args):
        return spec
    import dataclasses

    from megatron_moe.compat import replace_spec, spec_module, spec_submodules

    for layer in getattr(spec, "layer_specs", None) or [spec]:
        mlp = getattr(getattr(layer, "submodules", None), "mlp", None)
        sub = spec_submodules(mlp)
        experts = getattr(sub, "experts", None)
        if experts is None:
            continue  # a dense layer
        if spec_module(experts) is GroupedSequentialMLP:  # a spec shared with a previous layer
            continue
        if spec_module(experts) is not SequentialMLP:
            raise ValueError(f"{FLAG}: the experts are {spec_module(experts)}, not megatron-core's "
                             "SequentialMLP")
        params = {"recompute_activation": True} if recompute_activation(args) else {}
        weight, bias = single_grouped(args)
        params.update({"single_weight": True} if weight else {})
        params.update({"single_bias": True} if bias else {})
        layer.submodules.mlp = replace_spec(mlp, submodules=dataclasses.replace(
            sub, experts=replace_spec(experts, module=GroupedSequentialMLP, **params)))
    return spec   # a pipeline or virtual stage may hold dense layers only: nothing to swap
