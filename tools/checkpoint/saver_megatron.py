"""Saver: a Megatron checkpoint in our layout (latest_checkpointed_iteration.txt, iter_XXXXXXX/
torch_dist), loadable by pretrain_gpt_moe.py at the target TP/PP/EP or any other layout.

The weights are written once, as global tensors, through megatron_moe.training.checkpointing's own
save_checkpoint (megatron_moe/hf/megatron_side.py says why no per-rank copies are needed). The
stored args are what pretrain_gpt_moe.py parses from the model flags plus the target layout; the
HF config travels in the checkpoint (extra_state['hf']) so an export reproduces it.

Streaming: the model is built on the meta device and each checkpoint chunk is read from the HF
shards (the loader's ``read``) only when torch DCP writes it (megatron_side.streaming_save_strategy),
so peak memory is about one parameter, not the model (docs/hf.md, bench/hf_convert.py).
"""

from __future__ import annotations

import os
import shlex


def add_arguments(parser):
    group = parser.add_argument_group("Megatron saver")
    group.add_argument("--target-tensor-parallel-size", type=int, default=1)
    group.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    group.add_argument("--target-expert-parallel-size", type=int, default=1)
    group.add_argument("--target-expert-tensor-parallel-size", type=int, default=None,
                       help="Default: the target tensor parallel size (Megatron's default).")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="Megatron's vocabulary padding; use the value you will train with.")
    group.add_argument("--iteration", type=int, default=0,
                       help="Iteration the checkpoint is saved as (0: training starts at 1).")


def _stored_args(metadata, args):
    from megatron_moe.arguments import parse_args
    from megatron_moe.data.tokenizers import vocab_size_with_padding
    from megatron_moe.hf.megatron_side import target_world_size

    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    ep = args.target_expert_parallel_size
    etp = args.target_expert_tensor_parallel_size or tp
    spec = metadata["spec"]
    for what, n, size in (("--num-query-groups (num_key_value_heads)", spec.groups, tp),
                          ("--num-experts", spec.num_experts, ep),
                          ("--num-layers", spec.num_layers, pp)):
        if n % size:
            raise SystemExit(f"target layout: {what} = {n} is not divisible by {size}")
    argv = list(metadata["megatron_flags"]) + [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", str(etp),
        "--make-vocab-size-divisible-by", str(args.make_vocab_size_divisible_by),
        # the rest only makes the stored args a complete pretrain_gpt_moe.py namespace
        "--micro-batch-size", "1", "--train-iters", "1", "--lr", "0", "--mock-data"]
    argv += _tokenizer_flags(metadata, spec, args, tp)
    if tp > 1:
        argv.append("--sequence-parallel")
    argv += dtype_flags(metadata["hf_config"])
    try:
        stored = parse_args(argv, world_size=target_world_size(tp, pp, ep, etp))
    except SystemExit as exc:
        raise SystemExit(f"the target layout or model flags were refused (above): "
                         f"{' '.join(argv)}") from exc
    stored.padded_vocab_size = vocab_size_with_padding(spec.vocab, args.make_vocab_size_divisible_by, tp)
    stored.save = args.save_dir
    stored.no_save_optim = stored.no_save_rng = True  # weights only, like Megatron's converter
    return stored


def dtype_flags(hf_config) -> list:
    """--bf16 / --fp16 for the HF weights' dtype: they are stored in it (no rounding, no doubling
    on disk), and the printed flags carry it so that a run copying them trains as stored."""
    dtype = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return {"bfloat16": ["--bf16"], "float16": ["--fp16"]}.get(dtype, [])


def model_flags_line(metadata) -> str:
    """The line that tells the user which pretrain_gpt_moe.py flags build the imported model."""
    return "model flags for pretrain_gpt_moe.py: " + shlex.join(
        list(metadata["megatron_flags"]) + dtype_flags(metadata["hf_config"]))


def _tokenizer_flags(metadata, spec, args, tp):
    """The HF directory's own tokenizer when it has a tokenizer.json (so --use-checkpoint-args
    tools find it), else NullTokenizer of the config's vocabulary. Warns when that tokenizer would
    pad to another embedding size than the checkpoint's: training derives the size from it."""
    from megatron_moe.data.tokenizers import vocab_size_with_padding

    source = metadata.get("source")
    if not source or not os.path.isfile(os.path.join(source, "tokenizer.json")):
        return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(spec.vocab - 1)]
    try:
        from megatron_moe.data.tokenizers import HuggingFaceTokenizer

        size = HuggingFaceTokenizer(source).vocab_size
    except Exception as exc:  # an unreadable tokenizer does not stop the weight conversion
        print(f"note: {source}/tokenizer.json not usable ({exc}); storing NullTokenizer args")
        return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(spec.vocab - 1)]
    div = args.make_vocab_size_divisible_by
    rows = vocab_size_with_padding(spec.vocab, div, tp)
    if vocab_size_with_padding(size, div, tp) != rows:
        fits = [m for m in range(1, rows // tp + 1)
                if rows % (m * tp) == 0 and vocab_size_with_padding(size, m, tp) == rows]
        hint = (f"train with --make-vocab-size-divisible-by {fits[0]} (pads {size} to {rows})"
                if fits else "no --make-vocab-size-divisible-by pads it to that size")
        print(f"WARNING: the tokenizer in {source} has {size} tokens, the checkpoint {rows} "
              f"embedding rows (config vocab_size {spec.vocab}); {hint}")
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", source]


def save_checkpoint(metadata, tensors, args):
    from megatron_moe.compat import quiet_known_warnings

    quiet_known_warnings()
    import torch

    from megatron_moe.training.checkpointing import save_checkpoint as save
    from megatron_moe.hf import megatron_side

    if metadata.get("hf_config") is None or not hasattr(tensors, "read"):
        raise SystemExit("--saver megatron needs an HF source (--loader hf); a torch_dist "
                         "checkpoint already loads at any TP/EP/PP, no conversion needed")
    stored = _stored_args(metadata, args)
    megatron_side.init_single_process()
    with torch.device("meta"):  # names, shapes, dtypes and sharding; no weights
        model = megatron_side.build_model(megatron_side.conversion_args(stored))
    params = megatron_side.parameters(model)
    missing = sorted(set(params) - set(tensors.rules))
    if missing:
        raise SystemExit(f"{len(missing)} megatron-core parameter(s) get no weights, e.g. {missing[:3]}")
    extra = sorted(set(tensors.rules) - set(params))
    if extra:
        raise SystemExit(f"converted tensor(s) {extra[:3]} have no parameter in the megatron-core model")
    from tqdm import tqdm

    bar = tqdm(total=len(params), desc="writing torch_dist", unit="t")

    def produce(name):
        """One parameter from the HF shards, in the model's dtype and padded vocabulary."""
        param = params[name]
        tensor = tensors.read(name, tuple(param.shape))
        if name in ("embedding.word_embeddings.weight", "output_layer.weight") \
                and tensor.shape[0] < param.shape[0]:
            # Megatron's padding (saver_mcore): repeat the last row up to the padded size
            pad = tensor[-1:].expand(param.shape[0] - tensor.shape[0], -1)
            tensor = torch.cat([tensor, pad])
        if tuple(tensor.shape) != tuple(param.shape):
            raise SystemExit(f"{name}: converted shape {tuple(tensor.shape)} != model shape "
                             f"{tuple(param.shape)}")
        bar.update(1)
        return tensor.to(param.dtype)

    producer = megatron_side.ChunkProducer(megatron_side.chunk_index(model.sharded_state_dict()),
                                           produce)
    extra_state = {"hf": {"family": metadata["family"], "config": metadata["hf_config"],
                          "source": metadata.get("source")}}
    save(args.iteration, [model], None, None, stored, consumed_train_samples=0,
         extra_state=extra_state, sharded_strategy=megatron_side.streaming_save_strategy(producer))
    bar.close()
    megatron_side.finish()
    if producer.chunks != len(producer.index):
        raise SystemExit(f"torch_dist save wrote {producer.chunks} of {len(producer.index)} chunks")
    print(model_flags_line(metadata))
    print(f"saved {len(params)} tensors ({producer.chunks} chunks streamed from "
          f"{tensors.bytes_read} bytes of HF tensors) to "
          f"{os.path.join(args.save_dir, f'iter_{args.iteration:07d}')} "
          f"(layout TP={stored.tensor_model_parallel_size} PP={stored.pipeline_model_parallel_size} "
          f"EP={stored.expert_model_parallel_size}; padded vocab {stored.padded_vocab_size})")
