"""Rank functions for the hidden-partitioned embedding tests (spawned by run_distributed)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

V, H = 50, 8  # H divisible by 2 and 4


def _table(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, H, generator=g)


def _rank_ids(rank, extra=0):
    # ranks hold different numbers of tokens: the length exchange must handle it
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, V, (2, 3 + rank + extra), generator=g)


def lookup_and_grads(rank, world_size):
    """Forward bit-identical to a replicated lookup; shard grads equal the replicated DP grad."""
    from megatron_moe.models.embedding import HiddenPartitionedEmbedding, embedding_bytes

    out = {}
    W = _table()
    emb = HiddenPartitionedEmbedding(V, H, group=dist.group.WORLD, full_weight=W)
    ids = _rank_ids(rank)
    y = emb(ids)
    ref = F.embedding(ids, W)
    out["shape_ok"] = tuple(y.shape) == (*ids.shape, H)
    out["forward_bit_identical"] = bool(torch.equal(y, ref))

    # integer-valued upstream grads: every sum is exact, so equality is exact too
    g = torch.Generator().manual_seed(7 + rank)
    G = torch.randint(-4, 5, y.shape, generator=g).float()
    (y * G).sum().backward()
    # the replicated embedding under DP: local grad, then DDP's average over ranks
    W_rep = W.clone().requires_grad_(True)
    (F.embedding(ids, W_rep) * G).sum().backward()
    rep_sum = W_rep.grad.clone()
    dist.all_reduce(rep_sum)
    cols = slice(emb.col_start, emb.col_start + emb.shard_dim)
    out["grad_equals_sum_exact"] = bool(torch.equal(emb.weight.grad, rep_sum[:, cols]))
    # DP semantics: shard grad * 1/P (DDP's expert-buffer scaling) == replicated DP average
    out["grad_equals_dp_average"] = bool(torch.allclose(
        emb.weight.grad / world_size, (rep_sum / world_size)[:, cols], rtol=0, atol=1e-6))

    # float upstream grads and a second, differently sized step (accumulation)
    emb.weight.grad = None
    W_rep.grad = None
    ids2 = _rank_ids(rank, extra=2)
    G2 = torch.randn(*ids2.shape, H, generator=g)
    (emb(ids2) * G2).sum().backward()
    (F.embedding(ids2, W_rep) * G2).sum().backward()
    dist.all_reduce(W_rep.grad)
    out["grad_float_close"] = bool(torch.allclose(emb.weight.grad, W_rep.grad[:, cols],
                                                  rtol=1e-6, atol=1e-6))

    # state dicts: full logical table out, full table or shard in
    sd = emb.state_dict()
    out["state_dict_full"] = bool(torch.equal(sd["weight"], W))
    fresh = HiddenPartitionedEmbedding(V, H, group=dist.group.WORLD, seed=99)
    fresh.load_state_dict(sd)
    out["load_full"] = bool(torch.equal(fresh.weight.detach(), W[:, cols]))
    fresh2 = HiddenPartitionedEmbedding(V, H, group=dist.group.WORLD, seed=98)
    fresh2.load_state_dict(emb.local_state_dict())
    out["load_shard"] = bool(torch.equal(fresh2.weight.detach(), W[:, cols]))

    # the seeded init is the same logical table for every partitioning
    logical = torch.randn(V, H, generator=torch.Generator().manual_seed(5)) * 0.02
    seeded = HiddenPartitionedEmbedding(V, H, group=dist.group.WORLD, seed=5)
    out["init_partition_invariant"] = bool(torch.equal(seeded.full_weight(), logical))

    try:
        HiddenPartitionedEmbedding(V, 2 * world_size + 1, group=dist.group.WORLD)
        out["indivisible"] = "accepted"
    except ValueError as exc:
        out["indivisible"] = str(exc)

    mem = embedding_bytes(emb)
    out["grad_bytes"] = mem["grad_bytes"]
    out["param_bytes"] = mem["param_bytes"]
    out["shard_shape"] = mem["shape"]
    out["replicated_bytes"] = W.numel() * W.element_size()
    out["param_storage_bytes"] = emb.weight.untyped_storage().nbytes()
    return out


# --- the model path: megatron-core GPTModel, DDP and optimizer ----------------------------------
def _tiny_gpt(untie=True, num_experts=2):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(11)
    model_parallel_cuda_manual_seed(11)
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=16,
        num_moe_experts=num_experts, moe_router_topk=2, moe_ffn_hidden_size=16,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, moe_router_dtype="fp32", moe_permute_fusion=False,
        expert_model_parallel_size=_ep_size(),
    )
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts),
                    vocab_size=V, max_sequence_length=16,
                    share_embeddings_and_output_weights=not untie)


def _ep_size():
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size()


def _train_step(model, rank, clip):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), module=model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=0.5, clip_grad=clip, weight_decay=0.0), [ddp])
    g = torch.Generator().manual_seed(300 + rank)
    ids = torch.randint(0, V, (2, 6), generator=g)
    pos = torch.arange(6).unsqueeze(0).expand(2, 6)
    labels = torch.randint(0, V, (2, 6), generator=g)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = model(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    word = model.embedding.word_embeddings.weight
    grad = word.main_grad.clone()
    ok, grad_norm, _ = opt.step()
    return loss.detach(), grad, word.detach().clone(), grad_norm, ok


def ddp_matches_replicated(rank, world_size, ep):
    """Swapped GPTModel under megatron-core DDP + optimizer == the vocab-parallel original."""
    from megatron.core import parallel_state

    from megatron_moe.models.embedding import HiddenPartitionedEmbedding, partition_word_embeddings

    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    out = {}
    ref_model = _tiny_gpt()
    hid_model = _tiny_gpt()
    full_before = ref_model.embedding.word_embeddings.weight.detach().clone()
    partition_word_embeddings(hid_model, partition="hidden", group="auto")
    emb = hid_model.embedding.word_embeddings
    out["swapped"] = isinstance(emb, HiddenPartitionedEmbedding)
    out["group_size"] = emb.world
    cols = slice(emb.col_start, emb.col_start + emb.shard_dim)
    out["same_init"] = bool(torch.equal(emb.weight.detach(), full_before[:, cols]))

    l_ref, g_ref, w_ref, n_ref, _ = _train_step(ref_model, rank, clip=0.05)
    l_hid, g_hid, w_hid, n_hid, ok = _train_step(hid_model, rank, clip=0.05)
    out["loss_equal"] = bool(torch.allclose(l_ref, l_hid, rtol=1e-6, atol=1e-6))
    # after DDP: replicated grad is the DP average; the shard's must be its columns
    out["grad_max_abs_diff"] = float((g_hid - g_ref[:, cols]).abs().max())
    out["grad_close"] = bool(torch.allclose(g_hid, g_ref[:, cols], rtol=1e-5, atol=1e-7))
    # the global grad norm (clipping is active) and the updated weights agree
    out["grad_norm"] = (float(n_ref), float(n_hid))
    out["weights_close"] = bool(torch.allclose(w_hid, w_ref[:, cols], rtol=1e-5, atol=1e-6))
    other_ref = {n: p.detach() for n, p in ref_model.named_parameters()
                 if "word_embeddings" not in n}
    out["other_params_close"] = all(
        torch.allclose(p.detach(), other_ref[n], rtol=1e-5, atol=1e-6)
        for n, p in hid_model.named_parameters() if "word_embeddings" not in n)
    out["step_ok"] = bool(ok)
    # the dp choice is refused where megatron-core DDP would reduce over the wrong ranks
    try:
        partition_word_embeddings(_tiny_gpt(), partition="hidden", group="dp")
        out["dp_group"] = "accepted"
    except ValueError as exc:
        out["dp_group"] = str(exc)
    try:
        partition_word_embeddings(_tiny_gpt(untie=False), partition="hidden")
        out["tied"] = "accepted"
    except ValueError as exc:
        out["tied"] = str(exc)
    return out


def checkpoint_reshard(rank, world_size, root):
    """hidden -> vocab-parallel (TP=2) -> hidden, and hidden -> replicated, via dist_checkpointing."""
    import os

    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    from megatron_moe.models.embedding import HiddenPartitionedEmbedding

    key = "embedding.word_embeddings."
    out = {}
    W, W2 = _table(1), _table(2)

    def vocab_embedding():
        cfg = ModelParallelConfig(tensor_model_parallel_size=parallel_state.
                                  get_tensor_model_parallel_world_size(),
                                  use_cpu_initialization=True)
        return VocabParallelEmbedding(V, H, init_method=torch.nn.init.zeros_, config=cfg)

    def meta():
        return {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}

    def hidden(full=None):
        return HiddenPartitionedEmbedding(
            V, H, group=parallel_state.get_expert_model_parallel_group(),
            replica_group=parallel_state.get_expert_data_parallel_group(), full_weight=full,
            seed=3)

    def load(module, path):
        sd = module.sharded_state_dict(key, metadata=meta())
        state = dist_checkpointing.load(sd, path)
        module.load_state_dict({k[len(key):]: v for k, v in state.items()})

    d_hidden, d_vocab = os.path.join(root, "hidden"), os.path.join(root, "vocab")
    if rank == 0:
        os.makedirs(d_hidden, exist_ok=True)
        os.makedirs(d_vocab, exist_ok=True)
    dist.barrier()

    # save hidden-partitioned (2 ranks split the columns)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    hid = hidden(W)
    dist_checkpointing.save(hid.sharded_state_dict(key, metadata=meta()), d_hidden)
    # load into a replicated table (TP=1 vocab embedding holds all rows and columns)
    rep = vocab_embedding()
    load(rep, d_hidden)
    out["hidden_to_replicated"] = bool(torch.equal(rep.weight.detach(), W))
    parallel_state.destroy_model_parallel()

    # load into vocab-parallel TP=2 (rows split), then save a different table from there
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    voc = vocab_embedding()
    load(voc, d_hidden)
    rows = slice(voc.vocab_start_index, voc.vocab_end_index)
    out["hidden_to_vocab"] = bool(torch.equal(voc.weight.detach(), W[rows]))
    with torch.no_grad():
        voc.weight.copy_(W2[rows])
    dist_checkpointing.save(voc.sharded_state_dict(key, metadata=meta()), d_vocab)
    parallel_state.destroy_model_parallel()

    # load the vocab-parallel checkpoint into a hidden-partitioned table
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    hid2 = hidden()
    load(hid2, d_vocab)
    cols = slice(hid2.col_start, hid2.col_start + hid2.shard_dim)
    out["vocab_to_hidden"] = bool(torch.equal(hid2.weight.detach(), W2[:, cols]))
    return out


def suite(rank, world_size, ep, ckpt_root=None):
    """The distributed checks in one spawn (process start-up dominates on a small machine)."""
    from megatron.core import parallel_state

    out = {"lookup": lookup_and_grads(rank, world_size),
           "ddp": ddp_matches_replicated(rank, world_size, ep)}
    if ckpt_root is not None:
        parallel_state.destroy_model_parallel()
        out["ckpt"] = checkpoint_reshard(rank, world_size, ckpt_root)
    return out
