"""Everything that differs between CPU-only torch and CUDA, and between megatron-core versions."""

import sys
import types


def quiet_known_warnings():
    """Silence megatron-core's import-time notices about optional GPU packages (TE, apex)."""
    import warnings

    for pattern in (".*Transformer Engine and Apex are not installed.*",
                    ".*Apex is not installed.*", ".*Transformer Engine is not installed.*",
                    # megatron-core 0.16 warns about its own default CUDA-graph scope
                    ".*full scope is deprecated.*"):
        warnings.filterwarnings("ignore", message=pattern)


class _NoWandbForMegatronCore:
    """A meta-path finder that answers ImportError to ``import wandb`` run by a megatron.core
    module. megatron-core's timers.py (and its dynamic inference engine) import wandb at module
    import, each guarded by ``except ImportError`` (their W&B writers, unused here), which costs
    seconds of start-up in every process once wandb is installed. Our own W&B writer
    (megatron_moe/training/wandb_writer.py, --wandb-project) imports it as usual."""

    def find_spec(self, name, path=None, target=None):
        if name != "wandb":
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith("importlib"):
            frame = frame.f_back
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        if importer.startswith("megatron.core"):
            raise ImportError("wandb is loaded by megatron_moe.training.wandb_writer only")
        return None


def defer_wandb_import():
    """Keep megatron-core's import-time ``import wandb`` from loading wandb (see the finder)."""
    if not any(isinstance(f, _NoWandbForMegatronCore) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoWandbForMegatronCore())


def wandb_loaded() -> bool:
    """Whether wandb has been imported in this process."""
    return "wandb" in sys.modules


def install_megatron_core_stubs():
    """megatron-core >= 0.19 imports triton unguarded in one MoE op module (paged stash).

    Register a stub for that module when triton is missing, before megatron.core is imported
    (older releases lack the module: nothing to do there).
    """
    from packaging.version import Version

    from megatron_moe.compat.versions import distribution_version

    if distribution_version().release < Version("0.19").release:
        return
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if name in sys.modules:
        return
    stub = types.ModuleType(name)
    stub.GLOBAL_BLOCK_SIZE = 1024

    def _unavailable(*args, **kwargs):
        raise RuntimeError("the paged stash needs triton and CUDA")

    stub.paged_stash_copy_kernel = stub.paged_stash_pop_kernel = _unavailable
    sys.modules[name] = stub


def apply_cpu_shims(force: bool = False) -> bool:
    """Make megatron-core run on a CPU-only torch build; a no-op when CUDA is available."""
    from megatron_moe.compat import cpu

    return cpu.apply(force=force)


def megatron_tokenizer_base() -> type:
    """Base class of Megatron-LM-style tokenizers on the installed megatron-core (compat/tokenizer.py)."""
    from megatron_moe.compat.tokenizer import megatron_tokenizer_base as base

    return base()


from megatron_moe.compat.spec import replace_spec, spec_module, spec_params, spec_submodules  # noqa: E402,F401
