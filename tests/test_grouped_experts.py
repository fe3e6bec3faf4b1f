"""--moe-grouped-gemm on the local path (megatron_moe/moe/grouped_experts.py; alias
--moe-torch-grouped-gemm): the experts as two torch grouped GEMMs per layer. In the real pretrain()
loop on 2 gloo ranks with EP=2 (2 local experts each), SwiGLU, bf16: losses and grad norms equal
megatron-core's SequentialMLP loop bit for bit, the grouped path ran (its call counter) and added
the expert weight gradients into DDP's main_grad itself (a counter; marking them added without
adding breaks the equality), a
checkpoint written by the grouped run resumes under the loop with the straight run's numbers and one
written by the loop resumes under the grouped experts (same parameters and layout), the same holds inside the
chunked MoE layer (--moe-a2a-overlap-degree 2), and a planted fault (each expert's token group
shifted by one row) breaks the equality. Plus the parse-time refusals."""

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _grouped_cases as G


def _argv(iters, *extra):
    return ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 1 "
            "--mock-data --tokenizer-type NullTokenizer --vocab-size 256 --num-experts 4 "
            "--moe-ffn-hidden-size 16 --moe-router-topk 2 --swiglu --bf16 "
            "--moe-token-dispatcher-type alltoall --log-interval 1 --eval-interval 1000 "
            "--eval-iters 1 --disable-bias-linear --expert-model-parallel-size 2 "
            f"--train-iters {iters}").split() + list(extra)


def test_grouped_experts_equal_the_loop_and_share_its_checkpoints(tmp_path):
    g = "--moe-grouped-gemm"
    ck, ck2 = str(tmp_path / "ck"), str(tmp_path / "ck2")
    runs = [_argv(4),                                                  # 0 loop
            _argv(4, g),                                               # 1 grouped
            _argv(4, g, "--save", ck, "--exit-interval", "2"),         # 2 grouped 1-2, saved
            _argv(4, "--load", ck),                                    # 3 loop 3-4 from it
            _argv(2, g),                                               # 4 planted fault
            _argv(2, "--moe-a2a-overlap-degree", "2"),                 # 5 chunked layer, loop
            _argv(2, g, "--moe-a2a-overlap-degree", "2"),              # 6 chunked layer, grouped
            _argv(4, "--save", ck2, "--exit-interval", "2"),           # 7 loop 1-2, saved
            _argv(4, "--moe-torch-grouped-gemm", "--load", ck2),       # 8 grouped (alias) 3-4 from it
            _argv(3, g)]                                               # 9 wgrads marked, not added
    out = run_distributed(G.run_counted, 2, runs, None, {4: "shift", 9: "wgrad_not_added"},
                          timeout_s=560)
    r = out[-1]
    h = lambda k, key="lm_loss": r[k]["history"][key]
    assert len(h(0)) == 4 and all(x == x for x in h(0))
    assert h(1) == h(0) and h(1, "grad_norm") == h(0, "grad_norm")
    assert h(2) == h(0)[:2] and h(3) == h(0)[2:] and h(3, "grad_norm") == h(0, "grad_norm")[2:]
    assert h(7) == h(0)[:2] and h(8) == h(0)[2:] and h(8, "grad_norm") == h(0, "grad_norm")[2:]
    # 2 layers x 2 micro-batches (global 8 / micro 2 / DP 2) per step; a run that completes
    # (not at --exit-interval) then evaluates one batch each of the validation and test sets
    for rank_out in out:
        assert rank_out[0]["grouped_calls"] == 0 and rank_out[3]["grouped_calls"] == 0
        assert rank_out[7]["grouped_calls"] == 0
        assert rank_out[1]["grouped_calls"] == 2 * 2 * (4 + 2)
        assert rank_out[2]["grouped_calls"] == 2 * 2 * 2 and rank_out[4]["grouped_calls"] > 0
        assert rank_out[8]["grouped_calls"] == 2 * 2 * (2 + 2)
        # the weight gradients went into DDP's main_grad from the grouped backward (2 local
        # experts x 2 linears x 2 layers x 2 micro-batches x 4 steps), not through DDP's hook
        assert rank_out[1]["wgrads_into_main_grad"] == 2 * 2 * 2 * 2 * 4
    # marked as added but not added: the expert gradients are missing from the norm and the update
    assert h(9, "grad_norm")[0] != h(0, "grad_norm")[0] and h(9)[2] != h(0)[2]
    assert h(4) != h(0)[:2]
    # the chunked layer calls the experts once per chunk: the loop's weight gradients of the two
    # chunks are summed in bf16 by autograd before DDP adds them to the fp32 main_grad; the grouped
    # backward adds each chunk's into main_grad itself (megatron-core's gradient-accumulation
    # fusion does the same): equal within fp32 rounding, not bit for bit
    assert h(6) == h(5) and r[6]["grouped_calls"] > 0
    assert h(6, "grad_norm") == pytest.approx(h(5, "grad_norm"), rel=1e-6)


def test_local_grouped_gemm_keeps_megatron_cores_config_flag_off():
    """On the local path --moe-grouped-gemm must not reach megatron-core's TransformerConfig (its
    0.16 local spec would build the legacy GroupedMLP, which needs the grouped_gemm package): the
    spec keeps SequentialMLP and our hook swaps in GroupedSequentialMLP."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_moe import arguments
    from megatron_moe.compat import spec_module, spec_submodules
    from megatron_moe.models.builder import transformer_config_from_args
    from megatron_moe.moe.grouped_experts import GroupedSequentialMLP, customize_spec

    for flag in ("--moe-grouped-gemm", "--moe-torch-grouped-gemm"):
        args = arguments.parse_args(_argv(2, flag), world_size=2)
        assert args.moe_grouped_gemm and args.transformer_impl == "local"
        config = transformer_config_from_args(args)
        assert config.moe_grouped_gemm is False
        spec = customize_spec(args, get_gpt_layer_local_spec(
            num_experts=4, moe_grouped_gemm=config.moe_grouped_gemm))
        experts = spec_submodules(spec.submodules.mlp).experts
        assert spec_module(experts) is GroupedSequentialMLP


@pytest.mark.parametrize("flag", ["--moe-grouped-gemm", "--moe-torch-grouped-gemm"])
@pytest.mark.parametrize("extra, message", [
    ("--moe-ffn-hidden-size 24 --expert-tensor-parallel-size 2 --tensor-model-parallel-size 2 "
     "--sequence-parallel", "--moe-ffn-hidden-size (per expert-tensor-parallel rank) a multiple of 8"),
    ("--hidden-size 36 --num-attention-heads 4", "--hidden-size (per expert-tensor-parallel rank) a multiple of 8"),
])
def test_refusals(flag, extra, message, capsys):
    from megatron_moe import arguments

    argv = _argv(2, flag, *extra.split())
    with pytest.raises(SystemExit):
        arguments.parse_args(argv, world_size=4)
    err = capsys.readouterr().err
    assert flag in err and message in err, err


def test_a_misaligned_chunk_is_copied_for_grouped_mm():
    """A chunk of the permuted tokens (a slice at a row offset) need not start on the 16 bytes
    grouped_mm's CUDA path requires (its TORCH_CHECK "expected data_ptr to be aligned to 16 bytes";
    the CPU path does not check): _aligned copies exactly those, and the result equals the
    per-expert matmuls."""
    import torch

    from megatron_moe.moe.grouped_experts import _aligned

    buf = torch.randn(17 * 8 + 1, dtype=torch.bfloat16)
    x = buf[1:].view(17, 8)                     # 2 bytes past an aligned start
    w = torch.randn(2, 8, 8, dtype=torch.bfloat16)
    offs = torch.tensor([5, 17], dtype=torch.int32)
    assert x.data_ptr() % 16 != 0
    a = _aligned(x)
    assert a.data_ptr() % 16 == 0 and torch.equal(a, x)
    out = torch.nn.functional.grouped_mm(a, w, offs=offs)
    assert torch.equal(out, torch.cat([x[:5] @ w[0], x[5:] @ w[1]]))
    y = torch.randn(16, 8, dtype=torch.bfloat16)
    assert _aligned(y) is y                     # aligned and contiguous: no copy


# ops that only make a new tensor header (no kernel): autograd hands each parameter its grad through
# a detach, one per parameter in the loop and the grouped path alike
_NO_KERNEL = {"detach", "alias", "view", "_unsafe_view", "t", "transpose", "select", "slice",
              "unbind", "expand", "as_strided", "unsqueeze", "squeeze", "permute"}


class _CountOps:
    """Counts the aten ops dispatched that launch a kernel on a device, while active."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket.__name__ not in _NO_KERNEL:
                    ops.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _grouped_ops(num_experts):
    """aten ops of grouped_mlp forward + backward (SwiGLU, biases) over ``num_experts`` groups."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_moe.moe.grouped_experts import _Given, grouped_mlp

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=True)
    act = MLP.__new__(MLP)                     # the activation part only (no process group needed)
    torch.nn.Module.__init__(act)
    act.config, act.activation_func = cfg, F.silu
    act.linear_fc1, act.linear_fc2 = _Given(), _Given()
    h, f = 16, 8
    counts = torch.randint(0, 6, (num_experts,))
    n = int(counts.sum())
    x = torch.randn(n, h, requires_grad=True)
    probs = torch.rand(n)
    w1 = [torch.randn(2 * f, h, requires_grad=True) for _ in range(num_experts)]
    w2 = [torch.randn(h, f, requires_grad=True) for _ in range(num_experts)]
    b1 = [torch.randn(2 * f, requires_grad=True) for _ in range(num_experts)]
    b2 = [torch.randn(h, requires_grad=True) for _ in range(num_experts)]
    with _CountOps() as c:
        grouped_mlp(act, x, probs, counts, w1, w2, b1, b2).sum().backward()
    assert all(w.grad is not None for w in w1 + w2 + b1 + b2)
    return sorted(c.ops)


@pytest.mark.parametrize("mutate", [False, True])
def test_grouped_launches_do_not_grow_with_experts(monkeypatch, mutate):
    """The same aten ops (kernel launches) for 4 and 16 experts, forward and backward; the expert
    loop (one linear per group, as megatron-core's SequentialMLP) grows with them."""
    import torch

    from megatron_moe.moe import grouped_experts as G

    if mutate:
        class Loop:
            @staticmethod
            def apply(x, offs, *weights):
                starts = [0] + offs.tolist()[:-1]
                return torch.cat([x[s:e] @ w.t() for s, e, w in zip(starts, offs.tolist(), weights)])
        monkeypatch.setattr(G, "_GroupedLinear", Loop)
    few, many = _grouped_ops(4), _grouped_ops(16)
    assert (few == many) != mutate, (len(few), len(many))


@pytest.mark.parametrize("mutate", [False, True])
def test_moe_act_recompute_on_the_local_grouped_path(monkeypatch, mutate):
    """--recompute-modules moe_act with local grouped experts: the activation is recomputed in
    backward (it runs twice), outputs and gradients bit-equal to keeping it; mutation: checkpoint
    bypassed, the activation runs once and the recompute check fails."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_moe.moe import grouped_experts as G

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=True)
    act = MLP.__new__(MLP)
    torch.nn.Module.__init__(act)
    act.config, act.activation_func = cfg, F.silu
    act.linear_fc1, act.linear_fc2 = G._Given(), G._Given()
    calls = [0]
    real = G._activate

    def counting(*a):
        calls[0] += 1
        return real(*a)

    monkeypatch.setattr(G, "_activate", counting)
    if mutate:
        monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                            lambda fn, *a, use_reentrant=False: fn(*a))

    def run(recompute):
        torch.manual_seed(0)
        counts = torch.tensor([3, 0, 5, 2])
        x = torch.randn(10, 16, requires_grad=True)
        w1 = [torch.randn(16, 16, requires_grad=True) for _ in range(4)]
        w2 = [torch.randn(16, 8, requires_grad=True) for _ in range(4)]
        b1 = [torch.randn(16, requires_grad=True) for _ in range(4)]
        calls[0] = 0
        out = G.grouped_mlp(act, x, torch.rand(10), counts, w1, w2, b1,
                            recompute_activation=recompute)
        out.square().sum().backward()
        return out.detach(), [t.grad for t in [x] + w1 + w2 + b1], calls[0]

    kept, kept_grads, kept_calls = run(False)
    again, again_grads, again_calls = run(True)
    assert torch.equal(kept, again) and all(torch.equal(a, b) for a, b in zip(kept_grads, again_grads))
    assert kept_calls == 1
    assert (again_calls == 2) != mutate, again_calls


def test_moe_act_recompute_reaches_the_grouped_experts_not_megatron_cores_config():
    """Megatron's CI configs name --recompute-modules moe_act with --moe-grouped-gemm: on the local
    path megatron-core's config keeps it out (its check wants TE's grouped GEMM) and the grouped
    experts get it from the spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_moe import arguments
    from megatron_moe.compat import spec_submodules
    from megatron_moe.models.builder import transformer_config_from_args
    from megatron_moe.moe.grouped_experts import customize_spec

    args = arguments.parse_args(_argv(2, "--moe-grouped-gemm", "--recompute-granularity",
                                      "selective", "--recompute-modules", "moe_act", "core_attn"),
                                world_size=2)
    config = transformer_config_from_args(args)
    assert config.recompute_modules == ["core_attn"] and config.moe_grouped_gemm is False
    spec = customize_spec(args, get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False))
    experts = spec_submodules(spec.submodules.mlp).experts
    params = getattr(experts, "params", None) or getattr(experts, "keywords", {})
    assert params.get("recompute_activation") is True
