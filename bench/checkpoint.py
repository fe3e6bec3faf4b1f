"""Checkpoint save/load cost: torch_dist (megatron-core, ours) vs plain torch.save/torch.load.

    python bench/checkpoint.py                      # 2 gloo ranks, GPT-MoE EP=2, ~50 MB of state
    python bench/checkpoint.py --iters 8 --hidden 256

Three launches of the real pretrain() (fresh processes each, so each has its own first save):

- sync, no prestart: megatron-core's writer creates its results queue on the first save (a
  ``spawn`` multiprocessing Manager: a new interpreter that re-imports the launch script) - the
  first-save cost the issue measured;
- sync: the same queue started in a background thread during setup (megatron_moe/compat/checkpoint.py);
- async: ``--async-save`` (megatron-core's AsyncCallsQueue: shards written by a forked process while
  training goes on; the rename and tracker update at finalisation).

Each save is followed, in the same process, by ``torch.save`` of the same tensors this rank holds
(model and optimizer state dicts, fsynced like the shards); after training, ``load_checkpoint``
and ``torch.load`` of that file are timed. Printed: first and median later save per mode, the
peer's, their ratios; load times and ratio; for async, the time a save blocks training (the call
plus waits in finalisation) against the sync save it replaces: the training time hidden; the
per-file checksums a save writes (its share on rank 0) and their verification at load, each
against the save or load that contains it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank, world_size, argv, mode, peer_dir):
    import torch

    import pretrain_gpt_moe
    from megatron.core.enums import ModelType

    from megatron_moe.training import checkpointing
    from megatron_moe.training import loop as training
    from megatron_moe.compat import checkpoint as compat_checkpoint

    from megatron_moe.training import checkpoint_manifest

    if mode == "sync-no-prestart":
        compat_checkpoint.prestart_writer = lambda: None
    rec = {"save": [], "peer_save": [], "finalize": [], "step": [], "warmup_wait": [],
           "checksum": [], "checksum_bytes": [], "verify": []}
    real_checksums, real_verify = checkpoint_manifest.checksum_files, checkpointing.verify_checkpoint

    def checksums(directory, names):   # this rank's share of a save's files
        t0 = time.perf_counter()
        out = real_checksums(directory, names)
        rec["checksum"].append(time.perf_counter() - t0)
        rec["checksum_bytes"].append(sum(e["bytes"] for e in out.values()))
        return out

    def verify(ckpt):
        t0 = time.perf_counter()
        out = real_verify(ckpt)
        rec["verify"].append(time.perf_counter() - t0)
        return out

    checkpoint_manifest.checksum_files, checkpointing.verify_checkpoint = checksums, verify
    real_wait = compat_checkpoint.wait_writer_ready

    def wait():
        t0 = time.perf_counter()
        real_wait()
        rec["warmup_wait"].append(time.perf_counter() - t0)

    compat_checkpoint.wait_writer_ready = wait
    refs = {}
    real_save, real_finalize = checkpointing.save_checkpoint, checkpointing.finalize_async_save
    peer_path = os.path.join(peer_dir, f"rank{rank}.pt")

    def save(it, model, optimizer, scheduler, args, *a, **k):
        refs.update(model=model, optimizer=optimizer, scheduler=scheduler, args=args)
        t0 = time.perf_counter()
        real_save(it, model, optimizer, scheduler, args, *a, **k)
        rec["save"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state = {"model": model[0].state_dict(), "optimizer": optimizer.state_dict()}
        with open(peer_path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        rec["peer_save"].append(time.perf_counter() - t0)

    def finalize(blocking=False):
        t0 = time.perf_counter()
        out = real_finalize(blocking=blocking)
        rec["finalize"].append(time.perf_counter() - t0)
        return out

    real_step = training.Trainer.train_step

    def step(self, data_iterator):
        t0 = time.perf_counter()
        out = real_step(self, data_iterator)
        rec["step"].append(time.perf_counter() - t0)
        return out

    checkpointing.save_checkpoint, checkpointing.finalize_async_save = save, finalize
    training.Trainer.train_step = step
    training.pretrain(pretrain_gpt_moe.train_valid_test_datasets_provider,
                      pretrain_gpt_moe.model_provider, ModelType.encoder_or_decoder,
                      pretrain_gpt_moe.forward_step, argv=argv)
    args = refs["args"]
    args.load = args.save
    t0 = time.perf_counter()
    checkpointing.load_checkpoint(refs["model"], refs["optimizer"], refs["scheduler"], args)
    rec["load"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch.load(peer_path, weights_only=False)
    rec["peer_load"] = time.perf_counter() - t0
    rec["bytes"] = os.path.getsize(peer_path)
    return rec


def _argv(opts, save_dir, mode):
    argv = (f"--num-layers {opts.layers} --hidden-size {opts.hidden} --num-attention-heads 4 "
            f"--seq-length 128 --micro-batch-size 4 --global-batch-size 16 --lr 1e-3 --mock-data "
            f"--tokenizer-type NullTokenizer --vocab-size 1024 --num-experts 8 --moe-router-topk 2 "
            f"--moe-ffn-hidden-size {4 * opts.hidden} --moe-token-dispatcher-type alltoall "
            f"--disable-bias-linear --expert-model-parallel-size 2 --log-interval 1000 "
            f"--eval-interval 100000 --eval-iters 1 --no-log-expert-load --train-iters {opts.iters} "
            f"--save-interval 1 --save {save_dir}").split()
    return argv + (["--async-save"] if mode == "async" else [])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=6, help="iterations = saves per mode")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    opts = p.parse_args(argv)
    from megatron_moe.runtime.local_ranks import run_distributed

    results = {}
    for mode in ("sync-no-prestart", "sync", "async"):
        with tempfile.TemporaryDirectory() as tmp:
            out = run_distributed(_rank, 2, _argv(opts, os.path.join(tmp, "ckpt"), mode), mode,
                                  tmp, timeout_s=1200)
        results[mode] = out[0]   # rank 0; rank 1 is within noise of it
    med = statistics.median
    size = results["sync"]["bytes"] / 2 ** 20
    print(f"\nstate per rank (torch.save file): {size:.1f} MiB; {opts.iters} saves per mode; 2 ranks")
    print(f"{'mode':<18} {'first save s':>12} {'later (median) s':>17} {'torch.save first':>17} "
          f"{'torch.save later':>17} {'first/later':>11} {'later/torch.save':>16}")
    for mode, r in results.items():
        first, later = r["save"][0], med(r["save"][1:])
        pf, pl = r["peer_save"][0], med(r["peer_save"][1:])
        print(f"{mode:<18} {first:12.3f} {later:17.3f} {pf:17.3f} {pl:17.3f} {first / later:11.2f} "
              f"{later / pl:16.2f}")
    before, after = results["sync-no-prestart"]["save"][0], results["sync"]["save"][0]
    waited = results["sync"]["warmup_wait"][0]
    print(f"first save, writer started at setup vs on first save: {after:.3f}s vs {before:.3f}s "
          f"(ratio {after / before:.2f}); of it waiting for the writer's warm-up (a first save "
          f"seconds after setup): {waited:.3f}s; without that wait {after - waited:.3f}s = "
          f"{(after - waited) / med(results['sync']['save'][1:]):.2f} x a later save")
    for mode, r in results.items():
        print(f"load ({mode}): load_checkpoint {r['load']:.3f}s, torch.load {r['peer_load']:.3f}s, "
              f"ratio {r['load'] / r['peer_load']:.2f}")
    sync_later = med(results["sync"]["save"][1:])
    a = results["async"]
    blocked = [s for s in a["save"][1:]]
    wait = sum(a["finalize"]) / max(1, len(a["save"]))
    async_cost = med(blocked) + wait
    print(f"async: a save blocks training {med(blocked):.3f}s (call) + {wait:.3f}s (finalisation "
          f"waits, per save) = {async_cost:.3f}s vs sync {sync_later:.3f}s: hidden "
          f"{sync_later - async_cost:.3f}s per save ({(1 - async_cost / sync_later) * 100:.0f}%)")
    print(f"median train step: sync {med(results['sync']['step']):.3f}s, async "
          f"{med(a['step']):.3f}s (background writer competing for the same cores)")
    s = results["sync"]
    ck, mib = med(s["checksum"][1:]), med(s["checksum_bytes"][1:]) / 2 ** 20
    print(f"checksums (CRC-32, rank 0's share of each save's files, {mib:.1f} MiB): median "
          f"{ck:.4f}s per save = {ck / sync_later * 100:.1f}% of the sync save "
          f"({sync_later:.3f}s, checksums included), {mib / ck:.0f} MiB/s; at load, verifying "
          f"every file (striped over the ranks) {s['verify'][0]:.4f}s of load_checkpoint's "
          f"{s['load']:.3f}s ({s['verify'][0] / s['load'] * 100:.1f}%)")


if __name__ == "__main__":
    main()
