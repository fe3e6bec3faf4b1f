"""Model construction: args -> megatron-core TransformerConfig, layer spec, GPTModel, DDP.

The MoE layer spec is megatron-core's; features customise it (megatron_moe/features.py,
``customize_spec(args, block_spec) -> block_spec``): the dispatcher (fused permute, pluggable
all-to-all), the topology-aware router and the load balancer swap in their classes there.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_moe.compat import ddp as ddp_compat
from megatron_moe.models.mla import yarn_config_fields
from megatron_moe.models.pipeline_split import SPLIT_FIELDS
from megatron_moe.training import cuda_graph, megatron_fsdp

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# args attribute -> TransformerConfig field, where Megatron's flag name differs from the field
_RENAMED = {
    "num_experts": "num_moe_experts",
    "norm_epsilon": "layernorm_epsilon",
    "swiglu": "gated_linear_unit",
    **SPLIT_FIELDS,   # Megatron-LM's pipeline split flags (uneven first / last stage, ...)
}


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def transformer_config_from_args(args, config_class=TransformerConfig) -> TransformerConfig:
    """Copy every same-named (or renamed) arg into the config, as Megatron-LM does."""
    kwargs = {}
    if getattr(args, "multi_latent_attention", False) and config_class is TransformerConfig:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class = MLATransformerConfig
    names = {f.name for f in dataclasses.fields(config_class)}
    for key, value in vars(args).items():
        field = _RENAMED.get(key, key)
        if field in names:
            kwargs[field] = value
    comm = kwargs.get("cp_comm_type")
    if isinstance(comm, (list, tuple)) and len(comm) == 1:
        kwargs["cp_comm_type"] = comm[0]   # Megatron-LM's: one value for every layer
    dtype = _DTYPES[args.params_dtype]
    te = use_transformer_engine(args)
    modules = kwargs.get("recompute_modules")
    if modules and "moe_act" in modules and not te:
        # the local grouped experts recompute their activation themselves (moe/grouped_experts.py);
        # megatron-core's config accepts moe_act only with its own (Transformer Engine) grouped GEMM
        kwargs["recompute_modules"] = [m for m in modules if m != "moe_act"]
    kwargs.update(
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        use_cpu_initialization=args.use_cpu_initialization or not torch.cuda.is_available(),
        # Fusions need TE/apex/CUDA; they are chosen explicitly elsewhere (--moe-permute-fusion).
        moe_permute_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Megatron-LM's (always): a pipeline stage frees its output's data once sent, keeping
        # only the autograd node (megatron-core's custom backward); activation memory under PP
        deallocate_pipeline_outputs=True,
        moe_router_dtype=getattr(args, "moe_router_dtype", None),
        # megatron-core's --moe-grouped-gemm is Transformer Engine's; on the local path the spec
        # keeps SequentialMLP and megatron_moe.moe.grouped_experts swaps in the grouped_mm experts
        moe_grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)) and te,
        activation_func=F.silu if args.swiglu else F.gelu,
        num_moe_experts=args.num_experts,
        moe_layer_freq=args.moe_layer_freq,
        deterministic_mode=getattr(args, "deterministic_mode", False),
        calculate_per_token_loss=getattr(args, "calculate_per_token_loss", False),
    )
    for field in ("moe_single_grouped_weight", "moe_single_grouped_bias"):
        if field in names and not te:   # local path: GroupedSequentialMLP's (moe/grouped_experts.py)
            kwargs[field] = False
    if getattr(args, "quick_geglu", False):  # gpt-oss: Megatron-LM's choice of quick_gelu
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        kwargs.update(gated_linear_unit=True, activation_func=quick_gelu)
    if getattr(args, "squared_relu", False):  # Megatron-LM: relu(x)^2 in the MLPs and experts
        from megatron.core.activations import squared_relu

        kwargs["activation_func"] = squared_relu
    if getattr(args, "init_method_xavier_uniform", False):
        # Megatron-LM names the second one scaled_init_method, megatron-core's older name for
        # output_layer_init_method (no TransformerConfig field has that name any more)
        kwargs.update(init_method=torch.nn.init.xavier_uniform_,
                      output_layer_init_method=torch.nn.init.xavier_uniform_)
    if getattr(args, "virtual_pipeline_model_parallel_size", None):
        # Megatron's defaults with the interleaved schedule: --overlap-p2p-communication on,
        # hence no batched p2p (megatron-core's rule: the two exclude each other)
        kwargs.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    kwargs.update(_fusion_selectors(args, te))
    kwargs.update(cuda_graph.config_fields(args))   # a full-iteration graph, in this release's terms
    if hasattr(args, "attention_backend"):
        from megatron.core.transformer.enums import AttnBackend

        kwargs["attention_backend"] = AttnBackend[args.attention_backend]
    if getattr(args, "rope_type", None) is None:
        kwargs.pop("rope_type", None)  # the config's default: yarn for MLA, rope otherwise
    kwargs.update(yarn_config_fields(args))  # MLA's YaRN fields named by --yarn-* flags
    if args.moe_router_load_balancing_type == "none":
        kwargs["moe_aux_loss_coeff"] = 0.0
    if args.num_experts is None:
        for key in [k for k in kwargs if k.startswith("moe_")]:
            kwargs.pop(key)
    return apply_yarn_config(config_class(**kwargs), args)


def apply_yarn_config(config, args):
    """--position-embedding-type yarn: megatron-core's GPTModel and attention read the YaRN
    parameters as ``config.yarn_*`` attributes (no TransformerConfig fields); they are set from
    Megatron's flags with YarnRotaryEmbedding's defaults, as Megatron-LM's
    ``_apply_yarn_config_from_args`` does (core_v0.19.0)."""
    if getattr(args, "position_embedding_type", None) != "yarn":
        return config
    for attr, value, default in (
            ("yarn_rotary_scaling_factor", args.rotary_scaling_factor, 1.0),
            ("yarn_original_max_position_embeddings", args.yarn_original_max_position_embeddings,
             4096),
            ("yarn_beta_fast", args.yarn_beta_fast, 32.0),
            ("yarn_beta_slow", args.yarn_beta_slow, 1.0),
            ("yarn_mscale", args.mscale, 1.0),
            ("yarn_mscale_all_dim", args.mscale_all_dim, 0.0),
            ("yarn_correction_range_round_to_int", args.yarn_correction_range_round_to_int, True)):
        setattr(config, attr, default if value is None else value)
    return config


def _fusion_selectors(args, te: bool) -> dict:
    """Megatron's fusion selectors (--no-masked-softmax-fusion, --no-bias-swiglu-fusion, ...:
    no-ops in flags/status.txt), as megatron-core takes them:

    * with Transformer Engine every selector reaches megatron-core;
    * on the local path on CUDA, the three whose fused version is megatron-core's own
      ``torch.compile`` region (``megatron.core.jit.jit_fuser``), no apex or TE kernel: bias +
      SwiGLU (``bias_swiglu_impl``, and its per-token-weighted form inside the experts),
      bias + dropout + residual add, and the native fused cross-entropy
      (``--cross-entropy-loss-fusion`` with ``--cross-entropy-fusion-impl native``). Megatron's
      defaults turn the first two on; the GPU kit's perf section measures them against the eager
      ops ("ours-eager");
    * on a CPU (tests) none: the unfused ops compute the same math without compiling."""
    def on(dest):
        return te and getattr(args, dest, True)

    compiled = te or torch.cuda.is_available()

    def compiled_on(dest):
        return compiled and getattr(args, dest, True)

    swiglu = args.swiglu  # Megatron-LM: the gelu selector for --quick-geglu too
    ce_native = getattr(args, "cross_entropy_fusion_impl", "native") == "native"
    return dict(
        masked_softmax_fusion=on("masked_softmax_fusion"),
        apply_rope_fusion=on("apply_rope_fusion") and args.position_embedding_type == "rope",
        bias_dropout_fusion=compiled_on("bias_dropout_fusion"),
        # the local path fuses SwiGLU only (what MoE models use): megatron-core's other fused
        # activations have conditions of their own (a bias, the gate's form) it checks by raising;
        # it has no fused squared ReLU (Megatron-LM would hand it the gelu selector and fail)
        bias_activation_fusion=(on("bias_swiglu_fusion" if swiglu else "bias_gelu_fusion")
                                and not getattr(args, "squared_relu", False))
        or (swiglu and compiled_on("bias_swiglu_fusion")),
        cross_entropy_loss_fusion=(te or (compiled and ce_native))
        and getattr(args, "cross_entropy_loss_fusion", False),
        moe_router_fusion=te and getattr(args, "moe_router_fusion", False),
        # megatron-core's overlap runs with its legacy linears as with TE's (tested on the CPU)
        moe_shared_expert_overlap=getattr(args, "moe_shared_expert_overlap", False),
    )


def use_transformer_engine(args) -> bool:
    """--transformer-impl (resolved at parse time: transformer_engine only with TE and CUDA)."""
    impl = getattr(args, "transformer_impl", None)
    return have_transformer_engine() if impl is None else impl == "transformer_engine"


def gpt_layer_spec(args, config, vp_stage=None):
    # vp_stage: this virtual pipeline stage's layers (interleaved schedule); None builds this
    # rank's one chunk
    stage = {} if vp_stage is None else {"vp_stage": vp_stage}
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_transformer_engine(args),
                                      qk_l2_norm=getattr(args, "qk_l2_norm", False), **stage)
    from megatron_moe import features  # the wiring module above the stage packages

    return features.customize_spec(args, spec)


def mtp_block_spec(args, config, spec, vp_stage=None):
    """megatron-core's Multi-Token Prediction block (--mtp-num-layers) from the last layer's spec
    (so it has the same attention and MoE customisations); None without MTP or off its stage."""
    if not getattr(args, "mtp_num_layers", None):
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=use_transformer_engine(args),
                                  vp_stage=vp_stage)


def common_model_kwargs(args, config, pre_process, post_process, vp_stage) -> dict:
    """Constructor arguments megatron-core's GPTModel and BertModel both take from Megatron's flags."""
    return dict(
        config=config,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        vp_stage=vp_stage,
    )


def gpt_model_provider(args, pre_process=True, post_process=True, vp_stage=None) -> GPTModel:
    from megatron_moe.models.embedding import partition_word_embeddings

    config = transformer_config_from_args(args)
    spec = gpt_layer_spec(args, config, vp_stage)
    model = GPTModel(
        transformer_layer_spec=spec,
        rotary_base=args.rotary_base,
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        seq_len_interpolation_factor=getattr(args, "rotary_seq_len_interpolation_factor", None),
        rope_scaling=getattr(args, "use_rope_scaling", False),
        # Megatron-LM's gpt_builders passes rope_scaling only (GPTModel's default factor, 8.0,
        # which is also the flag's default); its multimodal models pass the factor as here
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
        mtp_block_spec=mtp_block_spec(args, config, spec, vp_stage),
        **common_model_kwargs(args, config, pre_process, post_process, vp_stage),
    )
    return partition_word_embeddings(model, args)  # --embedding-partition (vocab: unchanged)


def get_model(model_provider, args, model_type=ModelType.encoder_or_decoder):
    """This rank's model chunks (one, or one per virtual pipeline stage for megatron-core's
    interleaved schedule), cast for mixed precision, each wrapped in megatron-core DDP."""
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    model = []
    for vp_stage in range(vpp or 1):
        stage = dict(ignore_virtual=False, vp_stage=vp_stage) if vpp else {}
        pre = parallel_state.is_pipeline_first_stage(**stage)
        post = parallel_state.is_pipeline_last_stage(**stage)
        chunk = model_provider(pre_process=pre, post_process=post,
                               **({"vp_stage": vp_stage} if vpp else {}))
        chunk.model_type = model_type
        if vpp:
            chunk.vp_stage = vp_stage
        model.append(chunk)
    configs = [chunk.config for chunk in model]
    num_parameters = sum(p.nelement() for chunk in model for p in chunk.parameters())
    data_parallel = megatron_fsdp.data_parallel_wrapper(args)   # DDP, or Megatron-FSDP's
    wrapped = []
    for index, (chunk, config) in enumerate(zip(model, configs)):
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        if args.bf16 or args.fp16:
            chunk = Float16Module(config, chunk)
        ddp_config = DistributedDataParallelConfig(
            **megatron_fsdp.ddp_config_fields(args),   # --use-megatron-fsdp's
            # bf16 gradients with --bf16 --grad-reduce-in-bf16 (arguments.py)
            grad_reduce_in_fp32=getattr(args, "accumulate_allreduce_grads_in_fp32", True),
            average_in_collective=getattr(args, "ddp_average_in_collective", False),
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
            use_distributed_optimizer=args.use_distributed_optimizer,
            # Megatron-LM's: megatron-core validates each bucket's grad norm (NaN, Inf; with
            # --check-for-large-grads, size) through its rerun state machine before the grad
            # reduction (training/result_validation.py). Not with --rerun-mode disabled: there
            # megatron-core would raise at a NaN grad; the loop's NaN-loss check stops the run
            check_for_nan_in_grad=(getattr(args, "check_for_nan_in_loss", False)
                                   and getattr(args, "rerun_mode", "disabled") != "disabled"),
            check_for_large_grads=getattr(args, "check_for_large_grads", False),
            # Megatron-LM's rule; megatron-core turns None into its default (40M elements or 1M
            # per data-parallel rank) with --overlap-grad-reduce, and into one bucket without
            bucket_size=(num_parameters // args.ddp_num_buckets if args.ddp_num_buckets
                         else args.ddp_bucket_size),
            pad_buckets_for_high_nccl_busbw=args.ddp_pad_buckets_for_high_nccl_busbw,
            reduce_scatter_with_fp32_accumulation=args.ddp_reduce_scatter_with_fp32_accumulation,
            num_distributed_optimizer_instances=getattr(args, "num_distributed_optimizer_instances", 1),
        )
        # Megatron-LM: only the first chunk buckets its grads (the others' reduce at the end)
        wrapped.append(data_parallel(config=config, ddp_config=ddp_config, module=chunk,
                                     disable_bucketing=index > 0))
    if cuda_graph.full_iteration(args):
        # DDP keeps each parameter's AccumulateGrad node, made here on the default stream; a
        # capture's backward on megatron-core's side stream accumulating into it fails the capture
        # (a torch without pytorch/pytorch#180090's set_override_stale_capture_stream, such as
        # 2.11). The hook moves to the parameters and the nodes go: each forward makes its own,
        # the capture's on the capture stream. Done whatever the torch: core_v0.16's wrapper never
        # sets that override, and the moved hook is DDP's own at the same point (bit-equal
        # training, tests/test_cuda_graph.py), so every run takes the one path tested here.
        ddp_compat.hook_parameters(wrapped)
    config = configs[0]   # the schedule reads model[0]'s config
    config.finalize_model_grads_func = finalize_model_grads
    if len(wrapped) == 1:
        config.no_sync_func = wrapped[0].no_sync
        if args.overlap_param_gather:
            config.param_sync_func = wrapped[0].start_param_sync
    else:
        config.no_sync_func = [chunk.no_sync for chunk in wrapped]
        if args.overlap_param_gather:
            config.param_sync_func = [chunk.start_param_sync for chunk in wrapped]
    return wrapped


def unwrap(model_chunk):
    """The GPTModel/BertModel inside DDP and Float16Module wrappers."""
    while hasattr(model_chunk, "module"):
        model_chunk = model_chunk.module
    return model_chunk
