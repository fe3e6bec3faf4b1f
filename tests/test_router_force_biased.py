"""--moe-router-force-biased (Megatron-LM's benchmarking flag, megatron-core >= 0.19): a random
per-expert bias on the router logits, the same on every rank (drawn from the data-parallel RNG
stream), fixed per layer when negative. In the real pretrain() loop on 2 gloo ranks (data
parallel): with a large fixed bias the tokens concentrate on a few experts (the routed load per
expert recorded from megatron-core's routing map), the same experts on both ranks; without the flag
the load stays near uniform. Mutation: the value not handed to megatron-core's config (the load is
then as without it). On megatron-core 0.16 the flag is refused with one line."""

import pytest

from megatron_moe.compat.versions import mcore_at_least
from megatron_moe.runtime.local_ranks import run_distributed


def _argv(*extra):
    return ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 256 --num-experts 8 "
            "--moe-ffn-hidden-size 16 --moe-router-topk 2 --disable-bias-linear "
            "--moe-token-dispatcher-type alltoall --log-interval 1 --eval-interval 1000 "
            "--eval-iters 1 --train-iters 2").split() + list(extra)


def _loads(rank, world, runs, mutate):
    """Tokens routed to each expert per run (summed over layers, micro-batches, iterations)."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_moe.models import builder
    from tests._train_cases import _pretrain

    out = []
    orig_routing, orig_config = TopKRouter.routing, builder.transformer_config_from_args
    for argv in runs:
        load = torch.zeros(8)

        def routing(self, logits, *args, **kwargs):
            probs, routing_map = orig_routing(self, logits, *args, **kwargs)
            if self.training:
                load.add_(routing_map.sum(0).float().cpu())
            return probs, routing_map

        def config_without_bias(args, *a, **k):
            config = orig_config(args, *a, **k)
            config.moe_router_force_biased = None
            return config
        TopKRouter.routing = routing
        if mutate:
            builder.transformer_config_from_args = config_without_bias
        try:
            _pretrain(argv)
        finally:
            TopKRouter.routing, builder.transformer_config_from_args = orig_routing, orig_config
        out.append(load.tolist())
    return out


@pytest.mark.skipif(not mcore_at_least("0.19"), reason="megatron-core >= 0.19's router")
@pytest.mark.parametrize("mutate", [False, True])
def test_force_biased_routes_the_same_skew_on_every_rank(mutate):
    out = run_distributed(_loads, 2, [_argv(), _argv("--moe-router-force-biased", "-20")], mutate,
                          timeout_s=400)
    skew = lambda load: max(load) / (sum(load) / len(load))   # noqa: E731
    plain, biased = out[0]
    assert sum(plain) == sum(biased) > 0
    assert skew(plain) < 2.0, plain
    if mutate:
        assert skew(biased) < 2.0, biased
        return
    # a fixed bias of std 20 dwarfs the logits: top-2 of 8 puts (nearly) every token of a layer
    # on the same two experts (at most 4x the mean; near uniform: ~1.4)
    assert skew(biased) > 2.5, biased
    used = lambda load: {e for e in range(8) if load[e] > 0}   # noqa: E731
    assert len(used(biased)) <= 4 and used(out[1][1]) == used(biased)   # same experts, both ranks


@pytest.mark.skipif(mcore_at_least("0.19"), reason="refused where megatron-core lacks it")
def test_force_biased_is_refused_on_megatron_core_016(capsys):
    from megatron_moe.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(_argv("--moe-router-force-biased", "1.0"), world_size=2)
    assert "--moe-router-force-biased needs megatron-core >= 0.19" in capsys.readouterr().err
