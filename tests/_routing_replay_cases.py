"""Rank function for tests/test_routing_replay.py (spawned by run_distributed)."""

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --lr 3e-3 --train-iters 1 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 256 --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
        "--disable-bias-linear --moe-enable-routing-replay").split()


def run(rank, world_size, mutate=None):
    """The model built from the flags; one forward recording the routers' top-k choices, the
    router weights redrawn, one forward free (the choices move), one replaying the recording.
    Returns the routing maps of the three passes (per router, as lists) and the number of
    RouterReplay instances megatron-core created."""
    import pretrain_gpt_moe
    import torch
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from megatron_moe.arguments import parse_args
    from megatron_moe.models.builder import get_model
    from megatron_moe.runtime import global_vars
    from megatron_moe.runtime.initialize import initialize_distributed
    from megatron_moe.training.loop import _build_tokenizer

    if mutate == "not_in_config":   # the flag parsed but never reaches TransformerConfig
        from megatron_moe.models import builder

        real = builder.transformer_config_from_args

        def dropped(args, *a, **k):
            config = real(args, *a, **k)
            config.moe_enable_routing_replay = False
            return config

        builder.transformer_config_from_args = dropped
    args = parse_args(TINY)
    global_vars.set_args(args)
    initialize_distributed(args)
    _build_tokenizer(args)
    RouterReplay.clear_global_router_replay_instances()   # this process's model only
    model = get_model(pretrain_gpt_moe.model_provider, args)[0]
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    maps = []
    for router in routers:
        router.register_forward_hook(lambda mod, inp, out: maps.append(out[1].clone()))
    torch.manual_seed(1)
    tokens = torch.randint(0, 256, (2, 16))
    position_ids = torch.arange(16).unsqueeze(0).expand(2, -1)

    def forward():
        maps.clear()
        with torch.no_grad():
            model(tokens, position_ids, None)
        return [m.int().tolist() for m in maps]

    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    recorded_maps = forward()
    recorded = [t.clone() for t in RouterReplay.get_recorded_data()]
    with torch.no_grad():   # new router weights: the free choices move
        for router in routers:
            router.weight.normal_()
    RouterReplay.clear_global_router_replay_action()
    free_maps = forward()
    RouterReplay.set_replay_data(recorded)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    replayed_maps = forward()
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_indices()
    return {"routers": len(routers), "instances": len(RouterReplay.global_router_replay_instances),
            "recorded": recorded_maps, "free": free_maps, "replayed": replayed_maps}
