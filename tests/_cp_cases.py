"""Rank functions for tests/test_context_parallel.py (spawned by run_distributed). ``mutate``
breaks the context parallelism inside the spawned rank; the test expects its comparison to fail."""


def _identity_chunk_order():
    """The gathered K/V chunks left in rank order (not put back in sequence order)."""
    import torch

    from megatron_moe.models import attention

    real = attention.cp_chunk_order
    attention.cp_chunk_order = lambda cp, device: torch.arange(2 * cp, device=device)
    return lambda: setattr(attention, "cp_chunk_order", real)


def _no_gather():
    """Each CP rank attends to its own keys only (the all-gather skipped)."""
    from megatron_moe.models.attention import SDPADotProductAttention

    real = SDPADotProductAttention._gather_cp
    SDPADotProductAttention._gather_cp = lambda self, t: t
    return lambda: setattr(SDPADotProductAttention, "_gather_cp", real)


def _upper_left():
    """The causal CP chunks aligned at the top left (SDPA's is_causal) instead of the bottom right:
    each chunk's queries lose the keys of the chunks before it."""
    import torch.nn.attention.bias as bias

    real = bias.causal_lower_right
    bias.causal_lower_right = bias.causal_upper_left
    return lambda: setattr(bias, "causal_lower_right", real)


def _no_cp_split():
    """get_batch hands every CP rank the whole sequence (megatron-core's split not called)."""
    import pretrain_gpt_moe

    real = pretrain_gpt_moe.batch_on_this_cp_rank
    pretrain_gpt_moe.batch_on_this_cp_rank = lambda batch, cp_group=None: batch
    return lambda: setattr(pretrain_gpt_moe, "batch_on_this_cp_rank", real)


def _local_token_mean():
    """The loss divided by this CP rank's own token count (not the whole sequences'): with the
    schedule's x cp, gradients cp times the CP=1 run's."""
    import torch

    import pretrain_gpt_moe
    from pretrain_gpt_moe import record_loss

    real = pretrain_gpt_moe.loss_func

    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.float().view(-1)
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
        record_loss(loss)
        return loss, {"lm loss": loss.detach().clone()}

    pretrain_gpt_moe.loss_func = loss_func
    return lambda: setattr(pretrain_gpt_moe, "loss_func", real)


MUTATIONS = {"local-token-mean": _local_token_mean, "identity-order": _identity_chunk_order, "no-gather": _no_gather,
             "no-cp-split": _no_cp_split, "upper-left": _upper_left}


def _attention(config, window=None):
    import copy

    from megatron.core.transformer.enums import AttnMaskType

    from megatron_moe.models.attention import SDPADotProductAttention

    config = copy.copy(config)
    config.window_size = window
    return SDPADotProductAttention(config, 1, AttnMaskType.causal, "self")


def attention_rank(rank, world_size, cases, mutate=None):
    """For each case (groups, window, documents per sequence or 0, sinks): this CP rank's attention output and q/k/v gradients against
    one rank's SDPA over the whole sequence (same inputs on every rank, float64). Returns
    ([max abs difference per case], all-gathers counted, this rank's positions == megatron-core's
    split, chunks computed without an explicit mask)."""
    import copy

    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_moe.compat.context_parallel import batch_on_this_cp_rank
    from megatron_moe.models.attention import SDPADotProductAttention, cp_query_positions

    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    restore = MUTATIONS[mutate]() if mutate else (lambda: None)
    try:
        S, b, heads, d = 16, 2, 4, 8
        pos = cp_query_positions(world_size, rank, S // world_size, "cpu")
        split = batch_on_this_cp_rank({"x": torch.arange(S).view(1, S)})["x"].view(-1)
        same_split = torch.equal(pos, split)
        diffs = []
        before = SDPADotProductAttention.cp_gathers
        chunks_before = SDPADotProductAttention.cp_causal_chunks
        for groups, window, documents, sinks in cases:
            config = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                                       num_query_groups=groups, kv_channels=d, attention_dropout=0.0,
                                       context_parallel_size=world_size, params_dtype=torch.float64,
                                       softmax_type="learnable" if sinks else "vanilla")
            one = copy.copy(config)
            one.context_parallel_size = 1
            ref_attn, cp_attn = _attention(one, window), _attention(config, window)
            assert ref_attn.cp_group is None and cp_attn.cp_group is not None
            g = torch.Generator().manual_seed(groups + 7 * (window is not None) + 3 * documents)
            if sinks:   # gpt-oss's learnable sinks, the same logits on both
                logits = torch.randn(heads, generator=g, dtype=torch.float64)
                with torch.no_grad():
                    ref_attn.softmax_offset.copy_(logits)
                    cp_attn.softmax_offset.copy_(logits)
            q, k, v = (torch.randn(S, b, n, d, generator=g, dtype=torch.float64)
                       for n in (heads, groups, groups))
            grad = torch.randn(S, b, heads * d, generator=g, dtype=torch.float64)
            mask = local_mask = None
            if documents:   # --reset-attention-mask: causal within documents (True = masked)
                doc = torch.arange(S) * documents // S
                keep = (doc.view(S, 1) == doc.view(1, S)) & torch.ones(S, S, dtype=torch.bool).tril()
                mask = ~keep.view(1, 1, S, S)
                # as get_batch hands it to the model: this rank's query rows
                local_mask = batch_on_this_cp_rank({"attention_mask": mask})["attention_mask"]
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            out = ref_attn(*full, mask)
            out.backward(grad)
            local = [t[pos].clone().requires_grad_() for t in (q, k, v)]
            out_cp = cp_attn(*local, local_mask)
            out_cp.backward(grad[pos])
            diff = (out_cp - out[pos]).abs().max().item()
            for a, ref in zip(local, full):
                diff = max(diff, (a.grad - ref.grad[pos]).abs().max().item())
            if sinks:   # each CP rank's queries' share of the sink gradient, summed over CP
                share = cp_attn.softmax_offset.grad.clone()
                torch.distributed.all_reduce(share, group=cp_attn.cp_group)
                diff = max(diff, (share - ref_attn.softmax_offset.grad).abs().max().item())
            diffs.append(diff)
        return (diffs, SDPADotProductAttention.cp_gathers - before, same_split,
                SDPADotProductAttention.cp_causal_chunks - chunks_before)
    finally:
        restore()


def train(rank, world_size, argv, mutate=None):
    """pretrain(); (history with the evaluations' lm loss as "eval_lm_loss", K/V all-gathers
    counted, this rank's tokens per micro-batch)."""
    from megatron_moe.models.attention import SDPADotProductAttention
    from megatron_moe.training import loop
    from tests._train_cases import run_pretrain

    import pretrain_gpt_moe

    restore = MUTATIONS[mutate]() if mutate else (lambda: None)
    seen, evals = [], []
    real_get, real_eval = pretrain_gpt_moe.get_batch, loop.Trainer.evaluate

    def get_batch(*a, **k):
        out = real_get(*a, **k)
        if out[0] is not None:
            seen.append(out[0].numel())
        return out

    def evaluate(self, data_iterator):
        losses = real_eval(self, data_iterator)
        evals.append(float(losses["lm loss"]))
        return losses

    pretrain_gpt_moe.get_batch, loop.Trainer.evaluate = get_batch, evaluate
    before = SDPADotProductAttention.cp_gathers
    try:
        history = run_pretrain(rank, world_size, argv)
    finally:
        pretrain_gpt_moe.get_batch, loop.Trainer.evaluate = real_get, real_eval
        restore()
    history["eval_lm_loss"] = evals
    return history, SDPADotProductAttention.cp_gathers - before, sorted(set(seen))
