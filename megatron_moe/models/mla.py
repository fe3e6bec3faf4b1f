"""DeepSeek-V2/V3 flags: Multi-Latent Attention (MLA), YaRN RoPE, QK-norm, Multi-Token Prediction.

Megatron-LM's names, defaults and meanings (megatron/training/arguments.py, ``_add_mla_args`` and
the TransformerConfig-derived flags): the values go into megatron-core's ``MLATransformerConfig``
by field name (model.transformer_config_from_args). On CPU, MLA's core attention is
``megatron_moe.models.attention.UnequalHeadDotProductAttention``; MTP is megatron-core's
``MultiTokenPredictionBlock`` (model.gpt_model_provider), its loss logged as Megatron prints it.

YaRN with MLA (``--rope-type yarn``, DeepSeek-V3's published configs): ``--rotary-scaling-factor``,
``--mscale`` and ``--mscale-all-dim`` reach MLATransformerConfig by name, as in Megatron-LM. Its
other YaRN fields (``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``) have no
Megatron-LM flag for MLA (the config's defaults 4096 / 32 / 1, DeepSeek-V3's values, apply); here
Megatron's ``--yarn-original-max-position-embeddings`` / ``--yarn-beta-fast`` / ``--yarn-beta-slow``
set them when given (``yarn_config_fields``), so any DeepSeek YaRN config can be expressed.

The combinations megatron-core cannot build are refused here, before any process group starts.
"""

from __future__ import annotations

# Megatron's --yarn-* flag -> MLATransformerConfig's field of the same meaning
_MLA_YARN_FIELDS = {"yarn_original_max_position_embeddings": "original_max_position_embeddings",
                    "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}


def yarn_config_fields(args) -> dict:
    """MLATransformerConfig's YaRN fields from the ``--yarn-*`` flags given (none: its defaults)."""
    if not getattr(args, "multi_latent_attention", False):
        return {}
    return {field: getattr(args, flag) for flag, field in _MLA_YARN_FIELDS.items()
            if getattr(args, flag, None) is not None}


def add_arguments(parser):
    g = parser.add_argument_group("multi-latent attention, YaRN, multi-token prediction")
    a = g.add_argument
    a("--multi-latent-attention", action="store_true",
      help="DeepSeek-V2/V3 Multi-Latent Attention (megatron-core's MLASelfAttention).")
    a("--q-lora-rank", type=int, default=None,
      help="Rank of the query's low-rank projection (None: a full-rank query projection).")
    a("--kv-lora-rank", type=int, default=32, help="Rank of the key/value low-rank projection.")
    a("--qk-head-dim", type=int, default=128,
      help="Head dim of the QK projection without RoPE (q head dim = this + --qk-pos-emb-head-dim).")
    a("--qk-pos-emb-head-dim", type=int, default=64, help="Head dim of the decoupled RoPE part.")
    a("--v-head-dim", type=int, default=128, help="Head dim of the value projection.")
    a("--rotary-scaling-factor", type=float, default=1.0, help="YaRN rotary scaling factor.")
    a("--mscale", type=float, default=1.0, help="YaRN mscale of multi-latent attention.")
    a("--mscale-all-dim", type=float, default=0.0, help="YaRN mscale_all_dim of multi-latent attention.")
    a("--rope-type", default=None, choices=["rope", "yarn"],
      help="MLA takes yarn by default, other attention rope.")
    a("--mtp-num-layers", type=int, default=None,
      help="Multi-Token Prediction layers (DeepSeek-V3); their loss is logged as 'mtp_N loss'.")
    a("--mtp-loss-scaling-factor", type=float, default=0.1,
      help="Weight of the MTP loss (averaged over the MTP layers) in the training loss.")


def validate_args(args):
    """Combinations megatron-core cannot build: ValueError naming the flags (one line)."""
    mla = getattr(args, "multi_latent_attention", False)
    if mla:
        if getattr(args, "group_query_attention", False) or args.num_query_groups is not None:
            raise ValueError("--multi-latent-attention and --group-query-attention/"
                             "--num-query-groups are mutually exclusive")
        for flag in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1 with --multi-latent-attention")
        if args.q_lora_rank is not None and args.q_lora_rank < 1:
            raise ValueError("--q-lora-rank must be >= 1")
        if getattr(args, "yarn_correction_range_round_to_int", None) is False:
            raise ValueError("--no-yarn-correction-range-round-to-int: megatron-core's MLA YaRN "
                             "always rounds the correction range")
    elif args.rope_type == "yarn":
        raise ValueError("--rope-type yarn needs --multi-latent-attention (megatron-core's other "
                         "attention takes rope only)")
    mtp = args.mtp_num_layers
    if mtp is not None:
        if mtp < 1:
            raise ValueError(f"--mtp-num-layers must be >= 1 (got {mtp})")
        if args.position_embedding_type not in ("rope", "none"):
            raise ValueError(f"--mtp-num-layers needs --position-embedding-type rope or none "
                             f"(got {args.position_embedding_type})")
