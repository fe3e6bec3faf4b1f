"""Rank functions for tests/test_gpt_oss.py (spawned by megatron_moe.runtime.local_ranks.run_distributed)."""


def train_and_probe_rank(rank, world_size, argv):
    """pretrain() with pretrain_gpt_moe.py's provider, wrapped to watch the gpt-oss parts of the
    model it builds: every sink parameter's gradients (a hook) and values before/after training;
    then each layer's core attention probed directly (window and sinks)."""
    import torch

    import pretrain_gpt_moe
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_moe.training.loop import pretrain

    built, grads, before = [], {}, {}

    def provider(*a, **k):
        model = pretrain_gpt_moe.model_provider(*a, **k)
        for name, p in model.named_parameters():
            if name.endswith("core_attention.softmax_offset"):
                before[name] = p.detach().clone()
                grads[name] = []
                p.register_hook(lambda g, name=name: grads[name].append(float(g.abs().sum())))
        built.append(model)
        return model

    result = pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider, provider,
                      ModelType.encoder_or_decoder, pretrain_gpt_moe.forward_step, argv=argv)
    (model,) = built
    after = {n: p.detach().clone() for n, p in model.named_parameters() if n in before}
    probes = []
    g = torch.Generator().manual_seed(0)
    for layer in model.decoder.layers:
        ca = layer.self_attention.core_attention
        dtype = ca.softmax_offset.dtype
        heads, groups = ca.num_attention_heads_per_partition, ca.num_query_groups_per_partition
        s, d = 12, ca.hidden_size_per_attention_head
        q = torch.randn(s, 1, heads, d, generator=g).to(dtype)
        k = torch.randn(s, 1, groups, d, generator=g).to(dtype)
        v = torch.randn(s, 1, groups, d, generator=g).to(dtype)
        k2, v2 = k.clone(), v.clone()
        k2[0] += 3.0
        v2[0] += 3.0
        with torch.no_grad():
            out = ca(q, k, v, None, attn_mask_type=AttnMaskType.causal).float()
            moved = ca(q, k2, v2, None, attn_mask_type=AttnMaskType.causal).float()
            saved = ca.softmax_offset.detach().clone()
            ca.softmax_offset.fill_(30.0)   # a sink that takes (almost) all the attention
            sunk = ca(q, k, v, None, attn_mask_type=AttnMaskType.causal).float()
            ca.softmax_offset.copy_(saved)
        changed = ((out - moved).abs().amax(dim=(1, 2)) > 0).tolist()  # per query position
        probes.append(dict(layer=layer.layer_number, window=ca.scale_mask_softmax.window_size,
                           changed=changed, out_norm=float(out.norm()), sunk_norm=float(sunk.norm())))
    return dict(history=result["history"], grads=grads,
                moved={n: float((after[n].float() - before[n].float()).abs().max()) for n in before},
                probes=probes)
