"""Rank functions for tests/test_topo_router.py (spawned by megatron_moe.runtime.local_ranks.run_distributed)."""


def run_pretrain_topology(rank, world_size, argv):
    """Run the real pretrain() with stdout captured; also record, from every router call, the
    largest number of nodes one token's experts span and this rank's own cross-node share."""
    import contextlib
    import io
    import sys

    import torch
    from megatron.core.transformer.moe.router import Router

    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe.training.loop import pretrain

    seen = {"max_nodes_per_token": 0, "off_node": 0, "assignments": 0, "calls": 0}

    def record(module, inputs, outputs):
        if not isinstance(module, Router) or not getattr(module, "layout", None):
            return
        layout = module.layout
        routing_map = outputs[1].detach().reshape(-1, outputs[1].shape[-1])
        experts_per_node = routing_map.shape[1] // layout.nodes
        nodes = routing_map.view(-1, layout.nodes, experts_per_node).any(-1).sum(-1)
        off = layout.expert_nodes(routing_map.shape[1]) != layout.my_node
        seen["max_nodes_per_token"] = max(seen["max_nodes_per_token"], int(nodes.max()))
        seen["off_node"] += int(routing_map[:, off].sum())
        seen["assignments"] += int(routing_map.sum())
        seen["calls"] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            result = pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                              pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                              pretrain_gpt_moe.forward_step, argv=argv)
    finally:
        handle.remove()
        sys.stdout.write(out.getvalue())
    return {"history": result["history"], "stdout": out.getvalue(), **seen}
