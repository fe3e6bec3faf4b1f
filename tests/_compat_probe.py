"""Run each megatron-core call that a CPU shim exists for; print {shim: "ok" | "error: ..."}.

Run as a script in a fresh process, with ``--shims`` (apply megatron_moe.compat first) or without:
tests/test_compat.py checks that every scenario fails without its shim and passes with it.
"""

import datetime
import warnings
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=2,
                moe_router_topk=2, use_cpu_initialization=True, add_bias_linear=False,
                moe_token_dispatcher_type="alltoall")
    base.update(kw)
    return TransformerConfig(**base)


def s_torch_cuda():
    assert torch.cuda.current_device() == torch.device("cpu")
    from megatron.core.rerun_state_machine import RerunStateMachine

    machine = RerunStateMachine()   # saves and restores the CUDA generator around a re-run
    machine._save_state()
    machine._restore_state()


def s_rng_tracker():
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(123)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        torch.rand(1)


def s_alltoall_dispatcher():
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher(2, [0, 1], config=_config(),
                               pg_collection=get_default_pg_collection())


def s_te_general_gemm():
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    out = router_gating_linear(torch.ones(3, 8), torch.ones(2, 8), None, torch.float32)
    assert out.shape == (3, 2)


def s_torch_norm_sequence_parallel():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = _config()
    config.sequence_parallel = True  # as with TP > 1 (the config refuses SP at TP=1)
    norm = WrappedTorchNorm(config, 8)
    assert all(p.sequence_parallel for p in norm.parameters())


def s_hardcoded_cuda_devices():
    from megatron.core.transformer.utils import get_default_causal_mask

    assert get_default_causal_mask(4).shape == (4, 4)
    from megatron.core.rerun_state_machine import RerunStateMachine

    assert RerunStateMachine()._reduce_any(False) is False   # the re-run verdict's all-reduce
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    # RoPE's positions of this CP rank (a pinned index tensor: no allocator without CUDA)
    emb = torch.arange(8.0).view(8, 1, 1, 1)
    group = parallel_state.get_context_parallel_group()
    assert torch.equal(get_pos_emb_on_this_cp_rank(emb, 0, group), emb)


def s_param_type():
    assert torch.nn.Parameter(torch.zeros(1)).type() == "torch.cuda.FloatTensor"


def s_clip_grads():
    from megatron.core.optimizer import clip_grads

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=2.0)
    assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-5)


def s_tensor_cuda():
    t = torch.zeros(2)
    assert t.cuda() is t


SCENARIOS = {name[2:]: fn for name, fn in list(globals().items()) if name.startswith("s_")}


def main():
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    from megatron.core import parallel_state

    if "--shims" in sys.argv:
        from megatron_moe.compat import apply_cpu_shims

        assert apply_cpu_shims()
    parallel_state.initialize_model_parallel()
    results = {}
    for name, fn in SCENARIOS.items():
        try:
            fn()
            results[name] = "ok"
        except Exception as exc:  # the point: record what megatron-core does without the shim
            results[name] = f"error: {type(exc).__name__}: {exc}"[:300]
            if "--debug" in sys.argv:
                traceback.print_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
