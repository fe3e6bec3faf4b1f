"""Megatron-LM's model-architecture flags (megatron_moe/models/architecture.py): each reaches
megatron-core as Megatron-LM hands it over (TransformerConfig fields, the layer spec, GPTModel's
rotary embedding, OptimizerConfig), checked on the model megatron-core built; a tiny MoE model
trains with them (torch SDPA attention and the local grouped experts included); what the local
path cannot build is refused at parse time with one line. Each check has a mutation (the flag
parsed but not passed on) that makes it fail."""

import math

import pytest
import torch

from megatron_moe.runtime.local_ranks import run_distributed
from tests._arch_cases import TINY, build_facts, generate_withheld, train_with_facts

ROPE = "--position-embedding-type rope"
XAVIER_BOUND = math.sqrt(6 / (32 + 96))   # linear_qkv of TINY: [3 x 32, 32]


def _close(a, b):
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=0, atol=0)


# case: (flags, the check on the built model's facts). Each runs as given and with its flags
# withheld from the builder (Megatron's defaults); the check must pass only the first way.
CASES = {
    "squared-relu": ("--squared-relu", lambda f: f["activation"] == "squared_relu"
                     and f["expert_activation"] == "squared_relu"),
    "squared-relu-grouped-experts": (
        "--squared-relu --moe-grouped-gemm",
        lambda f: f["activation"] == f["expert_activation"] == "squared_relu"),
    "init-method-xavier-uniform": (
        "--init-method-xavier-uniform",
        lambda f: f["init_method"] == f["output_layer_init_method"] == "xavier_uniform_"
        and f["qkv_max"] <= XAVIER_BOUND and f["qkv_std"] > 0.5 * XAVIER_BOUND / math.sqrt(3)),
    "embedding-init-method-std": (
        "--embedding-init-method-std 0.5",
        lambda f: f["embedding_init_method_std"] == 0.5 and abs(f["embedding_std"] - 0.5) < 0.05),
    "use-rope-scaling": (f"{ROPE} --use-rope-scaling",
                         lambda f: _close(f["inv_freq"], f["inv_freq_scaled_8"])
                         and not _close(f["inv_freq"], f["inv_freq_unscaled"])),
    "rope-scaling-factor": (f"{ROPE} --use-rope-scaling --rope-scaling-factor 4",
                            lambda f: _close(f["inv_freq"], f["inv_freq_scaled_4"])
                            and not _close(f["inv_freq"], f["inv_freq_scaled_8"])),
    "rotary-interleaved": (f"{ROPE} --rotary-interleaved",
                           lambda f: f["rotary_interleaved"] and f["rotary_module_interleaved"]),
    "no-rope-freq": (f"{ROPE} --no-rope-freq 2", lambda f: f["no_rope_freq"] == [0, 1]),
    "no-rope-freq-list": (f"{ROPE} --no-rope-freq [1,0]", lambda f: f["no_rope_freq"] == [1, 0]),
    "qk-l2-norm": ("--qk-l2-norm", lambda f: f["q_norm"] == f["k_norm"] == "L2Norm"
                   and f["qk_l2_norm"]),
    "qk-l2-norm-over-qk-layernorm": ("--qk-layernorm --qk-l2-norm",
                                     lambda f: f["q_norm"] == f["k_norm"] == "L2Norm"),
}
# the flags each case withholds in its mutation (the rest stay, e.g. --position-embedding-type)
WITHHELD = {
    "squared-relu": ["--squared-relu"], "squared-relu-grouped-experts": ["--squared-relu"],
    "init-method-xavier-uniform": ["--init-method-xavier-uniform"],
    "embedding-init-method-std": ["--embedding-init-method-std"],
    "use-rope-scaling": ["--use-rope-scaling"], "rope-scaling-factor": ["--rope-scaling-factor"],
    "rotary-interleaved": ["--rotary-interleaved"],
    "no-rope-freq": ["--no-rope-freq"],
    "no-rope-freq-list": ["--no-rope-freq"], "qk-l2-norm": ["--qk-l2-norm"],
    "qk-l2-norm-over-qk-layernorm": ["--qk-l2-norm"],
}


@pytest.fixture(scope="module")
def built():
    """Every case's facts, as given and withheld, from one spawned rank (a model build each)."""
    cases = {}
    for name, (flags, _) in CASES.items():
        cases[(name, False)] = (flags, [])
        cases[(name, True)] = (flags, WITHHELD[name])
    return run_distributed(build_facts, 1, cases, timeout_s=300)[0]


@pytest.mark.parametrize("mutate", [False, True], ids=["passed", "withheld"])
@pytest.mark.parametrize("case", list(CASES))
def test_flag_reaches_megatron_core(built, case, mutate):
    check = CASES[case][1]
    assert check(built[(case, mutate)]) is (not mutate), built[(case, mutate)]


# with Transformer Engine: (flags, withheld in the mutation, the check on megatron-core's config)
TE_CASES = {
    "te-only": ("--swiglu --bf16 --apply-layernorm-1p --fp32-residual-connection",
                ["--apply-layernorm-1p", "--fp32-residual-connection"],
                lambda c: c.layernorm_zero_centered_gamma and c.fp32_residual_connection),
    # megatron-core fuses bias + gelu/swiglu/quick-geglu only: Megatron's default gelu selector
    # (--bias-gelu-fusion) must not reach a squared-ReLU config
    "squared-relu": ("--squared-relu", ["--squared-relu"],
                     lambda c: c.activation_func.__name__ == "squared_relu"
                     and not c.bias_activation_fusion),
}


@pytest.mark.parametrize("mutate", [False, True], ids=["passed", "withheld"])
@pytest.mark.parametrize("case", list(TE_CASES))
def test_transformer_engine_config(monkeypatch, case, mutate):
    """Transformer Engine pretended present (only the parse and megatron-core's config are
    built, no TE module): the flags reach the TransformerConfig fields."""
    from megatron_moe.arguments import parse_args
    from megatron_moe.models import builder
    from tests._arch_cases import withheld

    flags, withhold, check = TE_CASES[case]
    monkeypatch.setattr(builder, "have_transformer_engine", lambda: True)
    argv = [a for a in TINY if a not in ("--transformer-impl", "local")]
    args = parse_args(argv + ["--train-iters", "1"] + flags.split(), world_size=1)
    assert args.transformer_impl == "transformer_engine"
    if mutate:
        args = withheld(args, withhold)
    try:
        config = builder.transformer_config_from_args(args)
    except ValueError:   # megatron-core refuses the withheld config (gelu fused without a bias)
        config = None
    assert bool(config is not None and check(config)) is not mutate


# refused at parse time: (flags, the one line's start); the mutation drops architecture's checks
REFUSALS = {
    "layernorm-1p-local": ("--apply-layernorm-1p",
                           "--apply-layernorm-1p needs --transformer-impl transformer_engine"),
    "fp32-residual-local": ("--bf16 --fp32-residual-connection",
                            "--fp32-residual-connection needs --transformer-impl transformer_engine"),
    "fp32-residual-fp32": ("--fp32-residual-connection",
                           "--fp32-residual-connection needs --bf16 or --fp16"),
    "squared-relu-swiglu": ("--squared-relu --swiglu",
                            "--squared-relu and --swiglu are mutually exclusive"),
    "rope-scaling-learned": ("--use-rope-scaling",
                             "--use-rope-scaling needs --position-embedding-type rope"),
    "rope-scaling-factor": (f"{ROPE} --use-rope-scaling --rope-scaling-factor 0",
                            "--rope-scaling-factor must be > 0"),
    "interleaved-learned": ("--rotary-interleaved", "--rotary-interleaved needs"),
    "interleaved-yarn": ("--position-embedding-type yarn --rotary-interleaved",
                         "--rotary-interleaved needs"),
    "interleaved-mla": ("--multi-latent-attention --rotary-interleaved " + ROPE,
                        "--rotary-interleaved needs"),
    "no-rope-freq-divides": (f"{ROPE} --no-rope-freq 3", "--no-rope-freq 3 must be >= 1 and divide"),
    "no-rope-freq-length": (f"{ROPE} --no-rope-freq [1,0,1]", "--no-rope-freq has 3 entries"),
    "qk-l2-norm-mla": ("--multi-latent-attention --qk-l2-norm " + ROPE,
                       "--qk-l2-norm is not supported with --multi-latent-attention"),
    "wd-qk-layernorm-alone": ("--apply-wd-to-qk-layernorm",
                              "--apply-wd-to-qk-layernorm needs --qk-layernorm"),
    "wd-cond-type-choice": ("--qk-layernorm --no-weight-decay-cond-type all",
                            "--no-weight-decay-cond-type all: the only choice is"),
    "embedding-std-negative": ("--embedding-init-method-std -1",
                               "--embedding-init-method-std must be >= 0"),
}


@pytest.mark.parametrize("mutate", [False, True], ids=["checked", "unchecked"])
@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_at_parse_time_with_one_line(monkeypatch, capsys, case, mutate):
    from megatron_moe.arguments import parse_args
    from megatron_moe.models import architecture

    flags, line = REFUSALS[case]
    if mutate:
        monkeypatch.setattr(architecture, "validate_args", lambda args: None)
    refused = True
    try:
        parse_args(TINY + ["--train-iters", "1"] + flags.split(), world_size=1)
        refused = False
    except SystemExit:
        pass
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (refused and f"error: {line}" in err) is not mutate, err


@pytest.mark.parametrize("mutate", [False, True], ids=["checked", "unchecked"])
def test_deprecated_weight_decay_cond_type_sets_the_flag(monkeypatch, mutate):
    """Megatron-LM's validate_args: --no-weight-decay-cond-type apply_wd_to_qk_layernorm is
    --apply-wd-to-qk-layernorm (the optimizer config reads that)."""
    from megatron_moe.arguments import parse_args
    from megatron_moe.models import architecture

    if mutate:
        monkeypatch.setattr(architecture, "validate_args", lambda args: None)
    args = parse_args(TINY + "--train-iters 1 --qk-layernorm --no-weight-decay-cond-type "
                             "apply_wd_to_qk_layernorm".split(), world_size=1)
    assert args.apply_wd_to_qk_layernorm is not mutate


# (flags, withheld in the mutation). torch SDPA attention with RoPE variants and q/k L2 norm,
# squared-ReLU grouped experts, Xavier init; the q/k layernorm weights decayed
TRAINED = {
    "sdpa": (f"--attention-backend flash {ROPE} --rotary-interleaved --no-rope-freq 2 "
             "--use-rope-scaling --rope-scaling-factor 4 --rotary-base 1000000 --qk-l2-norm "
             "--squared-relu --moe-grouped-gemm --init-method-xavier-uniform "
             "--embedding-init-method-std 0.05",
             ["--rotary-interleaved", "--no-rope-freq", "--use-rope-scaling", "--qk-l2-norm",
              "--squared-relu", "--init-method-xavier-uniform", "--embedding-init-method-std"]),
    "qk-layernorm-decay": ("--qk-layernorm --apply-wd-to-qk-layernorm --weight-decay 0.1",
                           ["--apply-wd-to-qk-layernorm"]),
}


def _trained_as_asked(name, facts):
    if name == "qk-layernorm-decay":
        decay = facts["wd_mult"]
        # megatron-core's rule: the q/k layernorm weights and biases decay, other norms do not
        norms = [n for n in decay if "q_layernorm" in n or "k_layernorm" in n]
        others = [n for n in decay if "input_layernorm" in n or "pre_mlp_layernorm" in n]
        return len(norms) == 4 and len(others) == 4 and all(decay[n] == 1.0 for n in norms) \
            and all(decay[n] == 0.0 for n in others) \
            and decay["decoder.layers.0.self_attention.linear_qkv.weight"] == 1.0
    return (facts["activation"] == facts["expert_activation"] == "squared_relu"
            and facts["init_method"] == "xavier_uniform_" and facts["rotary_interleaved"]
            and facts["no_rope_freq"] == [0, 1] and facts["q_norm"] == "L2Norm"
            and _close(facts["inv_freq"], facts["inv_freq_scaled_4"])
            and facts["embedding_init_method_std"] == 0.05)


@pytest.mark.parametrize("mutate", [False, True], ids=["passed", "withheld"])
@pytest.mark.parametrize("name", list(TRAINED))
def test_trains_with_the_flags(name, mutate):
    """Three iterations at one rank: finite, falling losses; the model and optimizer hold the
    flags' settings (withheld: they do not). With SDPA: the losses of megatron-core's local
    attention within 1e-4, and SDPA ran."""
    flags, withhold = TRAINED[name]
    argv = ["--train-iters", "3"] + flags.split()
    history, facts, sdpa_calls = run_distributed(train_with_facts, 1, argv,
                                                 withhold=withhold if mutate else (),
                                                 timeout_s=300)[0]
    losses = history["lm_loss"]
    print(f"{name} ({'withheld' if mutate else 'passed'}): losses {losses}")
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], losses
    assert _trained_as_asked(name, facts) is (not mutate), facts
    if name == "sdpa" and not mutate:
        # (iterations + the validation and test batches after training) x layers x micro-batches
        assert sdpa_calls == (3 + 2) * 2 * 4, sdpa_calls
        local_argv = [a if a != "flash" else "local" for a in argv]
        local, _, local_calls = run_distributed(train_with_facts, 1, local_argv, timeout_s=300)[0]
        gap = max(abs(a - b) for a, b in zip(losses, local["lm_loss"]))
        print(f"sdpa vs local attention: max |loss gap| {gap:.3g}")
        assert local_calls == 0 and gap < 1e-4, (losses, local["lm_loss"])


def test_generation_rebuilds_the_flags_from_the_checkpoint(tmp_path):
    """Trained and saved with the flags, then greedy generation with --use-checkpoint-args:
    megatron-core's inference engine runs the same model with SDPA as with its local attention
    (tokens equal, log probs within 1e-4, SDPA ran); built with the flags withheld, the log
    probs move (the checkpoint's flags are what the generation model was built from)."""
    from tests import _data_helpers as H
    from tests._sdpa_cases import train_counting_sdpa

    flags, withhold = TRAINED["sdpa"]
    flags = flags.replace("--attention-backend flash ", "")
    data, tok = H.sp_dataset(str(tmp_path), max_docs=60, vocab_size=300)
    save = str(tmp_path / "ckpt")
    argv = TINY[:]
    for flag in ("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"):
        argv.remove(flag)
    argv += ["--train-iters", "2", "--split", "90,10,0", "--data-path", data,
             "--tokenizer-type", "SentencePieceTokenizer",
             "--tokenizer-model", tok, "--save", save] + flags.split()
    run_distributed(train_counting_sdpa, 1, argv, timeout_s=300)
    out = {}
    for name, backend, held in (("local", "local", ()), ("flash", "flash", ()),
                                ("withheld", "local", withhold)):
        gen_argv = ["--load", save, "--use-checkpoint-args", "--transformer-impl", "local",
                    "--attention-backend", backend]
        out[name] = run_distributed(generate_withheld, 1, gen_argv, ["The module"], 6,
                                    withhold=held, timeout_s=300)[0]
    ((local_tokens, local_logp),), local_calls = out["local"]
    ((flash_tokens, flash_logp),), flash_calls = out["flash"]
    ((_, held_logp),), _ = out["withheld"]
    gap = max(abs(a - b) for a, b in zip(local_logp, flash_logp))
    moved = max(abs(a - b) for a, b in zip(local_logp, held_logp))
    print(f"generation: flash vs local max |log prob gap| {gap:.3g}; withheld flags move "
          f"them by up to {moved:.3g}")
    assert local_calls == 0 and flash_calls > 0
    assert flash_tokens == local_tokens and gap < 1e-4
    assert moved > 1e-3
