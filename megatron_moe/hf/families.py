"""Per-family mappings between Hugging Face checkpoints and megatron-core's GPTModel.

Both sides are described by one ``Spec`` (layer count, heads, experts, which layers are MoE, ...),
made from an HF ``config.json`` or from a Megatron checkpoint's stored args. ``rules_for(spec)``
lists, for every megatron-core parameter (its name in an unsharded TP=EP=PP=1 model), the HF
tensors it is made of and how: a plain copy, the fused QKV layout, or gate/up concatenated for
SwiGLU. The same rules run forwards (HF -> megatron, ``merge``) and backwards (``split``); both
are pure concatenation/slicing, so a round trip is bit-exact.

Layout facts the rules encode (megatron-core 0.16):
  * ``linear_qkv`` rows are grouped per query group: for each KV head g, the q heads that share
    it (heads/groups of them), then k_g, then v_g. HF keeps q_proj, k_proj, v_proj apart, and q
    head h uses KV head h // (heads/groups) (transformers' repeat_kv).
  * ``linear_fc1`` of a SwiGLU MLP is [gate; up] (megatron-core applies silu to the first half);
    HF calls them gate_proj/up_proj (Qwen2) or w1/w3 (Mixtral), w2/down_proj is linear_fc2.
  * RoPE: megatron-core's default (rotary_interleaved=False) rotates halves like HF's
    rotate_half, with inv_freq = base^(-2i/d): only the base (rope_theta) has to be carried.
  * Router: ``mlp.router.weight`` [experts, hidden] is HF's gate. Mixtral renormalises the top-k
    softmax probabilities = megatron-core's softmax over the top-k logits (no pre-softmax);
    Qwen2-MoE with norm_topk_prob=False keeps softmax-then-top-k = --moe-router-pre-softmax.
  * Qwen2-MoE's shared expert gate is sigmoid(x @ w^T), w [1, hidden] = megatron-core's
    ``shared_experts.gate_weight`` (--moe-shared-expert-gate).
  * DeepSeek-V3 (class DeepseekV3): MLA's projections are plain copies (same row order on both
    sides); its MTP layers, absent from transformers' model, are the official checkpoint's
    ``model.layers.{num_hidden_layers + k}.*`` <-> megatron-core's ``mtp.layers.k.*``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch



def _aux_loss_coeff(args) -> float:
    """HF configs carry one router aux-loss coefficient: the run's, or with several
    --moe-router-load-balancing-type values the one paired with aux_loss (0.0 without it)."""
    kinds, coeffs = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    if not isinstance(kinds, list):
        return coeffs
    return dict(zip(kinds, coeffs)).get("aux_loss", 0.0)

class ConversionError(ValueError):
    """A checkpoint or config this converter cannot map faithfully; the message says which field."""


@dataclasses.dataclass
class Spec:
    family: str
    num_layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    vocab: int                       # true vocabulary (HF vocab_size), before Megatron's padding
    num_experts: int
    moe_layers: list                 # per layer: True = MoE, False = dense SwiGLU MLP
    ffn: int                         # dense MLP intermediate size
    moe_ffn: int
    shared_ffn: int | None = None    # shared expert intermediate size (Qwen2-MoE)
    shared_gate: bool = False
    qkv_bias: bool = False
    tied: bool = False
    qk_norm: bool = False            # RMSNorm of each q/k head (Qwen3: q_norm/k_norm)
    mla: bool = False                # DeepSeek's multi-latent attention (then heads only)
    q_lora: int | None = None        # query LoRA rank (None: one q projection, V2-Lite)
    expert_bias: bool = False        # router's aux-loss-free bias (e_score_correction_bias)
    mtp_layers: int = 0              # DeepSeek-V3's next-token-prediction layers after the model
    linear_bias: bool = False        # every linear has a bias: q/k/v/o, router, experts (gpt-oss)
    sinks: bool = False              # a learned attention-sink logit per head (gpt-oss)


@dataclasses.dataclass
class Rule:
    meg: str                         # megatron-core parameter name (unsharded model)
    hf: tuple                        # HF tensor names, in merge order
    merge: Callable                  # list of HF tensors -> megatron tensor
    split: Callable                  # megatron tensor -> list of HF tensors
    vocab: bool = False              # rows are the vocabulary (Megatron pads them)
    stacked: tuple | None = None     # (index, count): each HF tensor is slice ``index`` (dim 0)
    #                                  of a stored tensor of ``count`` slices (gpt-oss's experts)


def _copy():
    return (lambda ts: ts[0]), (lambda t: [t])


def _cat(sizes):
    """[gate; up] along rows (SwiGLU linear_fc1)."""
    return (lambda ts: torch.cat(ts, dim=0)), (lambda t: list(torch.split(t, sizes, dim=0)))


def _qkv(heads, groups, head_dim):
    """q/k/v (weights [rows, hidden] or biases [rows]) <-> megatron-core's per-group layout."""
    per = heads // groups

    def merge(ts):
        q, k, v = ts
        tail = q.shape[1:]
        q = q.reshape(groups, per * head_dim, *tail)
        k = k.reshape(groups, head_dim, *tail)
        v = v.reshape(groups, head_dim, *tail)
        return torch.cat([q, k, v], dim=1).reshape(groups * (per + 2) * head_dim, *tail)

    def split(t):
        tail = t.shape[1:]
        g = t.reshape(groups, (per + 2) * head_dim, *tail)
        q, k, v = torch.split(g, [per * head_dim, head_dim, head_dim], dim=1)
        return [q.reshape(heads * head_dim, *tail), k.reshape(groups * head_dim, *tail),
                v.reshape(groups * head_dim, *tail)]

    return merge, split


def _transposed():
    """HF stores x @ W ([in, out]); megatron-core's linear weight is [out, in]."""
    return (lambda ts: ts[0].t().contiguous()), (lambda t: [t.t()])


def _glu_interleaved(transposed: bool):
    """gpt-oss's fused gate/up: columns alternate gate, up, gate, up, ... (HF's ``[..., ::2]`` /
    ``[..., 1::2]``); megatron-core's linear_fc1 is [gate; up]. Weights are also transposed."""
    def merge(ts):
        t = ts[0]
        out = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
        return out.t().contiguous() if transposed else out

    def split(t):
        t = t.t() if transposed else t
        half = t.shape[-1] // 2
        out = torch.empty(t.shape, dtype=t.dtype)
        out[..., 0::2], out[..., 1::2] = t[..., :half], t[..., half:]
        return [out]

    return merge, split


def _rope_theta(cfg, default):
    """transformers < 5 writes rope_theta at top level, >= 5 inside rope_parameters."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind not in (None, "default"):
        raise ConversionError(f"config.json: rope_type {kind!r} is not supported (plain RoPE only)")
    theta = cfg.get("rope_theta", params.get("rope_theta", default))
    if float(theta) != int(theta):
        raise ConversionError(f"config.json: rope_theta {theta} is not an integer "
                              f"(--rotary-base is an int, as in Megatron-LM)")
    return int(theta)


def _rope_parameters(cfg, default_theta) -> dict:
    """One dict of the rope fields whichever way config.json spells them: transformers >= 5
    writes ``rope_parameters`` (with rope_theta), the released checkpoints ``rope_scaling``
    (``type`` or ``rope_type``) + a top-level ``rope_theta``."""
    rope = dict(cfg.get("rope_scaling") or {}, **(cfg.get("rope_parameters") or {}))
    rope.setdefault("rope_theta", cfg.get("rope_theta", default_theta))
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


class Family:
    name = ""
    architecture = ""
    rope_default = 10000
    qk_norm = False  # q_norm/k_norm per head = megatron-core's --qk-layernorm

    # -- HF names (per layer i, prefix model.layers.{i}.) ----------------------------------------
    def router(self, i):
        raise NotImplementedError

    def expert(self, i, e):
        """(gate, up, down) names of expert e."""
        raise NotImplementedError

    def expert_rules(self, spec: Spec, m, i) -> list:
        """The routed experts of layer ``i`` (megatron prefix ``m``): gate/up/down per expert."""
        R = []
        for e in range(spec.num_experts):
            gate, up, down = self.expert(i, e)
            x = m + f"mlp.experts.local_experts.{e}."
            R.append(Rule(x + "linear_fc1.weight", (gate, up),
                          *_cat([spec.moe_ffn, spec.moe_ffn])))
            R.append(Rule(x + "linear_fc2.weight", (down,), *_copy()))
        return R

    def shared(self, i):
        raise ConversionError(f"{self.name} has no shared experts")

    def router_linear_bias(self, i):
        raise ConversionError(f"{self.name} has no linear biases (train with --disable-bias-linear)")

    def dense(self, i):
        raise ConversionError(f"{self.name} has no dense MLP layers")

    # -- config <-> spec/flags -------------------------------------------------------------------
    def _common(self, cfg) -> dict:
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConversionError(f"config.json: hidden_act {act!r} (only silu = SwiGLU is supported)")
        heads = cfg["num_attention_heads"]
        return dict(
            family=self.name, num_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
            heads=heads, groups=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab=cfg["vocab_size"],
            tied=bool(cfg.get("tie_word_embeddings", False)))

    def spec_from_config(self, cfg) -> Spec:
        raise NotImplementedError

    def flags_from_config(self, cfg) -> list:
        """pretrain_gpt_moe.py model flags that build this HF model in megatron-core."""
        s = self.spec_from_config(cfg)
        flags = [
            "--num-layers", s.num_layers, "--hidden-size", s.hidden,
            "--num-attention-heads", s.heads, "--num-query-groups", s.groups,
            "--kv-channels", s.head_dim, "--ffn-hidden-size", s.ffn,
            "--max-position-embeddings", cfg.get("max_position_embeddings", 4096),
            "--seq-length", min(int(cfg.get("max_position_embeddings", 4096)), 4096),
            "--position-embedding-type", "rope", "--rotary-base", _rope_theta(cfg, self.rope_default),
            "--normalization", "RMSNorm", "--norm-epsilon", cfg.get("rms_norm_eps", 1e-6),
            "--swiglu", "--disable-bias-linear",
            "--hidden-dropout", 0.0, "--attention-dropout", cfg.get("attention_dropout", 0.0),
            "--init-method-std", cfg.get("initializer_range", 0.02),
            "--num-experts", s.num_experts, "--moe-ffn-hidden-size", s.moe_ffn,
            "--moe-router-topk", cfg["num_experts_per_tok"],
            "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", cfg.get("router_aux_loss_coef", 0.0),
        ]
        if not s.tied:
            flags.append("--untie-embeddings-and-output-weights")
        if not all(s.moe_layers):
            flags += ["--moe-layer-freq", "[" + ",".join(str(int(m)) for m in s.moe_layers) + "]"]
        return [str(f) for f in flags]

    def config_from_args(self, args, spec: Spec, dtype: str) -> dict:
        """A config.json for a checkpoint that was not converted from HF (trained here)."""
        cfg = {
            "architectures": [self.architecture], "model_type": self.name,
            "vocab_size": spec.vocab, "hidden_size": spec.hidden,
            "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.groups, "head_dim": spec.head_dim, "hidden_act": "silu",
            "max_position_embeddings": args.max_position_embeddings,
            "rms_norm_eps": args.norm_epsilon, "rope_theta": float(args.rotary_base),
            "num_experts_per_tok": args.moe_router_topk,
            "router_aux_loss_coef": _aux_loss_coeff(args),
            "tie_word_embeddings": spec.tied, "attention_dropout": 0.0,
            "initializer_range": args.init_method_std, "torch_dtype": dtype, "use_cache": True,
        }
        return cfg

    def check_args(self, args):
        """Refuse megatron settings the HF architecture cannot express (never convert silently
        into a different model)."""
        problems = _decoder_problems(args)
        if getattr(args, "multi_latent_attention", False):
            problems.append("--multi-latent-attention (try --hf-family deepseek_v3)")
        if args.moe_router_score_function != "softmax":
            problems.append(f"--moe-router-score-function {args.moe_router_score_function}")
        for flag in ("moe_router_topk_scaling_factor", "moe_router_group_topk"):
            if getattr(args, flag, None):
                problems.append(f"--{flag.replace('_', '-')}")
        if getattr(args, "moe_router_enable_expert_bias", False):
            problems.append("--moe-router-enable-expert-bias")
        if bool(getattr(args, "qk_layernorm", False)) != self.qk_norm:
            problems.append("no --qk-layernorm (HF: q_norm/k_norm)" if self.qk_norm
                            else "--qk-layernorm")
        if problems:
            raise ConversionError(f"the checkpoint cannot be written as {self.architecture}: "
                                  + "; ".join(problems))


def _decoder_problems(args) -> list:
    """What no family here expresses (each family then adds its own)."""
    problems = []
    if args.normalization != "RMSNorm":
        problems.append(f"--normalization {args.normalization} (HF: RMSNorm)")
    if not args.swiglu:
        problems.append("no --swiglu (HF: SiLU-gated MLP)")
    if args.position_embedding_type != "rope":
        problems.append(f"--position-embedding-type {args.position_embedding_type} (HF: rope)")
    if args.add_bias_linear:
        problems.append("linear biases (HF: none; pass --disable-bias-linear)")
    if args.num_experts is None:
        problems.append("no --num-experts (a dense model)")
    return problems


class Mixtral(Family):
    name = "mixtral"
    architecture = "MixtralForCausalLM"
    rope_default = 1000000  # MixtralConfig's default

    def router(self, i):
        return f"model.layers.{i}.block_sparse_moe.gate.weight"

    def expert(self, i, e):
        p = f"model.layers.{i}.block_sparse_moe.experts.{e}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"

    def spec_from_config(self, cfg) -> Spec:
        if cfg.get("sliding_window"):
            # Mistral-style local attention is not in megatron-core's GPT attention here
            raise ConversionError(f"config.json: sliding_window={cfg['sliding_window']} "
                                  f"(only full attention is supported; set it to null)")
        n = cfg["num_hidden_layers"]
        return Spec(**self._common(cfg), num_experts=cfg["num_local_experts"],
                    moe_layers=[True] * n, ffn=cfg["intermediate_size"],
                    moe_ffn=cfg["intermediate_size"])

    def config_from_args(self, args, spec, dtype):
        cfg = super().config_from_args(args, spec, dtype)
        cfg.update(intermediate_size=spec.moe_ffn, num_local_experts=spec.num_experts,
                   sliding_window=None, router_jitter_noise=0.0)
        return cfg

    def check_args(self, args):
        super().check_args(args)
        problems = []
        if args.moe_router_pre_softmax:
            problems.append("--moe-router-pre-softmax (Mixtral renormalises the top-k)")
        if args.moe_shared_expert_intermediate_size:
            problems.append("shared experts")
        if args.add_qkv_bias:
            problems.append("--add-qkv-bias")
        if not all(moe_layer_list(args)):
            problems.append("dense layers (--moe-layer-freq)")
        if problems:
            raise ConversionError(f"the checkpoint cannot be written as {self.architecture}: "
                                  + "; ".join(problems) + " (try --hf-family qwen2_moe)")


class Qwen2Moe(Family):
    name = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"

    def router(self, i):
        return f"model.layers.{i}.mlp.gate.weight"

    def expert(self, i, e):
        p = f"model.layers.{i}.mlp.experts.{e}."
        return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"

    def shared(self, i):
        p = f"model.layers.{i}.mlp.shared_expert."
        return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"

    def shared_gate(self, i):
        return f"model.layers.{i}.mlp.shared_expert_gate.weight"

    def dense(self, i):
        p = f"model.layers.{i}.mlp."
        return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"

    def spec_from_config(self, cfg) -> Spec:
        if cfg.get("use_sliding_window"):
            raise ConversionError("config.json: use_sliding_window=true is not supported")
        if cfg.get("qkv_bias") is False:
            raise ConversionError("config.json: qkv_bias=false (Qwen2-MoE has QKV biases)")
        experts = cfg["num_experts"]
        moe = self._moe_layers(cfg, experts)
        shared = cfg.get("shared_expert_intermediate_size") or None
        return Spec(**self._common(cfg), num_experts=experts, moe_layers=moe,
                    ffn=cfg["intermediate_size"], moe_ffn=cfg["moe_intermediate_size"],
                    shared_ffn=shared, shared_gate=shared is not None, qkv_bias=True)

    def flags_from_config(self, cfg):
        s = self.spec_from_config(cfg)
        flags = super().flags_from_config(cfg) + ["--add-qkv-bias"]
        if s.shared_ffn:
            flags += ["--moe-shared-expert-intermediate-size", str(s.shared_ffn),
                      "--moe-shared-expert-gate"]
        if not cfg.get("norm_topk_prob", False):
            flags.append("--moe-router-pre-softmax")
        return flags

    @staticmethod
    def _moe_layers(cfg, experts) -> list:
        """Which layers are MoE: every decoder_sparse_step-th, except mlp_only_layers."""
        step = cfg.get("decoder_sparse_step", 1)
        only_mlp = set(cfg.get("mlp_only_layers") or [])
        return [experts > 0 and i not in only_mlp and (i + 1) % step == 0
                for i in range(cfg["num_hidden_layers"])]

    def _qwen_config(self, args, spec, dtype) -> dict:
        """The fields Qwen2-MoE and Qwen3-MoE configs share."""
        cfg = Family.config_from_args(self, args, spec, dtype)
        n = spec.num_layers
        cfg.update(intermediate_size=spec.ffn, moe_intermediate_size=spec.moe_ffn,
                   num_experts=spec.num_experts, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(n) if not spec.moe_layers[i]],
                   norm_topk_prob=not args.moe_router_pre_softmax,
                   use_sliding_window=False, sliding_window=None, max_window_layers=n)
        return cfg

    def config_from_args(self, args, spec, dtype):
        cfg = self._qwen_config(args, spec, dtype)
        cfg.update(shared_expert_intermediate_size=spec.shared_ffn or 0, qkv_bias=True)
        return cfg

    def check_args(self, args):
        super().check_args(args)
        problems = []
        if not args.add_qkv_bias:
            problems.append("no --add-qkv-bias (Qwen2-MoE has QKV biases)")
        if args.moe_shared_expert_intermediate_size and not args.moe_shared_expert_gate:
            problems.append("shared experts without --moe-shared-expert-gate")
        if problems:
            raise ConversionError(f"the checkpoint cannot be written as {self.architecture}: "
                                  + "; ".join(problems))


class Qwen3Moe(Qwen2Moe):
    """Qwen2-MoE's MLP names; no shared expert, no QKV bias, RMSNorm of every q and k head
    (q_norm/k_norm, before RoPE as megatron-core's --qk-layernorm), head_dim independent of
    hidden_size / heads (--kv-channels)."""

    name = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    qk_norm = True

    def spec_from_config(self, cfg) -> Spec:
        if cfg.get("use_sliding_window"):
            raise ConversionError("config.json: use_sliding_window=true is not supported")
        if cfg.get("attention_bias"):
            raise ConversionError("config.json: attention_bias=true (o_proj has a bias there; "
                                  "megatron-core's --add-qkv-bias covers q/k/v only)")
        # Qwen's configs say num_experts; transformers >= 5 writes num_local_experts
        experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
        moe = self._moe_layers(cfg, experts)
        return Spec(**self._common(cfg), num_experts=experts, moe_layers=moe,
                    ffn=cfg["intermediate_size"], moe_ffn=cfg["moe_intermediate_size"],
                    qk_norm=True)

    def flags_from_config(self, cfg):
        flags = Family.flags_from_config(self, cfg) + ["--qk-layernorm"]
        if not cfg.get("norm_topk_prob", False):  # transformers' default: no renormalisation
            flags.append("--moe-router-pre-softmax")
        return flags

    def config_from_args(self, args, spec, dtype):
        cfg = self._qwen_config(args, spec, dtype)
        cfg["attention_bias"] = False
        return cfg

    def check_args(self, args):
        Family.check_args(self, args)
        problems = []
        if args.add_qkv_bias:
            problems.append("--add-qkv-bias (Qwen3-MoE has no attention biases)")
        if args.moe_shared_expert_intermediate_size:
            problems.append("shared experts (Qwen3-MoE has none)")
        if problems:
            raise ConversionError(f"the checkpoint cannot be written as {self.architecture}: "
                                  + "; ".join(problems))


class DeepseekV3(Family):
    """DeepSeek-V3 (transformers' DeepseekV3ForCausalLM): MLA with query and KV LoRA and their
    latent RMSNorms (--qk-layernorm), decoupled RoPE whose interleaved layout (rope_interleave)
    is what megatron-core's MLA de-interleaves, a dense first ``first_k_dense_replace`` layers,
    sigmoid group-limited routing with the aux-loss-free bias (e_score_correction_bias =
    the router's expert_bias) and a shared expert. The MTP layers (num_nextn_predict_layers) are
    stored as the official checkpoint stores them, as layers ``num_hidden_layers + k`` with
    enorm/hnorm/eh_proj/shared_head and their own embed_tokens / shared_head.head copies;
    transformers' model ignores them."""

    name = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"

    router, expert, dense = Qwen2Moe.router, Qwen2Moe.expert, Qwen2Moe.dense  # same names

    def router_bias(self, i):
        return f"model.layers.{i}.mlp.gate.e_score_correction_bias"

    def shared(self, i):
        p = f"model.layers.{i}.mlp.shared_experts."
        return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"

    def spec_from_config(self, cfg) -> Spec:
        problems = []
        if cfg.get("attention_bias"):
            problems.append("attention_bias=true")
        if not cfg.get("rope_interleave", True):
            problems.append("rope_interleave=false (megatron-core's MLA de-interleaves the rope part)")
        if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
            problems.append(f"topk_method {cfg['topk_method']!r} (noaux_tc only)")
        if cfg.get("scoring_func", "sigmoid") != "sigmoid":
            problems.append(f"scoring_func {cfg['scoring_func']!r} (sigmoid only)")
        k, groups, topk_group = cfg["num_experts_per_tok"], cfg.get("n_group", 1), cfg.get("topk_group", 1)
        # transformers scores a group by its top 2 experts, megatron-core by its top topk/group_topk
        if groups > 1 and k // topk_group != 2:
            problems.append(f"num_experts_per_tok / topk_group = {k}/{topk_group} != 2 "
                            "(megatron-core scores a group by its top num_experts_per_tok/"
                            "topk_group experts, transformers by its top 2)")
        if not cfg.get("norm_topk_prob", True) and k > 1:
            problems.append("norm_topk_prob=false (megatron-core renormalises sigmoid top-k)")
        problems += self._rope_problems(cfg)
        if problems:
            raise ConversionError("config.json: " + "; ".join(problems))
        n, dense = cfg["num_hidden_layers"], cfg.get("first_k_dense_replace", 0)
        heads = cfg["num_attention_heads"]
        return Spec(family=self.name, num_layers=n, hidden=cfg["hidden_size"], heads=heads,
                    groups=heads, head_dim=cfg["qk_nope_head_dim"], vocab=cfg["vocab_size"],
                    tied=bool(cfg.get("tie_word_embeddings", False)),
                    num_experts=cfg["n_routed_experts"], moe_layers=[i >= dense for i in range(n)],
                    ffn=cfg["intermediate_size"], moe_ffn=cfg["moe_intermediate_size"],
                    shared_ffn=(cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"]
                    or None, qk_norm=True, mla=True, q_lora=cfg.get("q_lora_rank"),
                    expert_bias=True, mtp_layers=cfg.get("num_nextn_predict_layers") or 0)

    @staticmethod
    def _rope_problems(cfg) -> list:
        """What of the config's rope megatron-core's MLA cannot reproduce (YaRN is fine: its
        YarnRotaryEmbedding + softmax scale are transformers' DeepSeek-V3 yarn)."""
        rope = _rope_parameters(cfg, 10000)
        problems = []
        if rope["rope_type"] not in ("default", "yarn"):
            problems.append(f"rope_type {rope['rope_type']!r} (default or yarn)")
        theta = rope["rope_theta"]
        if float(theta) != int(theta):
            problems.append(f"rope_theta {theta} is not an integer (--rotary-base is an int)")
        if rope["rope_type"] != "yarn":
            return problems
        if rope.get("attention_factor") is not None:
            problems.append("rope attention_factor (megatron-core derives it from factor, "
                            "mscale and mscale_all_dim)")
        if not rope.get("truncate", True):
            problems.append("rope truncate=false (megatron-core's MLA YaRN always rounds)")
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            problems.append("partial_rotary_factor != 1")
        if rope.get("mscale_all_dim") and not rope.get("mscale"):
            # transformers: cos/sin x get_mscale(factor); megatron-core x get_mscale(factor,
            # mscale) / get_mscale(factor, mscale_all_dim): no --mscale makes them equal
            problems.append("rope mscale_all_dim without mscale")
        return problems

    @staticmethod
    def _rope_flags(cfg) -> list:
        """--rotary-base, and --rope-type with YaRN's flags: transformers' DeepSeek-V3 yarn
        multiplies cos/sin by get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        when both are set (else get_mscale(factor)) and the softmax scale by
        get_mscale(factor, mscale_all_dim)^2, which is megatron-core's MLA YaRN with the same
        values (mscale 1, mscale_all_dim 0 = its defaults for 'neither set')."""
        rope = _rope_parameters(cfg, 10000)
        flags = ["--position-embedding-type", "rope", "--rotary-base", int(rope["rope_theta"])]
        if rope["rope_type"] != "yarn":
            return flags + ["--rope-type", "rope"]
        original = int(rope["original_max_position_embeddings"])
        factor = rope.get("factor") or cfg["max_position_embeddings"] / original  # transformers'
        flags += ["--rope-type", "yarn", "--rotary-scaling-factor", float(factor),
                  "--yarn-original-max-position-embeddings", original,
                  "--yarn-beta-fast", float(rope.get("beta_fast") or 32.0),
                  "--yarn-beta-slow", float(rope.get("beta_slow") or 1.0)]
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            flags += ["--mscale", float(rope["mscale"]),
                      "--mscale-all-dim", float(rope["mscale_all_dim"])]
        return flags

    def flags_from_config(self, cfg):
        s = self.spec_from_config(cfg)
        flags = [
            "--num-layers", s.num_layers, "--hidden-size", s.hidden,
            "--num-attention-heads", s.heads, "--ffn-hidden-size", s.ffn,
            "--max-position-embeddings", cfg.get("max_position_embeddings", 4096),
            "--seq-length", min(int(cfg.get("max_position_embeddings", 4096)), 4096),
            *self._rope_flags(cfg),
            "--normalization", "RMSNorm", "--norm-epsilon", cfg.get("rms_norm_eps", 1e-6),
            "--swiglu", "--disable-bias-linear",
            "--hidden-dropout", 0.0, "--attention-dropout", cfg.get("attention_dropout", 0.0),
            "--init-method-std", cfg.get("initializer_range", 0.02),
            "--multi-latent-attention", "--kv-lora-rank", cfg["kv_lora_rank"],
            "--qk-head-dim", cfg["qk_nope_head_dim"], "--qk-pos-emb-head-dim",
            cfg["qk_rope_head_dim"], "--v-head-dim", cfg["v_head_dim"],
            "--kv-channels", cfg["qk_nope_head_dim"], "--qk-layernorm",
            "--num-experts", s.num_experts, "--moe-ffn-hidden-size", s.moe_ffn,
            "--moe-router-topk", cfg["num_experts_per_tok"],
            "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-router-topk-scaling-factor", cfg.get("routed_scaling_factor", 1.0),
            # DeepSeek-V3's complementary sequence-wise balance loss, alpha = 1e-4 (the paper)
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", 1e-4,
        ]
        if s.q_lora:
            flags += ["--q-lora-rank", s.q_lora]
        if cfg.get("n_group", 1) > 1:
            flags += ["--moe-router-num-groups", cfg["n_group"],
                      "--moe-router-group-topk", cfg["topk_group"]]
        if s.shared_ffn:
            flags += ["--moe-shared-expert-intermediate-size", s.shared_ffn]
        if not s.tied:
            flags.append("--untie-embeddings-and-output-weights")
        if not all(s.moe_layers):
            flags += ["--moe-layer-freq", "[" + ",".join(str(int(m)) for m in s.moe_layers) + "]"]
        if s.mtp_layers:
            flags += ["--mtp-num-layers", s.mtp_layers]
        return [str(f) for f in flags]

    def config_from_args(self, args, spec, dtype):
        cfg = Family.config_from_args(self, args, spec, dtype)
        n = spec.num_layers
        cfg.update(
            head_dim=args.qk_pos_emb_head_dim, qk_head_dim=args.qk_head_dim + args.qk_pos_emb_head_dim,
            intermediate_size=spec.ffn, moe_intermediate_size=spec.moe_ffn,
            n_routed_experts=spec.num_experts, n_shared_experts=(spec.shared_ffn or 0) // spec.moe_ffn,
            routed_scaling_factor=args.moe_router_topk_scaling_factor or 1.0,
            kv_lora_rank=args.kv_lora_rank, q_lora_rank=args.q_lora_rank,
            qk_nope_head_dim=args.qk_head_dim, qk_rope_head_dim=args.qk_pos_emb_head_dim,
            v_head_dim=args.v_head_dim, n_group=args.moe_router_num_groups or 1,
            topk_group=args.moe_router_group_topk or 1,
            first_k_dense_replace=n - sum(spec.moe_layers), norm_topk_prob=True,
            rope_interleave=True, attention_bias=False, num_nextn_predict_layers=spec.mtp_layers)
        if (args.rope_type or "yarn") == "yarn":  # MLA's default rope is YaRN (megatron-core)
            cfg["rope_scaling"] = {
                "type": "yarn", "factor": float(args.rotary_scaling_factor),
                "original_max_position_embeddings":
                    args.yarn_original_max_position_embeddings or 4096,
                "beta_fast": float(args.yarn_beta_fast or 32.0),
                "beta_slow": float(args.yarn_beta_slow or 1.0),
                "mscale": float(args.mscale), "mscale_all_dim": float(args.mscale_all_dim)}
        return cfg

    def check_args(self, args):
        problems = _decoder_problems(args)
        if not getattr(args, "multi_latent_attention", False):
            problems.append("no --multi-latent-attention")
        if not getattr(args, "qk_layernorm", False):
            problems.append("no --qk-layernorm (HF: q_a_layernorm/kv_a_layernorm)")
        if (getattr(args, "rope_type", None) or "yarn") == "yarn" and not args.mscale_all_dim \
                and args.mscale != 1.0 and args.rotary_scaling_factor > 1:
            problems.append("--mscale without --mscale-all-dim (transformers then ignores "
                            "mscale)")
        if args.moe_router_score_function != "sigmoid":
            problems.append(f"--moe-router-score-function {args.moe_router_score_function} "
                            "(HF: sigmoid)")
        if not getattr(args, "moe_router_enable_expert_bias", False):
            problems.append("no --moe-router-enable-expert-bias (HF: e_score_correction_bias)")
        groups, group_topk = args.moe_router_num_groups or 1, args.moe_router_group_topk or 1
        if groups > 1 and args.moe_router_topk // group_topk != 2:
            problems.append("--moe-router-topk / --moe-router-group-topk != 2 (HF scores a group "
                            "by its top 2 experts)")
        layers = moe_layer_list(args)
        if layers != sorted(layers):
            problems.append("--moe-layer-freq with a dense layer after a MoE layer (HF: the first "
                            "first_k_dense_replace layers are dense)")
        if args.moe_shared_expert_intermediate_size and (
                args.moe_shared_expert_intermediate_size % args.moe_ffn_hidden_size
                or getattr(args, "moe_shared_expert_gate", False)):
            problems.append("shared experts not a gate-less multiple of --moe-ffn-hidden-size")
        if getattr(args, "add_qkv_bias", False):
            problems.append("--add-qkv-bias")
        if problems:
            raise ConversionError(f"the checkpoint cannot be written as {self.architecture}: "
                                  + "; ".join(problems))


class GptOss(Family):
    """gpt-oss (transformers' GptOssForCausalLM): biases on q/k/v/o, the router and the experts
    (--add-bias-linear), a learned sink logit per head (``sinks`` = megatron-core's
    ``core_attention.softmax_offset``, --softmax-type learnable), sliding-window attention of
    ``sliding_window`` tokens (the query and sliding_window - 1 before it: --window-size W-1,0) on
    the ``layer_types`` layers marked sliding (--window-attn-skip-freq as a 0/1 list), YaRN RoPE
    (--position-embedding-type yarn; ``truncate`` = --yarn-correction-range-round-to-int), and
    experts computing (clamp(up, -L, L) + 1) * quick_gelu(clamp(gate, max=L)) with alpha 1.702
    (--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value L). The experts are stored
    stacked, x @ W: ``gate_up_proj`` [E, hidden, 2I] with gate and up columns interleaved,
    ``down_proj`` [E, I, hidden], and their biases; each expert is read as its own slice."""

    name = "gpt_oss"
    architecture = "GptOssForCausalLM"
    rope_default = 150000  # GptOssConfig.default_theta
    alpha = 1.702          # megatron-core's quick_gelu: x * sigmoid(1.702 x)

    def router(self, i):
        return f"model.layers.{i}.mlp.router.weight"

    def router_linear_bias(self, i):
        return f"model.layers.{i}.mlp.router.bias"

    def expert_rules(self, spec, m, i):
        p, E = f"model.layers.{i}.mlp.experts.", spec.num_experts
        R = []
        for e in range(E):
            x = m + f"mlp.experts.local_experts.{e}."
            R += [Rule(x + "linear_fc1.weight", (p + "gate_up_proj",), *_glu_interleaved(True),
                       stacked=(e, E)),
                  Rule(x + "linear_fc1.bias", (p + "gate_up_proj_bias",),
                       *_glu_interleaved(False), stacked=(e, E)),
                  Rule(x + "linear_fc2.weight", (p + "down_proj",), *_transposed(), stacked=(e, E)),
                  Rule(x + "linear_fc2.bias", (p + "down_proj_bias",), *_copy(), stacked=(e, E))]
        return R

    @staticmethod
    def _rope(cfg) -> dict:
        return _rope_parameters(cfg, GptOss.rope_default)

    def spec_from_config(self, cfg) -> Spec:
        problems = []
        if cfg.get("quantization_config"):
            problems.append("quantization_config (MXFP4 experts): convert a bf16 copy "
                            "(transformers' Mxfp4Config(dequantize=True), save_pretrained)")
        if float(cfg.get("swiglu_alpha", self.alpha)) != self.alpha:
            problems.append(f"swiglu_alpha {cfg['swiglu_alpha']} (megatron-core's quick_gelu "
                            f"has {self.alpha})")
        if not cfg.get("attention_bias", True):
            problems.append("attention_bias=false (--add-bias-linear covers attention, router and "
                            "experts together)")
        rope = self._rope(cfg)
        if rope["rope_type"] not in ("yarn", "default"):
            problems.append(f"rope_type {rope['rope_type']!r} (yarn or default)")
        if rope.get("attention_factor") is not None:
            problems.append("rope attention_factor (megatron-core derives it from factor and "
                            "mscale/mscale_all_dim)")
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            problems.append("partial_rotary_factor != 1")
        theta = rope["rope_theta"]
        if float(theta) != int(theta):
            problems.append(f"rope_theta {theta} is not an integer (--rotary-base is an int)")
        kinds = set(self._layer_types(cfg)) - {"sliding_attention", "full_attention"}
        if kinds:
            problems.append(f"layer_types {sorted(kinds)}")
        if problems:
            raise ConversionError("config.json: " + "; ".join(problems))
        n = cfg["num_hidden_layers"]
        return Spec(**self._common(cfg), num_experts=cfg["num_local_experts"],
                    moe_layers=[True] * n, ffn=cfg["intermediate_size"],
                    moe_ffn=cfg["intermediate_size"], linear_bias=True, sinks=True)

    @staticmethod
    def _layer_types(cfg) -> list:
        return cfg.get("layer_types") or [  # GptOssConfig's default: even layers slide
            "sliding_attention" if (i + 1) % 2 else "full_attention"
            for i in range(cfg["num_hidden_layers"])]

    def flags_from_config(self, cfg):
        s = self.spec_from_config(cfg)
        rope = self._rope(cfg)
        mpe = int(cfg.get("max_position_embeddings", 131072))
        flags = [
            "--num-layers", s.num_layers, "--hidden-size", s.hidden,
            "--num-attention-heads", s.heads, "--group-query-attention",
            "--num-query-groups", s.groups, "--kv-channels", s.head_dim,
            "--ffn-hidden-size", s.ffn, "--max-position-embeddings", mpe,
            "--seq-length", min(mpe, 4096), "--rotary-base", int(rope["rope_theta"]),
            "--normalization", "RMSNorm", "--norm-epsilon", cfg.get("rms_norm_eps", 1e-5),
            "--quick-geglu", "--glu-linear-offset", 1.0,
            "--activation-func-clamp-value", cfg.get("swiglu_limit", 7.0),
            "--softmax-type", "learnable", "--add-bias-linear",
            "--hidden-dropout", 0.0, "--attention-dropout", cfg.get("attention_dropout", 0.0),
            "--init-method-std", cfg.get("initializer_range", 0.02),
            "--num-experts", s.num_experts, "--moe-ffn-hidden-size", s.moe_ffn,
            "--moe-router-topk", cfg["num_experts_per_tok"], "--moe-router-dtype", "fp32",
            "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", cfg.get("router_aux_loss_coef", 0.0),
        ]
        if rope["rope_type"] == "yarn":
            original = int(rope["original_max_position_embeddings"])
            flags += ["--position-embedding-type", "yarn", "--rotary-scaling-factor",
                      rope.get("factor") or mpe / original,
                      "--yarn-original-max-position-embeddings", original,
                      "--yarn-beta-fast", rope.get("beta_fast") or 32.0,
                      "--yarn-beta-slow", rope.get("beta_slow") or 1.0]
            if not rope.get("truncate", True):
                flags.append("--no-yarn-correction-range-round-to-int")
            if rope.get("mscale") and rope.get("mscale_all_dim"):  # else: factor alone, both sides
                flags += ["--mscale", rope["mscale"], "--mscale-all-dim", rope["mscale_all_dim"]]
        else:
            flags += ["--position-embedding-type", "rope"]
        sliding = [t == "sliding_attention" for t in self._layer_types(cfg)]
        if cfg.get("sliding_window") and any(sliding):
            flags += ["--window-size", f"{int(cfg['sliding_window']) - 1},0"]
            if not all(sliding):
                flags += ["--window-attn-skip-freq", "[" + ",".join(str(int(x)) for x in sliding)
                          + "]"]
        if not s.tied:
            flags.append("--untie-embeddings-and-output-weights")
        return [str(f) for f in flags]

    def config_from_args(self, args, spec, dtype):
        from megatron.core.transformer.utils import is_layer_window_attention

        cfg = Family.config_from_args(self, args, spec, dtype)
        theta = cfg.pop("rope_theta")
        if args.position_embedding_type == "yarn":
            rope = {"rope_type": "yarn", "rope_theta": theta,
                    "factor": float(args.rotary_scaling_factor),
                    "original_max_position_embeddings":
                        args.yarn_original_max_position_embeddings or 4096,
                    "beta_fast": float(args.yarn_beta_fast or 32.0),
                    "beta_slow": float(args.yarn_beta_slow or 1.0),
                    "truncate": args.yarn_correction_range_round_to_int is not False}
            if args.mscale and args.mscale_all_dim:
                rope.update(mscale=args.mscale, mscale_all_dim=args.mscale_all_dim)
        else:
            rope = {"rope_type": "default", "rope_theta": theta}
        window = args.window_size
        cfg.update(
            intermediate_size=spec.moe_ffn, num_local_experts=spec.num_experts,
            attention_bias=True, swiglu_alpha=self.alpha,
            swiglu_limit=args.activation_func_clamp_value, rope_parameters=rope,
            sliding_window=window[0] + 1 if window else None,
            layer_types=["sliding_attention" if is_layer_window_attention(
                window, args.window_attn_skip_freq, i + 1) else "full_attention"
                for i in range(spec.num_layers)],
            output_router_logits=False)
        return cfg

    def check_args(self, args):
        problems = []
        if args.normalization != "RMSNorm":
            problems.append(f"--normalization {args.normalization} (HF: RMSNorm)")
        if not getattr(args, "quick_geglu", False):
            problems.append("no --quick-geglu (HF: clamped quick-GEGLU experts)")
        if getattr(args, "glu_linear_offset", 0.0) != 1.0:
            problems.append("--glu-linear-offset != 1 (HF: up + 1)")
        if getattr(args, "activation_func_clamp_value", None) is None:
            problems.append("no --activation-func-clamp-value (HF: swiglu_limit)")
        if getattr(args, "softmax_type", "vanilla") != "learnable":
            problems.append("--softmax-type is not learnable (HF: sinks)")
        if not args.add_bias_linear:
            problems.append("--disable-bias-linear (HF: biases everywhere)")
        if args.position_embedding_type not in ("rope", "yarn"):
            problems.append(f"--position-embedding-type {args.position_embedding_type}")
        if getattr(args, "rotary_percent", 1.0) != 1.0:
            problems.append("--rotary-percent != 1")
        if args.window_size is not None and (args.window_size[1] != 0 or args.window_size[0] < 0):
            problems.append(f"--window-size {args.window_size} (HF: LEFT,0 with LEFT >= 0)")
        if args.num_experts is None:
            problems.append("no --num-experts (a dense model)")
        elif not all(moe_layer_list(args)):
            problems.append("dense layers (--moe-layer-freq)")
        if args.moe_router_score_function != "softmax" or args.moe_router_pre_softmax:
            problems.append("routing other than softmax over the top-k logits")
        for flag in ("moe_shared_expert_intermediate_size", "moe_router_topk_scaling_factor",
                     "moe_router_group_topk", "moe_router_enable_expert_bias", "qk_layernorm",
                     "multi_latent_attention"):
            if getattr(args, flag, None):
                problems.append(f"--{flag.replace('_', '-')}")
        if problems:
            raise ConversionError(f"the checkpoint cannot be written as {self.architecture}: "
                                  + "; ".join(problems))


FAMILIES = {f.name: f for f in (Mixtral(), Qwen2Moe(), Qwen3Moe(), DeepseekV3(), GptOss())}

# Dense architectures with Mixtral's layer apart from the MLP (same attention, norm and names).
UPCYCLABLE = {"mistral": 10000, "llama": 10000}  # model_type -> its config's default rope_theta


def upcycle_config(cfg, num_experts: int, topk: int) -> dict:
    """The Mixtral config.json of a dense Mistral/Llama upcycled into ``num_experts`` copies of
    its MLP (Komatsuzaki et al., "Sparse Upcycling"). With identical experts and Mixtral's
    renormalised top-k weights (summing to 1) the MoE computes exactly the dense model."""
    kind = cfg.get("model_type")
    if kind not in UPCYCLABLE:
        raise ConversionError(f"config.json: model_type {kind!r} cannot be upcycled (supported: "
                              f"{', '.join(UPCYCLABLE)}; into Mixtral)")
    if cfg.get("mlp_bias") or cfg.get("attention_bias"):
        raise ConversionError("config.json: attention_bias/mlp_bias (Mixtral has no biases)")
    if not 1 <= topk <= num_experts:
        raise ConversionError(f"--upcycle-topk {topk} must be in [1, {num_experts}]")
    theta = _rope_theta(cfg, UPCYCLABLE[kind])  # refuses rope scaling
    dropped = ("mlp_bias", "attention_bias", "pretraining_tp", "rope_scaling", "rope_parameters")
    moe = {k: v for k, v in cfg.items() if k not in dropped}
    moe.update(model_type="mixtral", architectures=["MixtralForCausalLM"],
               num_local_experts=num_experts, num_experts_per_tok=topk, rope_theta=float(theta),
               router_aux_loss_coef=cfg.get("router_aux_loss_coef", 0.01),
               sliding_window=cfg.get("sliding_window"), router_jitter_noise=0.0,
               output_router_logits=False)
    return moe


def upcycle_source(name: str):
    """The dense HF tensor a Mixtral tensor is copied from; None for the router (initialised)."""
    parts = name.split(".")
    if ".block_sparse_moe.gate." in name:
        return None
    if ".block_sparse_moe.experts." in name:  # model.layers.i.block_sparse_moe.experts.e.wK.weight
        layer, w = parts[2], parts[6]
        proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[w]
        return f"model.layers.{layer}.mlp.{proj}.weight"
    return name


def family_for_config(cfg) -> Family:
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise ConversionError(f"config.json: model_type {kind!r} is not supported "
                              f"(supported: {', '.join(FAMILIES)})")
    return FAMILIES[kind]


def moe_layer_list(args) -> list:
    freq = args.moe_layer_freq
    if isinstance(freq, list):
        return [bool(x) for x in freq]
    return [i % freq == 0 for i in range(args.num_layers)]


def spec_from_args(args, family: str, vocab: int) -> Spec:
    """The Spec of a Megatron checkpoint, from its stored args."""
    heads = args.num_attention_heads
    return Spec(
        family=family, num_layers=args.num_layers, hidden=args.hidden_size, heads=heads,
        groups=args.num_query_groups if args.group_query_attention and args.num_query_groups
        else heads,
        head_dim=args.kv_channels or args.hidden_size // heads, vocab=vocab,
        num_experts=args.num_experts, moe_layers=moe_layer_list(args), ffn=args.ffn_hidden_size,
        moe_ffn=args.moe_ffn_hidden_size, shared_ffn=args.moe_shared_expert_intermediate_size,
        shared_gate=bool(getattr(args, "moe_shared_expert_gate", False)),
        qkv_bias=bool(getattr(args, "add_qkv_bias", False)),
        tied=not args.untie_embeddings_and_output_weights,
        qk_norm=bool(getattr(args, "qk_layernorm", False)),
        mla=bool(getattr(args, "multi_latent_attention", False)),
        q_lora=getattr(args, "q_lora_rank", None),
        expert_bias=bool(getattr(args, "moe_router_enable_expert_bias", False)),
        mtp_layers=getattr(args, "mtp_num_layers", None) or 0,
        linear_bias=bool(getattr(args, "add_bias_linear", False)),
        sinks=getattr(args, "softmax_type", "vanilla") == "learnable")


def guess_family(args) -> str:
    if getattr(args, "softmax_type", "vanilla") != "vanilla" or getattr(args, "quick_geglu", False):
        return "gpt_oss"
    if getattr(args, "multi_latent_attention", False):
        return "deepseek_v3"
    if getattr(args, "qk_layernorm", False):
        return "qwen3_moe"
    if args.moe_shared_expert_intermediate_size or getattr(args, "add_qkv_bias", False) \
            or args.moe_router_pre_softmax or not all(moe_layer_list(args)):
        return "qwen2_moe"
    return "mixtral"


def _tied_copies(n):
    """One megatron-core tensor stored ``n`` times in HF (DeepSeek-V3's MTP layers repeat the
    embedding and output head): the copies must be equal; the export writes them all."""
    def merge(ts):
        for t in ts[1:]:
            if not torch.equal(t, ts[0]):
                raise ConversionError("an MTP layer's embed_tokens/shared_head.head differs from "
                                      "the model's (megatron-core's MTP shares them)")
        return ts[0]

    return merge, (lambda t: [t] * n)


def rules_for(spec: Spec) -> list:
    """Every megatron-core parameter of the model and the HF tensors it is made of."""
    fam = FAMILIES[spec.family]
    L = spec.num_layers
    mtp = [f"model.layers.{L + k}." for k in range(spec.mtp_layers)]  # DeepSeek-V3's layout
    R = [Rule("embedding.word_embeddings.weight",
              ("model.embed_tokens.weight",) + tuple(h + "embed_tokens.weight" for h in mtp),
              *_tied_copies(1 + len(mtp)), vocab=True)]
    for i in range(L):
        R += _layer_rules(spec, fam, f"decoder.layers.{i}.", f"model.layers.{i}.", i)
    R.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), *_copy()))
    if mtp:
        from megatron_moe.compat.mla import mtp_inner_layer

        inner = mtp_inner_layer() + "."
    for k, h in enumerate(mtp):  # megatron-core's MultiTokenPredictionLayer
        m = f"mtp.layers.{k}."
        for name in ("enorm", "hnorm", "eh_proj"):
            R.append(Rule(m + name + ".weight", (h + name + ".weight",), *_copy()))
        R += _layer_rules(spec, fam, m + inner, h, L + k)
        R.append(Rule(m + "final_layernorm.weight", (h + "shared_head.norm.weight",), *_copy()))
    if not spec.tied:
        R.append(Rule("output_layer.weight",
                      ("lm_head.weight",) + tuple(h + "shared_head.head.weight" for h in mtp),
                      *_tied_copies(1 + len(mtp)), vocab=True))
    elif mtp:
        raise ConversionError("tied embeddings with MTP layers are not supported")
    return R


def _attention_rules(spec: Spec, m, a) -> list:
    if spec.mla:  # DeepSeek MLA: same matrices, same row order on both sides (plain copies)
        m += "self_attention."
        names = [("linear_kv_down_proj", "kv_a_proj_with_mqa"), ("kv_layernorm", "kv_a_layernorm"),
                 ("linear_kv_up_proj", "kv_b_proj"), ("linear_proj", "o_proj")]
        names += ([("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"),
                   ("linear_q_up_proj", "q_b_proj")] if spec.q_lora
                  else [("linear_q_proj", "q_proj")])
        return [Rule(m + ours + ".weight", (a + theirs + ".weight",), *_copy())
                for ours, theirs in names]
    R = []
    qkv = _qkv(spec.heads, spec.groups, spec.head_dim)
    R.append(Rule(m + "self_attention.linear_qkv.weight",
                  (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), *qkv))
    if spec.qkv_bias or spec.linear_bias:
        R.append(Rule(m + "self_attention.linear_qkv.bias",
                      (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), *qkv))
    if spec.qk_norm:
        R.append(Rule(m + "self_attention.q_layernorm.weight", (a + "q_norm.weight",),
                      *_copy()))
        R.append(Rule(m + "self_attention.k_layernorm.weight", (a + "k_norm.weight",),
                      *_copy()))
    R.append(Rule(m + "self_attention.linear_proj.weight", (a + "o_proj.weight",), *_copy()))
    if spec.linear_bias:
        R.append(Rule(m + "self_attention.linear_proj.bias", (a + "o_proj.bias",), *_copy()))
    if spec.sinks:  # megatron-core's learnable softmax offset (--softmax-type learnable)
        R.append(Rule(m + "self_attention.core_attention.softmax_offset", (a + "sinks",),
                      *_copy()))
    return R


def _layer_rules(spec: Spec, fam, m, h, i) -> list:
    """One transformer layer: megatron prefix ``m``, HF prefix ``h``, HF layer index ``i``
    (MTP layers are MoE layers numbered after the model's)."""
    R = [Rule(m + "input_layernorm.weight", (h + "input_layernorm.weight",), *_copy())]
    R += _attention_rules(spec, m, h + "self_attn.")
    R.append(Rule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",),
                  *_copy()))
    if i >= spec.num_layers or spec.moe_layers[i]:
        R.append(Rule(m + "mlp.router.weight", (fam.router(i),), *_copy()))
        if spec.linear_bias:
            R.append(Rule(m + "mlp.router.bias", (fam.router_linear_bias(i),), *_copy()))
        if spec.expert_bias:
            R.append(Rule(m + "mlp.router.expert_bias", (fam.router_bias(i),), *_copy()))
        R += fam.expert_rules(spec, m, i)
        if spec.shared_ffn:
            gate, up, down = fam.shared(i)
            x = m + "mlp.shared_experts."
            R.append(Rule(x + "linear_fc1.weight", (gate, up),
                          *_cat([spec.shared_ffn, spec.shared_ffn])))
            R.append(Rule(x + "linear_fc2.weight", (down,), *_copy()))
            if spec.shared_gate:
                R.append(Rule(x + "gate_weight", (fam.shared_gate(i),), *_copy()))
    else:
        gate, up, down = fam.dense(i)
        R.append(Rule(m + "mlp.linear_fc1.weight", (gate, up), *_cat([spec.ffn, spec.ffn])))
        R.append(Rule(m + "mlp.linear_fc2.weight", (down,), *_copy()))
    return R


# HF tensors that carry no weights (recomputed buffers some older exports contain)
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
