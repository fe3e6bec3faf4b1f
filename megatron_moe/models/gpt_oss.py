"""gpt-oss flags: attention sinks, alternating sliding windows, clamped GEGLU, YaRN RoPE.

Megatron-LM's names, defaults and meanings (megatron/training/arguments.py at core_v0.16.1 and
core_v0.19.0: ``--window-size``/``--window-attn-skip-freq``/``--quick-geglu`` in its network-size
group, ``--softmax-type``/``--glu-linear-offset``/``--activation-func-clamp-value`` from
TransformerConfig's fields, the ``--yarn-*`` flags and ``--position-embedding-type yarn`` of
core_v0.19.0). The values reach megatron-core's TransformerConfig by field name
(model.transformer_config_from_args); megatron-core's local DotProductAttention (or, under
``--attention-backend flash``, models/attention.py's SDPA one) applies the sinks
(``softmax_offset``) and the window mask, its MLP and experts the clamp and the offset, its
GPTModel the YaRN rotary embedding (``yarn_*`` config attributes, set as Megatron-LM's
``_apply_yarn_config_from_args`` sets them: model.apply_yarn_config).

What megatron-core would ignore is refused here, before any process group starts.
"""

from __future__ import annotations

import argparse

YARN_FLAGS = ("yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
              "yarn_correction_range_round_to_int")


def _window(text):
    """Megatron's tuple_type: '127,0' or '(127,0)' -> (127, 0) (two values: validate_args)."""
    try:
        return tuple(int(v) for v in text.strip().strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers LEFT,RIGHT, got {text!r}")


def add_arguments(parser):
    from megatron_moe.flags.types import layer_freq as _layer_freq

    g = parser.add_argument_group("gpt-oss: attention sinks, sliding windows, clamped GEGLU, YaRN")
    a = g.add_argument
    a("--window-size", type=_window, default=None,
      help="Sliding-window attention LEFT,RIGHT (tokens before/after a query it sees besides "
           "itself; gpt-oss: 127,0). Default: full attention.")
    a("--window-attn-skip-freq", type=_layer_freq, default=None,
      help="Which layers keep the window: an int N (every Nth layer is full attention, the "
           "others windowed) or a list such as '[1,0]*12' (1 = window). Default: all windowed.")
    a("--softmax-type", default="vanilla", choices=["vanilla", "off-by-one", "learnable"],
      help="Attention softmax: vanilla; off-by-one (a zero logit in every denominator); "
           "learnable (one learned sink logit per head, gpt-oss).")
    a("--quick-geglu", action="store_true",
      help="Gated MLP with quick-GELU, x*sigmoid(1.702x), on the gate (gpt-oss's experts).")
    a("--glu-linear-offset", type=float, default=0.0,
      help="Gated MLPs: act(gate) * (up + offset) (gpt-oss: 1.0).")
    a("--activation-func-clamp-value", type=float, default=None,
      help="Gated MLPs: clamp the gate to <= V and up to [-V, V] before the activation "
           "(gpt-oss: 7.0).")
    a("--yarn-original-max-position-embeddings", type=int, default=None,
      help="YaRN (--position-embedding-type yarn): the pretraining context length (default 4096).")
    a("--yarn-beta-fast", type=float, default=None, help="YaRN beta_fast (default 32).")
    a("--yarn-beta-slow", type=float, default=None, help="YaRN beta_slow (default 1).")
    a("--yarn-correction-range-round-to-int", action="store_true", default=None,
      help="Round YaRN's correction range to integers (the default).")
    a("--no-yarn-correction-range-round-to-int", action="store_false",
      dest="yarn_correction_range_round_to_int",
      help="Do not round YaRN's correction range (gpt-oss: truncate=false).")


def validate_args(args):
    """Combinations megatron-core would build but not apply, or cannot build (ValueError, one line)."""
    mla = getattr(args, "multi_latent_attention", False)
    if args.quick_geglu and args.swiglu:
        raise ValueError("--quick-geglu and --swiglu are mutually exclusive")
    gated = args.quick_geglu or args.swiglu
    if not gated:
        for flag, value, default in (("--glu-linear-offset", args.glu_linear_offset, 0.0),
                                     ("--activation-func-clamp-value",
                                      args.activation_func_clamp_value, None)):
            if value != default:
                raise ValueError(f"{flag} needs a gated MLP (--quick-geglu or --swiglu): "
                                 f"megatron-core applies it only there")
    if args.activation_func_clamp_value is not None and args.activation_func_clamp_value <= 0:
        raise ValueError(f"--activation-func-clamp-value must be > 0 "
                         f"(got {args.activation_func_clamp_value})")
    window = args.window_size
    if window is not None and (len(window) != 2 or min(window) < -1):
        raise ValueError(f"--window-size takes two integers LEFT,RIGHT >= -1 (-1: unlimited), "
                         f"got {','.join(map(str, window))}")
    if window is not None and -1 in window and getattr(args, "transformer_impl", None) == "local":
        raise ValueError("--window-size with -1 (unlimited) needs --transformer-impl "
                         "transformer_engine: megatron-core's local window mask (and the SDPA "
                         "attention matching it) takes -1 as an offset (-1,0 masks every key)")
    freq = args.window_attn_skip_freq
    if freq is not None:
        if args.window_size is None:
            raise ValueError("--window-attn-skip-freq needs --window-size")
        if isinstance(freq, list) and len(freq) != args.num_layers:
            raise ValueError(f"--window-attn-skip-freq has {len(freq)} entries, --num-layers is "
                             f"{args.num_layers}")
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"--window-attn-skip-freq must be >= 1 (got {freq})")
    if mla and (args.window_size is not None or args.softmax_type != "vanilla"):
        raise ValueError("--window-size/--softmax-type are not wired to --multi-latent-attention "
                         "here (MLA's core attention is ours on CPU; untested)")
    if args.window_size is not None and args.context_parallel_size > 1 \
            and getattr(args, "transformer_impl", None) != "local":
        # the local path's SDPA attention applies the window to the gathered keys (all-gather
        # CP, models/attention.py); Transformer Engine's windowed CP is untested here
        raise ValueError("--window-size with --context-parallel-size > 1 needs --transformer-impl "
                         "local (the SDPA attention's all-gather context parallelism)")
    if args.position_embedding_type == "yarn":
        if mla:
            raise ValueError("--position-embedding-type yarn is for standard attention; "
                             "--multi-latent-attention takes --rope-type yarn")
    elif not (mla and (args.rope_type or "yarn") == "yarn"):  # MLA's YaRN takes them too
        given = [f for f in YARN_FLAGS if getattr(args, f) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --position-embedding-type yarn "
                             f"(or --multi-latent-attention with --rope-type yarn)")
