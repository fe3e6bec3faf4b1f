"""The core attention MLA runs on without Transformer Engine: unequal q/k and v head dims.

Checked against a plain softmax(Q K^T * scale + causal mask) V in float64, with MLA's YaRN softmax
scale; a mutation (the parent's output sizing, a wrong scale) makes it fail, and megatron-core's
own local DotProductAttention cannot be built with MLA's keywords at all.
"""

import math

import pytest
import torch

HEADS, SQ, B, DK, DV = 4, 7, 2, 12, 6


@pytest.fixture(scope="module")
def tp1():
    """A 1-rank model-parallel state (the attention asks for its TP group)."""
    import datetime
    import os

    import torch.distributed as dist

    from megatron_moe.compat import apply_cpu_shims
    from megatron_moe.runtime.local_ranks import free_port

    apply_cpu_shims()
    from megatron.core import parallel_state

    created = not dist.is_initialized()
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    if created:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
    parallel_state.initialize_model_parallel()
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)   # the dropout region forks its RNG state
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()
    # the rendezvous variables must not leak into later tests' subprocesses (a server started
    # by tests/test_server_completions.py inherited this port and failed with EADDRINUSE)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _config(**kw):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=HEADS, kv_channels=4,
        attention_dropout=0.0, params_dtype=torch.float64, use_cpu_initialization=True,
        masked_softmax_fusion=False, q_lora_rank=8, kv_lora_rank=8, qk_head_dim=DK - 4,
        qk_pos_emb_head_dim=4, v_head_dim=DV, **kw)


def _reference(q, k, v, scale):
    """softmax(Q K^T * scale, causal) V per (batch, head); q/k [s, b, h, DK], v [s, b, h, DV]."""
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    causal = torch.triu(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool), diagonal=1)
    probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
    out = torch.einsum("bhqk,kbhd->qbhd", probs, v)
    return out.reshape(q.shape[0], q.shape[1], -1)


def _build(config, scale):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_moe.models.attention import UnequalHeadDotProductAttention

    return UnequalHeadDotProductAttention(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
        attention_type="self", softmax_scale=scale, k_channels=DK, v_channels=DV)


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(SQ, B, HEADS, DK, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(SQ, B, HEADS, DK, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(SQ, B, HEADS, DV, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


def _mla_scale(factor=40.0, mscale_all_dim=0.707):
    """MLA's softmax scale: yarn mscale(factor, mscale_all_dim)^2 / sqrt(q head dim)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_mscale

    m = _yarn_get_mscale(factor, mscale_all_dim)
    assert m != 1.0
    return m * m / math.sqrt(DK)


def test_matches_plain_softmax_attention_float64(tp1):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    scale = _mla_scale()
    attn = _build(_config(), scale)
    calls = []
    handle = attn.register_forward_hook(lambda *a: calls.append(1))
    q, k, v = _qkv()
    out = attn(q, k, v, attention_mask=None)
    handle.remove()
    assert calls == [1]
    assert out.shape == (SQ, B, HEADS * DV)
    ref = _reference(q, k, v, scale)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # gradients agree too (training runs through it)
    grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # the default scale is 1/sqrt(q/k head dim), not 1/sqrt(kv_channels)
    plain = _build(_config(), None)
    torch.testing.assert_close(plain(q, k, v, None), _reference(q, k, v, 1 / math.sqrt(DK)),
                               rtol=1e-12, atol=1e-12)
    # megatron-core's local attention has no k_channels/v_channels (why this module exists)
    with pytest.raises(TypeError):
        DotProductAttention(config=_config(), layer_number=1, attn_mask_type=attn.attn_mask_type,
                            attention_type="self", k_channels=DK, v_channels=DV)


def test_mutations_fail(tp1, monkeypatch):
    """A wrong scale, or the parent's kv_channels-based output size, does not pass the check."""
    q, k, v = _qkv(1)
    scale = _mla_scale()
    wrong_scale = _build(_config(), 1 / math.sqrt(DK))   # the scale without mscale
    assert not torch.allclose(wrong_scale(q, k, v, None), _reference(q, k, v, scale))
    attn = _build(_config(), scale)
    attn.hidden_size_per_partition = 4 * HEADS   # the parent's kv_channels x heads
    with pytest.raises(RuntimeError):
        attn(q, k, v, None)
    # wrong head dims are refused with the dims named
    with pytest.raises(ValueError, match="head dims"):
        _build(_config(), scale)(v, k, v, None)


def test_layer_norm_column_parallel_linear_is_norm_then_linear(tp1):
    """The local fused norm + linear megatron-core >= 0.19 asks for (MLA's query projection with
    --qk-layernorm and no query LoRA): RMSNorm with its weight, then the linear, in float64."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_moe.models.attention import LayerNormColumnParallelLinear

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4,
                               params_dtype=torch.float64, use_cpu_initialization=True,
                               normalization="RMSNorm", layernorm_epsilon=1e-6)
    lin = LayerNormColumnParallelLinear(16, 24, config=config, init_method=torch.nn.init.normal_,
                                        bias=False, gather_output=False, skip_bias_add=False,
                                        is_expert=False, name="q_proj")
    with torch.no_grad():
        lin.layer_norm_weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 2, 16, dtype=torch.float64)
    out, _ = lin(x)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * lin.layer_norm_weight
    torch.testing.assert_close(out, ref @ lin.weight.t(), rtol=1e-12, atol=1e-12)
    # mutation: without the norm the output differs
    assert not torch.allclose(out, x @ lin.weight.t())
    assert {n for n, _ in lin.named_parameters()} == {"weight", "layer_norm_weight"}
