"""Rank functions for tests/test_arch_flags.py (spawned by run_distributed): what megatron-core
built from Megatron-LM's model-architecture flags, as plain values."""

import copy

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 256 --num-experts 4 --moe-router-topk 2 "
        "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 --log-interval 1 "
        "--eval-interval 1000 --eval-iters 1 --disable-bias-linear --transformer-impl local "
        "--attention-dropout 0.0").split()


def withheld(args, flags):
    """``args`` as if ``flags`` had not been given (Megatron's defaults): the mutation of a flag
    that is parsed but not passed on to megatron-core."""
    from megatron_moe.flags import all_megatron_flags

    args = copy.copy(args)
    for flag in flags:
        record = all_megatron_flags()[flag]
        setattr(args, record["dest"], record["default"])
    return args


def model_facts(model, optimizer=None, args=None):
    """What the built model (and optimizer) hold: activation functions, init statistics, the
    rotary embedding, the q/k norms, weight decay of the q/k layernorm weights."""
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_moe.models.builder import unwrap

    gpt = unwrap(model)
    config = gpt.config
    layer = gpt.decoder.layers[0]
    attention = layer.self_attention
    experts = layer.mlp.experts
    expert_mlp = getattr(experts, "_activation", None) or experts.local_experts[0]
    qkv = attention.linear_qkv.weight.detach().float()
    facts = {
        "activation": config.activation_func.__name__,
        "expert_activation": expert_mlp.activation_func.__name__,
        "init_method": getattr(config.init_method, "__name__", None),
        "output_layer_init_method": getattr(config.output_layer_init_method, "__name__", None),
        "qkv_std": float(qkv.std()), "qkv_max": float(qkv.abs().max()),
        "qkv_fan": list(qkv.shape),
        "embedding_std": float(gpt.embedding.word_embeddings.weight.detach().float().std()),
        "embedding_init_method_std": config.embedding_init_method_std,
        "rotary_interleaved": config.rotary_interleaved,
        "no_rope_freq": config.no_rope_freq,
        "q_norm": type(attention.q_layernorm).__name__,
        "k_norm": type(attention.k_layernorm).__name__,
        "qk_l2_norm": config.qk_l2_norm,
    }
    rotary = getattr(gpt, "rotary_pos_emb", None)
    if rotary is not None:
        facts["rotary_module_interleaved"] = rotary.rotary_interleaved
        facts["inv_freq"] = rotary.inv_freq.tolist()
        plain = dict(kv_channels=config.kv_channels, rotary_percent=1.0,
                     rotary_base=args.rotary_base, use_cpu_initialization=True)
        facts["inv_freq_unscaled"] = RotaryEmbedding(**plain).inv_freq.tolist()
        for factor in (4.0, 8.0):
            facts[f"inv_freq_scaled_{factor:g}"] = RotaryEmbedding(
                **plain, rope_scaling=True, rope_scaling_factor=factor).inv_freq.tolist()
    if optimizer is not None:
        wd_mult = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                wd_mult[id(param)] = group.get("wd_mult", 1.0)
        names = dict(gpt.named_parameters())
        facts["wd_mult"] = {name: wd_mult[id(p)] for name, p in names.items()
                            if "layers.0." in name and ("layernorm" in name or "linear_qkv" in name)}
    return facts


def build_facts(rank, world_size, cases):
    """{name: facts} of a model built (not trained) from TINY + each case's flags; a case
    ``(flags, withhold)`` builds with the ``withhold`` flags reset to Megatron's defaults."""
    from megatron_moe.arguments import parse_args
    from megatron_moe.models.builder import gpt_model_provider
    from megatron_moe.runtime import global_vars
    from megatron_moe.runtime.initialize import initialize_distributed
    from megatron_moe.training.loop import _build_tokenizer

    out = {}
    for index, (name, (flags, withhold)) in enumerate(cases.items()):
        args = parse_args(TINY + ["--train-iters", "1"] + flags.split())
        if index == 0:
            global_vars.set_args(args)
            initialize_distributed(args)
        _build_tokenizer(args)   # the padded vocabulary
        built = withheld(args, withhold)
        out[name] = model_facts(gpt_model_provider(built), args=built)
    return out


def train_with_facts(rank, world_size, argv, withhold=()):
    """pretrain() on TINY + argv with ``withhold`` not passed to the model builder and the
    optimizer config; (loss history, facts of the trained model, SDPA calls)."""
    import torch.nn.functional as F

    import pretrain_gpt_moe
    from megatron_moe.training import loop
    from tests._train_cases import pretrain_with_step

    facts, calls = {}, [0]
    provider, optimizer_config = pretrain_gpt_moe.gpt_model_provider, loop._optimizer_config
    if withhold:
        pretrain_gpt_moe.gpt_model_provider = lambda args, *a, **k: provider(
            withheld(args, withhold), *a, **k)
        loop._optimizer_config = lambda args, cls: optimizer_config(withheld(args, withhold), cls)
    real_sdpa = F.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        calls[0] += 1
        return real_sdpa(*args, **kwargs)

    def wrap(step):
        def train_step(self, *args, **kwargs):
            if not facts:
                facts.update(model_facts(self.model[0], self.optimizer, self.args))
            return step(self, *args, **kwargs)
        return train_step

    F.scaled_dot_product_attention = counting_sdpa
    try:
        result = pretrain_with_step(TINY + argv, wrap)
    finally:
        F.scaled_dot_product_attention = real_sdpa
        pretrain_gpt_moe.gpt_model_provider, loop._optimizer_config = provider, optimizer_config
    return result["history"], facts, calls[0]


def generate_withheld(rank, world_size, argv, prompts, tokens, withhold=()):
    """tests/_sdpa_cases.generate_counting_sdpa (a checkpoint's greedy generation, SDPA calls
    counted) with ``withhold`` not passed to the model builder."""
    from megatron_moe.models import builder
    from tests._sdpa_cases import generate_counting_sdpa

    provider = builder.gpt_model_provider
    if withhold:
        builder.gpt_model_provider = lambda args, *a, **k: provider(withheld(args, withhold),
                                                                    *a, **k)
    try:
        return generate_counting_sdpa(rank, world_size, argv, prompts, tokens)
    finally:
        builder.gpt_model_provider = provider
