"""Megatron-LM's model-architecture flags: activation, initialisation, RoPE variants, q/k
normalisation, the fp32 residual stream, zero-centred norms, weight decay on q/k norms.

Each flag has Megatron-LM's spelling, dest and default (``flags.add_megatron_argument`` reads
them from Megatron-LM's own parser, core_v0.16.1 and core_v0.19.0), and reaches megatron-core as
Megatron-LM hands it over (``core_transformer_config_from_args`` and ``gpt_builders.py``):

* TransformerConfig fields by name (``models/builder.py`` transformer_config_from_args):
  ``--rotary-interleaved``, ``--no-rope-freq``, ``--qk-l2-norm``, ``--embedding-init-method-std``,
  and, with Transformer Engine only (``TE_ONLY_FLAGS``: refused on the local path),
  ``--fp32-residual-connection`` and ``--apply-layernorm-1p`` (``layernorm_zero_centered_gamma``);
  ``--squared-relu`` as ``activation_func`` (megatron-core's ``squared_relu``, dense MLPs and
  experts alike); ``--init-method-xavier-uniform`` as ``init_method`` and
  ``output_layer_init_method``;
* the layer spec: ``--qk-l2-norm`` puts megatron-core's L2Norm on queries and keys
  (``get_gpt_decoder_block_spec(qk_l2_norm=...)``);
* GPTModel: ``--use-rope-scaling`` / ``--rope-scaling-factor`` (Llama 3.x frequency scaling of
  megatron-core's RotaryEmbedding);
* OptimizerConfig: ``--apply-wd-to-qk-layernorm`` (training/loop.py; Megatron-LM's deprecated
  ``--no-weight-decay-cond-type apply_wd_to_qk_layernorm`` sets it, as its validate_args does).

What megatron-core would build and then ignore, or cannot build on the path chosen, is refused
here with one line, before any process group starts.
"""

from __future__ import annotations

# flag -> why it is refused on --transformer-impl local (its value reaches megatron-core as is
# with Transformer Engine; unverified on a GPU here)
TE_ONLY_FLAGS = {
    "--apply-layernorm-1p": "megatron-core's local norms (torch LayerNorm/RMSNorm, "
                            "WrappedTorchNorm) have no zero-centred gamma; Transformer Engine's "
                            "norms do",
    "--fp32-residual-connection": "megatron-core's local norms and linears need their input in "
                                  "the parameters' dtype (an fp32 residual into bf16/fp16 weights "
                                  "fails at the first layer); Transformer Engine's modules cast it",
}


def add_arguments(parser):
    from megatron_moe.flags import add_megatron_argument as add
    from megatron_moe.flags.types import layer_freq

    g = parser.add_argument_group("Megatron-LM model architecture (megatron-core "
                                  "TransformerConfig, GPTModel)")
    add(g, "--squared-relu",
        help="MLP and expert activation relu(x)^2 (megatron-core squared_relu) instead of gelu.")
    add(g, "--init-method-xavier-uniform",
        help="Initialise every weight with torch.nn.init.xavier_uniform_ (megatron-core "
             "init_method and output_layer_init_method; embeddings too, unless "
             "--embedding-init-method-std).")
    add(g, "--embedding-init-method-std",
        help="Std of the normal init of the embeddings (default: --init-method-std).")
    add(g, "--use-rope-scaling",
        help="Llama 3.x RoPE frequency scaling (megatron-core RotaryEmbedding rope_scaling).")
    add(g, "--rope-scaling-factor", help="Llama 3.x RoPE scaling factor (with --use-rope-scaling).")
    add(g, "--rotary-interleaved",
        help="RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... instead of the two halves.")
    add(g, "--no-rope-freq", type=layer_freq,
        help="Layers without RoPE: an int N (every Nth layer) or a list such as "
             "'([0]*3+[1])*2' (1 = no RoPE).")
    add(g, "--qk-l2-norm", help="L2-normalise queries and keys per head (megatron-core L2Norm).")
    add(g, "--fp32-residual-connection",
        help="Keep the residual stream in fp32 under --bf16/--fp16.")
    add(g, "--apply-layernorm-1p",
        help="Zero-centred norm weights (scale 1 + gamma); Transformer Engine only.")
    add(g, "--apply-wd-to-qk-layernorm",
        help="Apply weight decay to the q/k layernorms' weights and biases (the other norms and "
             "biases keep none).")
    add(g, "--no-weight-decay-cond-type", choices=None,   # a wrong value: our line, not argparse's
        help="Deprecated Megatron-LM form: apply_wd_to_qk_layernorm = --apply-wd-to-qk-layernorm.")


def validate_args(args):
    """One line naming the flag for what megatron-core cannot build or would ignore."""
    if args.fp32_residual_connection and not (args.bf16 or args.fp16):
        raise ValueError("--fp32-residual-connection needs --bf16 or --fp16 (Megatron-LM's rule: "
                         "the residual is already fp32)")
    local = getattr(args, "transformer_impl", None) != "transformer_engine"
    for flag, reason in TE_ONLY_FLAGS.items():
        if local and getattr(args, _dest(flag)):
            raise ValueError(f"{flag} needs --transformer-impl transformer_engine ({reason})")
    mla = getattr(args, "multi_latent_attention", False)
    if args.squared_relu:
        for other in ("swiglu", "quick_geglu"):
            if getattr(args, other, False):
                raise ValueError(f"--squared-relu and --{other.replace('_', '-')} are mutually "
                                 f"exclusive")
    if args.embedding_init_method_std is not None and args.embedding_init_method_std < 0:
        raise ValueError(f"--embedding-init-method-std must be >= 0 "
                         f"(got {args.embedding_init_method_std})")
    rope = args.position_embedding_type in ("rope", "yarn")
    if args.use_rope_scaling:
        if args.position_embedding_type != "rope" or mla:
            raise ValueError("--use-rope-scaling needs --position-embedding-type rope without "
                             "--multi-latent-attention (it scales megatron-core's "
                             "RotaryEmbedding, which only that builds)")
        if args.rope_scaling_factor <= 0:
            raise ValueError(f"--rope-scaling-factor must be > 0 (got {args.rope_scaling_factor})")
    if args.rotary_interleaved and (args.position_embedding_type != "rope" or mla):
        raise ValueError("--rotary-interleaved needs --position-embedding-type rope without "
                         "--multi-latent-attention (megatron-core's YaRN and MLA rotary "
                         "embeddings refuse interleaving)")
    if args.no_rope_freq is not None:
        _validate_no_rope_freq(args, rope, mla)
    if args.qk_l2_norm and mla:
        raise ValueError("--qk-l2-norm is not supported with --multi-latent-attention "
                         "(megatron-core)")
    if args.no_weight_decay_cond_type is not None:   # Megatron-LM's deprecated form
        if args.no_weight_decay_cond_type != "apply_wd_to_qk_layernorm":
            raise ValueError(f"--no-weight-decay-cond-type {args.no_weight_decay_cond_type}: the "
                             f"only choice is apply_wd_to_qk_layernorm (deprecated in Megatron-LM: "
                             f"use --apply-wd-to-qk-layernorm)")
        args.apply_wd_to_qk_layernorm, args.no_weight_decay_cond_type = True, None
    if args.apply_wd_to_qk_layernorm and not getattr(args, "qk_layernorm", False):
        raise ValueError("--apply-wd-to-qk-layernorm needs --qk-layernorm (it decays the q/k "
                         "layernorms' parameters only)")


def _validate_no_rope_freq(args, rope, mla):
    freq, layers = args.no_rope_freq, args.num_layers
    if not rope or mla:
        raise ValueError("--no-rope-freq needs --position-embedding-type rope or yarn without "
                         "--multi-latent-attention (megatron-core skips RoPE per layer there only)")
    if isinstance(freq, int):
        if freq < 1 or layers % freq:
            raise ValueError(f"--no-rope-freq {freq} must be >= 1 and divide --num-layers "
                             f"({layers})")
    elif len(freq) != layers:
        raise ValueError(f"--no-rope-freq has {len(freq)} entries, --num-layers is {layers}")


def _dest(flag: str) -> str:
    from megatron_moe.flags import all_megatron_flags

    return all_megatron_flags()[flag]["dest"]
