"""tools/checkpoint/convert.py against transformers: tiny random Mixtral and Qwen2-MoE models built
from a config (no download).

* HF -> ours: our training model (pretrain_gpt_moe.py's provider and load path) on the converted
  checkpoint gives the HF model's logits within fp32 tolerance at EP=1, EP=2, TP=2 and TP=2 x EP=2;
  a mutated HF config (rope base, top-k normalisation) does not, so the comparison can fail.
* HF -> ours -> HF: the same tensor names, bit-equal tensors, the same config.json.
* A checkpoint trained here at EP=2 -> HF (transformers gives our logits) -> ours at EP=2 -> training
  resumes from it with exactly the losses of fine-tuning from the original checkpoint.
"""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_moe.runtime.local_ranks import run_distributed
from tests._hf_cases import pipeline_rank

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 250  # not a multiple of 128: exercises Megatron's vocabulary padding (-> 256) and its removal
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32; measured max |diff| ~2e-7 (Mixtral), ~1.5e-6 (Qwen2-MoE)
LAYOUTS = ["", "--expert-model-parallel-size 2",
           "--tensor-model-parallel-size 2 --sequence-parallel",
           "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 "
           "--expert-tensor-parallel-size 1"]
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1)).tolist()


def make_hf(kind, path, dtype=torch.float32):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, initializer_range=0.1)  # large enough to route sharply
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=96, num_hidden_layers=2,
                                         num_local_experts=4, num_experts_per_tok=2,
                                         rope_theta=10000.0, **common)
        model = transformers.MixtralForCausalLM(cfg)
    elif kind == "qwen3_moe":  # q_norm/k_norm, head_dim 24 != 64 / 4, a dense middle layer
        cfg = transformers.Qwen3MoeConfig(intermediate_size=80, moe_intermediate_size=32,
                                          num_hidden_layers=3, head_dim=24, num_experts=4,
                                          num_experts_per_tok=2, mlp_only_layers=[1],
                                          norm_topk_prob=True, rope_theta=10000.0, **common)
        model = transformers.Qwen3MoeForCausalLM(cfg)
        with torch.no_grad():  # not all ones, so that a q/k norm mix-up shows
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 1.5)
    elif kind == "deepseek_v3":  # MLA (q/kv LoRA, decoupled rope), a dense first layer,
        # sigmoid group-limited routing with expert bias, a shared expert, one MTP layer
        cfg = transformers.DeepseekV3Config(
            intermediate_size=80, moe_intermediate_size=16, num_hidden_layers=2,
            n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=2.5, kv_lora_rank=16,
            q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8, n_group=2,
            topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
            rope_interleave=True, num_nextn_predict_layers=1, rope_theta=10000.0,
            **dict(common, num_key_value_heads=4))
        model = transformers.DeepseekV3ForCausalLM(cfg)
        with torch.no_grad():  # a mix-up of norms or a lost expert bias must show
            for name, p in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    p.normal_(0.0, 0.5)
            for name, p in model.named_parameters():
                if name.endswith("layernorm.weight"):
                    p.uniform_(0.5, 1.5)
    elif kind == "mistral":  # dense, to upcycle
        cfg = transformers.MistralConfig(intermediate_size=96, num_hidden_layers=2,
                                         sliding_window=None, **common)
        model = transformers.MistralForCausalLM(cfg)
    else:  # a dense layer in the middle, shared expert with its gate, no top-k renormalisation
        cfg = transformers.Qwen2MoeConfig(intermediate_size=80, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48, num_hidden_layers=3,
                                          num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                          norm_topk_prob=False, **common)
        model = transformers.Qwen2MoeForCausalLM(cfg)
    # small shards: q/k/v and gate/up of one layer land in different files
    model.to(dtype).save_pretrained(path, max_shard_size="60KB")
    assert len(glob.glob(os.path.join(path, "*.safetensors"))) > 3
    if kind == "deepseek_v3":
        add_mtp_layer(path, hf_state(path), cfg.num_hidden_layers)
    if kind == "mixtral":  # a tokenizer.json with the model: the stored args use it
        from tokenizers import Tokenizer, models

        Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(
            os.path.join(path, "tokenizer.json"))


def add_mtp_layer(path, state, n):
    """DeepSeek-V3's MTP layer as the official checkpoint stores it (transformers drops it):
    model.layers.{n}: a MoE decoder layer (random, named and shaped as the last one on disk) with enorm, hnorm,
    eh_proj, shared_head.norm and copies of embed_tokens and lm_head (shared_head.head)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(2)
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    hidden = state["model.norm.weight"].shape[0]
    extra = {mtp + k[len(last):]: torch.randn(v.shape, generator=g, dtype=v.dtype) * 0.1
             for k, v in state.items() if k.startswith(last)}
    extra.update({mtp + "enorm.weight": torch.rand(hidden, generator=g) + 0.5,
                  mtp + "hnorm.weight": torch.rand(hidden, generator=g) + 0.5,
                  mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.1,
                  mtp + "shared_head.norm.weight": torch.rand(hidden, generator=g) + 0.5,
                  mtp + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
                  mtp + "shared_head.head.weight": state["lm_head.weight"].clone()})
    save_file(extra, os.path.join(path, "model-mtp.safetensors"), metadata={"format": "pt"})
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path))
    index["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
    json.dump(index, open(index_path, "w"))


def convert(*runs):
    """Run tools/checkpoint/convert.py main() for each argv in one fresh process."""
    code = ("import json, sys; sys.path.insert(0, 'tools/checkpoint'); import convert\n"
            "for argv in json.loads(sys.argv[1]): convert.main(argv)")
    argvs = [["--model-type", "GPT"] + list(r) for r in runs]
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def hf_state(path):
    from safetensors.torch import load_file

    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    state = {}
    for shard in sorted(set(index["weight_map"].values())):
        state.update(load_file(os.path.join(path, shard)))
    assert set(state) == set(index["weight_map"])
    return state


def assert_roundtrip_bit_exact(hf_dir, back_dir, log):
    """HF -> ours -> HF gave the same tensor names, bit-equal tensors and the same config.json;
    the streaming import read every HF tensor exactly once (gate/up: one read for two chunks;
    stacked experts: one slice per expert)."""
    original, back = hf_state(hf_dir), hf_state(back_dir)
    assert sorted(original) == sorted(back)
    size = sum(t.numel() * t.element_size() for t in original.values())
    assert f"chunks streamed from {size} bytes of HF tensors" in log
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert json.load(open(os.path.join(back_dir, "config.json"))) == \
        json.load(open(os.path.join(hf_dir, "config.json")))


def hf_logits(path, mutate=None, **override):
    """transformers' logits of TOKENS, with config fields overridden and ``mutate(model)``
    applied to the loaded weights (mutation controls)."""
    cfg = transformers.AutoConfig.from_pretrained(path)
    for key, value in override.items():
        setattr(cfg, key, value)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, config=cfg,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        if mutate:
            mutate(model)
        return model(torch.tensor(TOKENS)).logits


TRAIN = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 "
         "--ffn-hidden-size 96 --seq-length 32 --max-position-embeddings 64 "
         "--position-embedding-type rope --rotary-base 10000 --normalization RMSNorm --swiglu "
         "--untie-embeddings-and-output-weights --disable-bias-linear --num-experts 4 "
         "--moe-router-topk 2 --moe-aux-loss-coeff 0.01 --moe-token-dispatcher-type alltoall "
         "--expert-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 "
         "--mock-data --tokenizer-type NullTokenizer --vocab-size 255 --log-interval 1 "
         "--eval-interval 1000 --eval-iters 1 --hidden-dropout 0 --attention-dropout 0").split()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Everything in three process launches (the suite runs on 2 shared cores): train at EP=2;
    all conversions; then every logits comparison and the resumed training runs."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    runs = []
    for kind, target in (("mixtral", "--target-expert-parallel-size 2"),
                         ("qwen2_moe", "--target-tensor-parallel-size 2"),
                         ("qwen3_moe", "--target-expert-parallel-size 2"),
                         ("deepseek_v3", "--target-expert-parallel-size 2")):
        d = {name: str(root / f"{kind}_{name}") for name in ("hf", "meg", "back")}
        make_hf(kind, d["hf"])
        runs += [["--loader", "hf", "--saver", "megatron", "--load-dir", d["hf"],
                  "--save-dir", d["meg"]] + target.split(),
                 ["--loader", "megatron", "--saver", "hf", "--load-dir", d["meg"],
                  "--save-dir", d["back"], "--max-shard-size", "100KB"]]
        out[kind] = d
    # a bf16 checkpoint stays bf16 on the way (stored as --bf16 weights, nothing rounded)
    d = out["mixtral_bf16"] = {name: str(root / f"bf16_{name}") for name in ("hf", "meg", "back")}
    make_hf("mixtral", d["hf"], torch.bfloat16)
    runs += [["--loader", "hf", "--saver", "megatron", "--load-dir", d["hf"], "--save-dir", d["meg"]],
             ["--loader", "megatron", "--saver", "hf", "--load-dir", d["meg"], "--save-dir", d["back"]]]
    # a dense Mistral upcycled into 4 experts (top-2) at EP=2, and exported as a Mixtral
    u = out["upcycled"] = {name: str(root / f"upcycled_{name}") for name in ("dense", "meg", "hf")}
    make_hf("mistral", u["dense"])
    runs += [["--loader", "hf", "--saver", "megatron", "--load-dir", u["dense"], "--save-dir",
              u["meg"], "--upcycle-num-experts", "4", "--upcycle-topk", "2",
              "--target-expert-parallel-size", "2"],
             ["--loader", "megatron", "--saver", "hf", "--load-dir", u["meg"], "--save-dir", u["hf"]]]
    # a checkpoint trained here at EP=2 (random init, 3 iterations) -> HF -> ours at EP=2
    t = out["trained"] = {name: str(root / f"trained_{name}") for name in ("meg", "hf", "back")}
    run_distributed(pipeline_rank, 2, [TRAIN + ["--train-iters", "3", "--save", t["meg"]]], [],
                    timeout_s=300)
    runs += [["--loader", "megatron", "--saver", "hf", "--load-dir", t["meg"], "--save-dir", t["hf"]],
             ["--loader", "hf", "--saver", "megatron", "--load-dir", t["hf"], "--save-dir", t["back"],
              "--target-expert-parallel-size", "2"]]
    out["log"] = convert(*runs)
    # fine-tune from the trained checkpoint and plain resume from its round trip: same weights,
    # same data, fresh optimizer -> the same losses
    resume = [TRAIN + ["--train-iters", "2", "--load", t["meg"], "--finetune"],
              TRAIN + ["--train-iters", "2", "--load", t["back"]],
              TRAIN + ["--train-iters", "2", "--load", t["back"], "--expert-model-parallel-size",
                       "1", "--pipeline-model-parallel-size", "2"]]
    jobs = [(out[k]["hf"], out[k]["meg"], LAYOUTS, TOKENS)
            for k in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")]
    jobs.append((t["hf"], t["meg"], ["--expert-model-parallel-size 2"], TOKENS))
    jobs.append((u["hf"], u["meg"], ["--expert-model-parallel-size 2"], TOKENS))
    histories, logits = run_distributed(pipeline_rank, 2, resume, jobs, timeout_s=500)[0]
    (out["mixtral"]["logits"], out["qwen2_moe"]["logits"], out["qwen3_moe"]["logits"],
     out["deepseek_v3"]["logits"], t["logits"], u["logits"]) = logits
    t["finetuned"], t["resumed"], t["resumed_pp2"] = histories
    return out


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3",
                                  "mixtral_bf16"])
def test_roundtrip_bit_exact(converted, kind):
    d = converted[kind]
    assert_roundtrip_bit_exact(d["hf"], d["back"], converted["log"])
    # Megatron's layout really was in between: fused QKV, padded vocabulary, experts per rank
    ckpt = os.path.join(d["meg"], "iter_0000000")
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_common_state_dict(ckpt)  # common.pt, or inside .distcp (0.19)
    assert meta["args"].padded_vocab_size == 256
    assert meta["extra_state"]["hf"]["family"] == kind.replace("_bf16", "")
    assert meta["args"].bf16 == kind.endswith("bf16")
    # the HF directory's tokenizer (250 tokens -> 256 rows: no warning), else NullTokenizer
    assert meta["args"].tokenizer_type == ("HuggingFaceTokenizer" if kind.startswith("mixtral")
                                           else "NullTokenizer")
    assert open(os.path.join(d["meg"], "latest_checkpointed_iteration.txt")).read() == "0"


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_logits_match_transformers(converted, kind):
    d = converted[kind]
    reference = hf_logits(d["hf"])
    assert reference.abs().max() > 0.5  # not a near-zero model that anything matches
    for layout, (iteration, logits) in zip(LAYOUTS, d["logits"]):
        assert iteration == 0
        torch.testing.assert_close(logits, reference, **TOL, msg=lambda m: f"{layout!r}: {m}")
        print(f"{kind} {layout or 'TP1 EP1'}: max |ours - transformers| = "
              f"{(logits - reference).abs().max():.2e} (max |logit| {reference.abs().max():.2f})")
    # the comparison is sharp enough to catch a wrong rope base or top-k normalisation
    mutated = hf_logits(d["hf"], rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    assert (mutated - d["logits"][0][1]).abs().max() > 1e3 * TOL["atol"]
    if kind == "qwen2_moe":
        mutated = hf_logits(d["hf"], norm_topk_prob=True)
        assert (mutated - d["logits"][0][1]).abs().max() > 1e3 * TOL["atol"]
    if kind == "qwen3_moe":
        mutated = hf_logits(d["hf"], norm_topk_prob=False)
        assert (mutated - d["logits"][0][1]).abs().max() > 1e3 * TOL["atol"]
    if kind == "deepseek_v3":  # MLA's rope layout, the routed experts' scale
        for override in (dict(rope_interleave=False), dict(routed_scaling_factor=1.0)):
            mutated = hf_logits(d["hf"], **override)
            assert (mutated - d["logits"][0][1]).abs().max() > 1e3 * TOL["atol"], override
        # without its expert bias (e_score_correction_bias -> router.expert_bias) HF routes
        # differently: the bias really was carried
        model = transformers.AutoModelForCausalLM.from_pretrained(d["hf"], dtype=torch.float32)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.zero_()
            mutated = model.eval()(torch.tensor(TOKENS)).logits
        assert (mutated - d["logits"][0][1]).abs().max() > 1e3 * TOL["atol"]


def test_ep2_trained_checkpoint_to_hf_and_back_then_resume(converted):
    t = converted["trained"]
    assert "MixtralForCausalLM" in converted["log"]
    assert "model flags for pretrain_gpt_moe.py:" in converted["log"]
    assert "WARNING" not in converted["log"]
    cfg = json.load(open(os.path.join(t["hf"], "config.json")))
    assert cfg["num_local_experts"] == 4 and cfg["vocab_size"] == 256
    # the training tokenizer's special ids travel (NullTokenizer --vocab-size 255: eod 255, no
    # bos); before, a config generated from the args had none
    assert cfg["eos_token_id"] == 255 and "bos_token_id" not in cfg
    generation = json.load(open(os.path.join(t["hf"], "generation_config.json")))
    assert generation["eos_token_id"] == 255
    assert transformers.GenerationConfig.from_pretrained(t["hf"]).eos_token_id == 255
    experts = [k for k in hf_state(t["hf"]) if ".block_sparse_moe.experts." in k]
    assert len(experts) == 2 * 4 * 3  # every expert of both EP ranks, w1/w2/w3, both layers
    # a later export can start from the original config.json (token ids, ...) if it agrees
    sys.path.insert(0, os.path.join(ROOT, "tools", "checkpoint"))
    import saver_hf

    template = os.path.join(t["hf"], "..", "template.json")
    json.dump(dict(cfg, bos_token_id=7, rope_parameters={"rope_theta": 10000.0}), open(template, "w"))
    assert saver_hf._from_template(template, cfg)["bos_token_id"] == 7
    json.dump(dict(cfg, num_local_experts=8), open(template, "w"))
    with pytest.raises(SystemExit, match="num_local_experts is 8"):
        saver_hf._from_template(template, cfg)
    # transformers on the export gives the trained model's logits (ours at EP=2, iteration 3)
    [(iteration, ours)] = t["logits"]
    assert iteration == 3
    torch.testing.assert_close(ours, hf_logits(t["hf"]), **TOL)
    # training resumes from the converted checkpoint exactly as from the original
    assert t["resumed"]["iteration"] == [1, 2]
    assert all(loss == loss for loss in t["resumed"]["lm_loss"])
    assert t["resumed"]["lm_loss"] == t["finetuned"]["lm_loss"]
    # and at another layout (PP=2, EP=1) than the one it was converted for
    assert t["resumed_pp2"]["iteration"] == [1, 2]
    assert t["resumed_pp2"]["lm_loss"] == pytest.approx(t["resumed"]["lm_loss"], rel=1e-5)


def test_upcycled_dense_model_computes_the_dense_model(converted):
    """Every expert a copy of the dense MLP and top-k weights summing to 1: the MoE (ours at EP=2,
    and transformers' Mixtral on the export) gives the dense Mistral's logits."""
    u = converted["upcycled"]
    dense = hf_logits(u["dense"])
    [(_, ours)] = u["logits"]
    torch.testing.assert_close(ours, dense, **TOL)
    torch.testing.assert_close(hf_logits(u["hf"]), dense, **TOL)
    source, moe = hf_state(u["dense"]), hf_state(u["hf"])
    assert json.load(open(os.path.join(u["hf"], "config.json")))["num_local_experts"] == 4
    for layer in range(2):
        for e in range(4):
            for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
                assert torch.equal(moe[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"],
                                   source[f"model.layers.{layer}.mlp.{proj}.weight"])
        router = moe[f"model.layers.{layer}.block_sparse_moe.gate.weight"]
        assert router.shape == (4, 64) and router.std() > 0.05  # initialised, not zeros


def test_help_and_refusals():
    proc = subprocess.run([sys.executable, "tools/checkpoint/convert.py", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for flag in ("--target-tensor-parallel-size", "--target-pipeline-parallel-size",
                 "--target-expert-parallel-size", "--load-dir", "--save-dir", "--max-shard-size"):
        assert flag in proc.stdout
    from megatron_moe.hf.families import FAMILIES, ConversionError, family_for_config

    with pytest.raises(ConversionError, match="model_type 'llama'"):
        family_for_config({"model_type": "llama"})
    with pytest.raises(ConversionError, match="sliding_window"):
        FAMILIES["mixtral"].spec_from_config({"sliding_window": 4096, "num_hidden_layers": 1})


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_config_generated_from_args_agrees_with_the_original(converted, kind):
    """The config.json written for a checkpoint without its HF config (trained here) describes
    the same architecture as the original (--hf-config-template's check, field by field)."""
    from megatron.core import dist_checkpointing

    from megatron_moe.hf.families import FAMILIES, guess_family, spec_from_args

    sys.path.insert(0, os.path.join(ROOT, "tools", "checkpoint"))
    import saver_hf

    d = converted[kind]
    stored = dist_checkpointing.load_common_state_dict(os.path.join(d["meg"], "iter_0000000"))["args"]
    assert guess_family(stored) == kind
    generated = FAMILIES[kind].config_from_args(stored, spec_from_args(stored, kind, VOCAB),
                                               "float32")
    saver_hf._from_template(os.path.join(d["hf"], "config.json"), generated)  # raises on a mismatch
    assert generated["model_type"] == kind
