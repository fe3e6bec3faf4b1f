"""SDPADotProductAttention (--attention-backend flash with --transformer-impl local) against
megatron-core's local DotProductAttention: same outputs and gradients (fp32 within 1e-5, bf16
within bf16 tolerance) for causal, GQA, MLA head dims, layer-scaled softmax, sinks, sliding
windows and BERT's padding mask; a call counter proves SDPA ran, and mutations of the SDPA call
(scale, mask, sink, head grouping) make the comparison fail.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.test_mla_attention import tp1  # noqa: F401  (the 1-rank model-parallel state)

S, B = 9, 2

# name -> (config overrides, build overrides, mask kind)
CASES = {
    "causal": (dict(), dict(), None),
    "gqa": (dict(num_query_groups=2), dict(), None),
    "mla-dims": (dict(mla=True), dict(softmax_scale=0.37), None),
    "layer-scaling": (dict(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True),
                      dict(layer_number=3), None),
    "sinks": (dict(softmax_type="learnable"), dict(), None),
    "off-by-one": (dict(softmax_type="off-by-one"), dict(), None),
    "window": (dict(window_size=(3, 0)), dict(), None),
    "window-sinks-gqa": (dict(window_size=(2, 0), softmax_type="learnable", num_query_groups=2),
                         dict(), None),
    "bert-padding": (dict(), dict(padding=True), "bert"),
    "bert-padding-gqa": (dict(num_query_groups=2), dict(padding=True), "bert"),
}


def _config(dtype, mla=False, **kw):
    from megatron.core.transformer.transformer_config import (MLATransformerConfig,
                                                              TransformerConfig)

    common = dict(num_layers=3, hidden_size=32, num_attention_heads=4, attention_dropout=0.0,
                  params_dtype=dtype, use_cpu_initialization=True, masked_softmax_fusion=False,
                  bf16=dtype == torch.bfloat16)
    if mla:
        return MLATransformerConfig(**common, q_lora_rank=8, kv_lora_rank=8, qk_head_dim=8,
                                    qk_pos_emb_head_dim=4, v_head_dim=6, **kw)
    return TransformerConfig(**common, **kw)


def _pair(name, dtype=torch.float32):
    """(megatron-core's local attention, ours) for a case, with the same sink parameters."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_moe.models.attention import (SDPADotProductAttention,
                                               UnequalHeadDotProductAttention)

    conf, build, _ = CASES[name]
    config = _config(dtype, **conf)
    kw = dict(config=config, layer_number=build.get("layer_number", 1),
              attn_mask_type=AttnMaskType.padding if build.get("padding") else AttnMaskType.causal,
              attention_type="self", softmax_scale=build.get("softmax_scale"))
    if conf.get("mla"):
        dims = dict(k_channels=12, v_channels=6)
        ref = UnequalHeadDotProductAttention(**kw, **dims)
        ours = SDPADotProductAttention(**kw, **dims)
    else:
        ref = DotProductAttention(**kw)
        ours = SDPADotProductAttention(**kw)
    if isinstance(ref.softmax_offset, torch.nn.Parameter):
        with torch.no_grad():
            ref.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=dtype))
            ours.softmax_offset.copy_(ref.softmax_offset)
    return ref, ours


def _inputs(name, ref, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads = ref.num_attention_heads_per_partition
    groups = ref.num_query_groups_per_partition
    dk = getattr(ref, "k_channels", ref.hidden_size_per_attention_head)
    dv = getattr(ref, "v_channels", ref.hidden_size_per_attention_head)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    q, k, v = rand(S, B, heads, dk), rand(S, B, groups, dk), rand(S, B, groups, dv)
    mask = None
    if CASES[name][2] == "bert":
        # megatron-core BertModel's extended mask: [b, 1, s, s], True where either token is
        # padding (so the padding queries' rows are masked entirely)
        valid = torch.ones(B, S)
        valid[0, 6:] = 0
        valid[1, 3:] = 0
        mask = (valid[:, None, :] * valid[:, :, None] < 0.5).unsqueeze(1)
    weights = torch.randn(S, B, heads * dv, generator=g).to(dtype)
    return q, k, v, mask, weights


def _run(attn, q, k, v, mask, weights):
    out = attn(q, k, v, mask)
    params = [p for p in attn.parameters()]
    grads = torch.autograd.grad((out.float() * weights.float()).sum(), (q, k, v, *params))
    return out, grads


def _compare(name, dtype, tol):
    ref, ours = _pair(name, dtype)
    q, k, v, mask, weights = _inputs(name, ref, dtype)
    want, want_grads = _run(ref, q, k, v, mask, weights)
    got, got_grads = _run(ours, q, k, v, mask, weights)
    assert got.shape == want.shape and len(got_grads) == len(want_grads)
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **tol)


FP32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=2e-2)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Counts the calls of torch's SDPA (the attention module calls it through F)."""
    calls = []
    real = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    return calls


@pytest.mark.parametrize("name", list(CASES))
def test_equals_megatron_local_attention_fp32(tp1, sdpa_calls, name):  # noqa: F811
    _compare(name, torch.float32, FP32)
    assert len(sdpa_calls) == 1   # the one forward of ours ran SDPA (the reference does not)
    kwargs = sdpa_calls[0]
    # the flash-eligible path (no mask, SDPA's causal, grouped heads) where the case allows it
    if name in ("causal", "gqa", "mla-dims", "layer-scaling"):
        assert kwargs["attn_mask"] is None and kwargs["is_causal"]
        assert kwargs["enable_gqa"] == (name == "gqa")
    else:
        assert kwargs["attn_mask"] is not None and not kwargs["is_causal"]


@pytest.mark.parametrize("name", ["causal", "gqa", "sinks", "window", "bert-padding"])
def test_equals_megatron_local_attention_bf16(tp1, sdpa_calls, name):  # noqa: F811
    _compare(name, torch.bfloat16, BF16)
    assert len(sdpa_calls) == 1


def _mutated(real, mutation):
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if mutation == "scale":
            scale = scale * 1.05
        elif mutation == "no-causal":
            is_causal = False
        elif mutation == "mask-ignored" and attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = None
        elif mutation == "sink-dropped" and attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.clone()
            attn_mask[..., -1] = float("-inf")
        elif mutation == "groups-tiled" and enable_gqa:
            # heads grouped as h % groups instead of megatron's h // (heads / groups)
            reps = q.shape[1] // k.shape[1]
            k, v, enable_gqa = k.repeat(1, reps, 1, 1), v.repeat(1, reps, 1, 1), False
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa)
    return sdpa


@pytest.mark.parametrize("name,mutation", [
    ("causal", "scale"), ("mla-dims", "scale"), ("causal", "no-causal"),
    ("window", "mask-ignored"), ("bert-padding", "mask-ignored"), ("sinks", "sink-dropped"),
    ("gqa", "groups-tiled")])
def test_mutation_breaks_equivalence(tp1, monkeypatch, name, mutation):  # noqa: F811
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        _mutated(F.scaled_dot_product_attention, mutation))
    with pytest.raises(AssertionError):
        _compare(name, torch.float32, FP32)


def test_fully_masked_rows_take_megatrons_uniform_softmax(tp1, monkeypatch):  # noqa: F811
    """BERT's padding queries see no key: megatron-core's -10000 fill makes their softmax uniform
    (output = mean of V). Without the fix-up (SDPA's own result there) the outputs differ."""
    from megatron_moe.models.attention import SDPADotProductAttention

    _compare("bert-padding", torch.float32, FP32)
    monkeypatch.setattr(SDPADotProductAttention, "_uniform_rows",
                        staticmethod(lambda out, v, dead: out))
    with pytest.raises(AssertionError):
        _compare("bert-padding", torch.float32, FP32)


def test_dropout_in_training_only(tp1, sdpa_calls):  # noqa: F811
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_moe.models.attention import SDPADotProductAttention

    attn = SDPADotProductAttention(config=_config(torch.float32), layer_number=1,
                                   attn_mask_type=AttnMaskType.causal, attention_type="self",
                                   attention_dropout=0.5)
    ref, _ = _pair("causal")
    q, k, v, _, _ = _inputs("causal", ref, torch.float32)
    attn.train()
    dropped = attn(q, k, v, None)
    attn.eval()
    kept = attn(q, k, v, None)
    assert [c["dropout_p"] for c in sdpa_calls] == [0.5, 0.0]
    torch.testing.assert_close(kept, ref(q, k, v, None), **FP32)
    assert not torch.allclose(dropped, kept)


def test_refuses_what_the_local_attention_refuses(tp1):  # noqa: F811
    ref, ours = _pair("causal")
    q, k, v, _, _ = _inputs("causal", ref, torch.float32)
    with pytest.raises(ValueError, match="packed sequences"):
        ours(q, k, v, None, packed_seq_params=object())
    with pytest.raises(ValueError, match="attention_bias"):
        ours(q, k, v, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="as many queries as keys"):
        ours(q[:4], k, v, None)


@pytest.mark.parametrize("backend,impl,cuda,want", [
    ("flash", "local", False, True), ("auto", "local", False, False),
    ("auto", "local", True, True), ("local", "local", True, False),
    ("unfused", "local", True, False), ("flash", "transformer_engine", True, False)])
def test_backend_selection(monkeypatch, backend, impl, cuda, want):
    import argparse

    from megatron_moe.models import attention

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    args = argparse.Namespace(attention_backend=backend, transformer_impl=impl)
    assert attention.use_sdpa(args) is want


def test_spec_swaps_core_attention(tp1):  # noqa: F811
    """--attention-backend flash puts SDPA in every layer's core_attention slot (MLA too);
    auto on CPU leaves megatron-core's local attention (and MLA's unequal-head one)."""
    import argparse

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_moe.models.attention import (SDPADotProductAttention,
                                               UnequalHeadDotProductAttention, customize_spec)

    def cores(backend, mla):
        config = _config(torch.float32, mla=mla, num_moe_experts=4, moe_ffn_hidden_size=16)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        args = argparse.Namespace(attention_backend=backend, transformer_impl="local",
                                  multi_latent_attention=mla, q_lora_rank=8)
        spec = customize_spec(args, spec)
        return {layer.submodules.self_attention.submodules.core_attention
                for layer in spec.layer_specs}

    if not torch.cuda.is_available():
        assert cores("auto", False) == {DotProductAttention}
        assert cores("auto", True) == {UnequalHeadDotProductAttention}
    assert cores("flash", False) == {SDPADotProductAttention}
    assert cores("flash", True) == {SDPADotProductAttention}
    assert cores("local", True) == {UnequalHeadDotProductAttention}


def test_mla_scale_is_the_mscale_one(tp1):  # noqa: F811
    """MLA's softmax_scale (mscale^2 / sqrt(q head dim)) reaches SDPA unchanged."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_moe.models.attention import SDPADotProductAttention

    attn = SDPADotProductAttention(config=_config(torch.float32, mla=True), layer_number=1,
                                   attn_mask_type=AttnMaskType.causal, attention_type="self",
                                   softmax_scale=1.3 ** 2 / math.sqrt(12), k_channels=12,
                                   v_channels=6)
    q = torch.randn(S, B, 4, 12)
    v = torch.randn(S, B, 4, 6)
    out = attn(q, q, v, None)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, q) * (1.3 ** 2 / math.sqrt(12))
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v).reshape(S, B, -1)
    torch.testing.assert_close(out, ref, **FP32)


@pytest.mark.parametrize("window", ["-1,0", "3,-1"])
def test_unlimited_window_side_refused_on_the_local_path(window, capsys):
    """megatron-core's local window mask reads -1 literally (-1,0 keeps no key, 3,-1 drops the
    diagonal); TE's -1 means unlimited: refused at parse time on the local path."""
    from megatron_moe.arguments import parse_args
    from tests.test_flags import BASE

    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + ["--transformer-impl", "local", f"--window-size={window}"], world_size=1)
    assert exc.value.code == 2
    assert "--window-size with -1 (unlimited) needs --transformer-impl transformer_engine" \
        in capsys.readouterr().err
    args = parse_args(BASE + ["--transformer-impl", "local", "--window-size", "3,0"], world_size=1)
    assert args.window_size == (3, 0)
