"""Rank functions for tests/test_fsdp_dtensor_export.py (spawned by run_distributed). ``mutate``
breaks the reader inside the spawned process; the test expects that comparison to fail."""

import contextlib
import io

TRUE_VOCAB = 256   # NullTokenizer --vocab-size 255: its ids and the eod


def _swap_swiglu_halves():
    """The SwiGLU re-join puts the up half first: [up; gate] instead of megatron-core's
    [gate; up]."""
    import torch

    from megatron_moe.training import fsdp_dtensor_checkpoint as fdc

    read = fdc.ModelWeights.read

    def swapped(self, names):
        out = read(self, names)
        for name in names:
            if len(self.keys[fdc._canonical(name)]) == 2:
                gate, up = out[name].chunk(2)
                out[name] = torch.cat([up, gate])
        return out

    fdc.ModelWeights.read = swapped
    return lambda: setattr(fdc.ModelWeights, "read", read)


def _experts_not_renumbered():
    """Every expert-parallel rank reads experts 0.. (the stored global numbers taken as local)."""
    from megatron.core.transformer import fsdp_dtensor_checkpoint as core

    offset = core.get_ep_layer_offset
    core.get_ep_layer_offset = lambda num_experts=None: 0
    return lambda: setattr(core, "get_ep_layer_offset", offset)


def _layers_not_renumbered():
    """A pipeline stage reads layers 0.. (its local layer numbers taken as global)."""
    from megatron_moe.training import fsdp_dtensor_checkpoint as fdc

    global_name = fdc._global_name
    fdc._global_name = lambda name, layers, offset: global_name(name, {i: i for i in layers},
                                                                offset)
    return lambda: setattr(fdc, "_global_name", global_name)


MUTATIONS = {"swiglu-swapped": _swap_swiglu_halves,
             "experts-not-renumbered": _experts_not_renumbered,
             "layers-not-renumbered": _layers_not_renumbered}


def _forward(model, tokens):
    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    ids = torch.tensor(tokens)
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        return gather_from_tensor_model_parallel_region(model(ids, pos, None))


def train_and_reference(rank, world_size, argv, tokens, prompt, steps, mutate=None):
    """pretrain() under Megatron-FSDP (``argv`` saves at its last iteration). After every train
    step, the trained model itself (Megatron-FSDP-wrapped, every rank) in eval mode: its logits
    of ``tokens`` and a greedy decode of ``prompt`` by full forwards (``steps`` tokens, each with
    its log prob over the true vocabulary). Returns (losses, the last step's reference; logits as
    numpy)."""
    import torch

    from tests._train_cases import pretrain_with_step

    reference = {}

    def wrap(step):
        def train_step(self, data_iterator):
            out = step(self, data_iterator)
            chunk = self.model[0]
            chunk.eval()
            try:
                # numpy: pickled by value (a torch tensor travels as a shared-memory handle,
                # which can vanish with the rank before the test reads it)
                reference["logits"] = _forward(chunk, tokens).numpy().copy()
                seq, logps = list(prompt), []
                for _ in range(steps):
                    logits = _forward(chunk, [seq])[0, -1, :TRUE_VOCAB].double()
                    last = torch.log_softmax(logits, -1)
                    seq.append(int(last.argmax()))
                    logps.append(float(last[seq[-1]]))
                reference["greedy"] = (seq[len(prompt):], logps)
            finally:
                chunk.train()
            return out
        return train_step

    restore = MUTATIONS[mutate]() if mutate else (lambda: None)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            losses = pretrain_with_step(argv, wrap)["history"]["lm_loss"]
    finally:
        restore()
    reference["validation"] = [line for line in printed.getvalue().splitlines()
                               if "validation loss at" in line and "validation set" in line]
    return losses, reference


def evaluate_and_serve(rank, world_size, load, prompt, tokens):
    """tools/evaluate.py's and tools/run_text_generation_server.py's main() on this one
    process: (exit code, printed text) and (exit code, the server's answer to ``prompt``)."""
    from tests._ring_tools_cases import _main, _serve
    from tools import evaluate

    common = ["--load", load, "--use-checkpoint-args"]
    # evaluation first (megatron-core 0.19's engine leaves its InferenceMode flag set)
    return _main(evaluate.main, common), _serve(common, prompt, tokens)


def load_logits(rank, world_size, argv, layouts, tokens, mutate=None):
    """Our model at each layout (no Megatron-FSDP: gpt_model_provider, no wrapper), every
    checkpoint tensor first set to NaN, loaded through load_checkpoint as the inference tools do
    (no optimizer, no scheduler). Per layout: (iteration, tensors the reader filled on this rank,
    this rank's state-dict tensors, of them still NaN after the load, full-vocabulary logits of
    ``tokens`` from rank 0, as numpy)."""
    import torch
    from megatron.core import parallel_state

    from megatron_moe.arguments import parse_args
    from megatron_moe.data.tokenizers import vocab_size_with_padding
    from megatron_moe.models.builder import gpt_model_provider
    from megatron_moe.runtime.initialize import initialize_distributed
    from megatron_moe.training import fsdp_dtensor_checkpoint as fdc
    from megatron_moe.training.checkpointing import load_checkpoint

    restore = MUTATIONS[mutate]() if mutate else (lambda: None)
    load = fdc.load_model_weights
    counted = []
    fdc.load_model_weights = lambda *a, **k: counted.append(load(*a, **k)) or counted[-1]
    out = []
    try:
        for layout in layouts:
            args = parse_args(argv + layout.split(), world_size=world_size)
            # what pretrain() sets once the tokenizer is built
            args.padded_vocab_size = vocab_size_with_padding(
                TRUE_VOCAB, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            initialize_distributed(args)
            model = gpt_model_provider(args)
            state = {k: v for k, v in model.state_dict(keep_vars=True).items()
                     if torch.is_tensor(v) and v.is_floating_point()
                     and not k.endswith("_extra_state")}
            with torch.no_grad():
                for tensor in state.values():
                    tensor.fill_(float("nan"))
            iteration = load_checkpoint([model], None, None, args)[0]
            model.eval()
            logits = _forward(model, tokens)
            nan = sum(int(torch.isnan(t).any()) for t in state.values())
            out.append((iteration, counted[-1], len(state), nan,
                        logits.numpy().copy() if rank == 0 else None))
    finally:
        fdc.load_model_weights = load
        restore()
    return out
