"""Rank functions for tests/test_megatron_flags.py (spawned by run_distributed)."""

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --lr 3e-3 --train-iters 2 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 256 --num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
        "--disable-bias-linear --expert-model-parallel-size 2").split()


def _model(argv):
    import pretrain_gpt_moe
    from megatron_moe.arguments import parse_args
    from megatron_moe.models.builder import get_model
    from megatron_moe.runtime import global_vars
    from megatron_moe.runtime.initialize import initialize_distributed
    from megatron_moe.training.loop import _build_tokenizer

    args = parse_args(TINY + argv)
    global_vars.set_args(args)
    initialize_distributed(args)
    _build_tokenizer(args)
    return get_model(pretrain_gpt_moe.model_provider, args)


def params_norm_rank(rank, world_size, mutate=None):
    """(our params_l2_norm, the norm by hand from every rank's full parameter list, weight-hash
    check on identical replicas, after one replica's dense weight is nudged)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.utils import check_param_hashes_across_dp_replicas

    from megatron_moe.training import megatron_logging

    model = _model([])
    if mutate == "expert_group":   # expert norms no longer summed over the EP ranks
        ps.get_expert_tensor_model_pipeline_parallel_group = ps.get_model_parallel_group
    ours = megatron_logging.params_l2_norm(model)
    # by hand: dense parameters are replicated (rank 0's copy), experts are split over EP ranks
    dense = sum(float((p.detach().double() ** 2).sum()) for n, p in model[0].named_parameters()
                if getattr(p, "allreduce", True))
    expert = torch.tensor(sum(float((p.detach().double() ** 2).sum())
                              for n, p in model[0].named_parameters()
                              if not getattr(p, "allreduce", True)), dtype=torch.float64)
    dist.all_reduce(expert)
    by_hand = (dense + float(expert)) ** 0.5
    same = check_param_hashes_across_dp_replicas(model, cross_check=True)
    if rank == 1:
        with torch.no_grad():
            next(p for p in model[0].parameters() if getattr(p, "allreduce", True)).add_(1e-3)
    differ = check_param_hashes_across_dp_replicas(model, cross_check=True)
    return ours, by_hand, same, differ
