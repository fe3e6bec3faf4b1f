"""megatron-core's static text-generation stack, built the way the installed version wants it.

We use ``StaticInferenceEngine(legacy=True)`` + ``TextGenerationController`` +
``GPTInferenceWrapper`` + ``StaticInferenceContext`` (KV cache per layer, prefill then one-token
decode steps): it runs on CPU with the shims in compat/cpu.py. The dynamic engine needs CUDA
(managed memory, Triton kernels, CUDA graphs), so ``legacy=True`` is always passed.

The constructors differ between versions:
* 0.16: ``GPTInferenceWrapper(model, InferenceWrapperConfig, context)``; the context is built from
  that config.
* >= 0.17 (0.19 checked): ``GPTInferenceWrapper(model, context)``; the context carries an
  ``InferenceConfig`` and takes (max batch, max sequence length) directly.
* >= 0.19: the static engine's constructor sets the process-wide ``InferenceMode`` flag and
  nothing unsets it; while it is set, every GPTModel forward asserts "Inference must always
  gather TP logits" unless called with ``runtime_gather_output=True`` (evaluation, a logits call
  after serving). ``engine_inference_mode`` confines the flag to the engine's own calls.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings


def _inference_mode_flag():
    """megatron-core's process-wide InferenceMode flag (>= 0.19), or None where it has none."""
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        return None
    return InferenceMode if hasattr(InferenceMode, "unset_active") else None


@contextlib.contextmanager
def engine_inference_mode():
    """Run a static-engine call (its constructor, generate) under megatron-core's InferenceMode
    and put the flag back as it was afterwards: the engine sets it and never unsets it."""
    flag = _inference_mode_flag()
    if flag is None:  # megatron-core <= 0.16: no such flag
        yield
        return
    was_active = flag.is_active()
    flag.set_active()
    try:
        yield
    finally:
        if not was_active:
            flag.unset_active()


def apply_cpu_shims():
    """megatron-core's inference communication helpers assert ``tensor.is_cuda`` before the PP
    broadcast of logits; gloo moves CPU tensors, so on a CPU-only build accept them (a no-op
    when CUDA is available). Kept here, beside the inference stack it serves."""
    import torch

    if torch.cuda.is_available():
        return
    from megatron.core.inference import communication_utils as cu

    if getattr(cu, "_megatron_moe_cpu", False):
        return

    def _is_cuda(tensor):
        assert tensor is not None

    cu._is_cuda = _is_cuda
    cu._megatron_moe_cpu = True


def build_static_engine(model, tokenizer, *, hidden_size: int, params_dtype, padded_vocab_size: int,
                        max_batch_size: int, max_sequence_length: int, random_seed: int):
    """A StaticInferenceEngine over ``model`` (a GPTModel, possibly in Float16Module)."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    apply_cpu_shims()
    params = inspect.signature(GPTInferenceWrapper.__init__).parameters
    if "inference_wrapper_config" in params:  # megatron-core <= 0.16
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
            InferenceWrapperConfig,
        )

        config = InferenceWrapperConfig(
            hidden_size=hidden_size, params_dtype=params_dtype,
            inference_batch_times_seqlen_threshold=-1,  # no micro-batch pipelining over PP
            padded_vocab_size=padded_vocab_size, inference_max_requests=max_batch_size,
            inference_max_seq_length=max_sequence_length)
        context = StaticInferenceContext.from_config(config)
        wrapped = GPTInferenceWrapper(model, config, context)
    else:
        context = StaticInferenceContext(max_batch_size, max_sequence_length)
        wrapped = GPTInferenceWrapper(model, context)
    controller = TextGenerationController(inference_wrapped_model=wrapped, tokenizer=tokenizer)
    with warnings.catch_warnings(), engine_inference_mode():
        warnings.simplefilter("ignore")  # "the static engine will be deprecated": known, see above
        engine = StaticInferenceEngine(controller, max_batch_size=max_batch_size,
                                       random_seed=random_seed, legacy=True)
    return engine


def generate(engine, requests):
    """``engine.generate(inference_requests=requests)`` with the InferenceMode flag set only
    for its duration (see engine_inference_mode)."""
    with engine_inference_mode():
        return engine.generate(inference_requests=requests)


def sampling_params(**kwargs):
    """megatron-core's SamplingParams (0.16: sampling_params.py; later also under inference/)."""
    from megatron.core.inference.sampling_params import SamplingParams

    names = set(inspect.signature(SamplingParams).parameters)
    return SamplingParams(**{k: v for k, v in kwargs.items() if k in names})


def max_sequence_length_error():
    """The exception megatron-core raises when prompt + tokens exceed the context length."""
    from megatron.core.inference.contexts.dynamic_context import MaxSequenceLengthOverflowError

    return MaxSequenceLengthOverflowError
