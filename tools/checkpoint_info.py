"""What a checkpoint holds, without loading it: iteration, layout, stored args, tensors, completeness.

    python tools/checkpoint_info.py CKPT                  # the --save directory (tracker) ...
    python tools/checkpoint_info.py CKPT/iter_0000100     # ... or one iteration directory
    python tools/checkpoint_info.py CKPT --json           # the same as one JSON object
    python tools/checkpoint_info.py CKPT --verify         # also read every file against its checksum

Reads only the common state (the small, rank-0 part: args, layout, schedule: ``common.pt``, or,
written by megatron-core >= 0.19, one object inside the DCP checkpoint; megatron_moe/compat/
checkpoint.py) and torch DCP's ``.metadata`` (every tensor's global shape and dtype and which shard
file holds which bytes); shard files are only stat'ed, unless ``--verify`` reads every file and
compares it with the checksums the save wrote (``megatron_moe_checksums.json``). Complete means:
megatron-core's ``metadata.json``, ``.metadata`` and the common state are there, every byte range
the metadata names lies inside an existing shard file, every file has the size the save wrote
(and, with ``--verify``, its checksum). Exit status: 0 complete, 1 incomplete, damaged or
unreadable, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TRACKER = "latest_checkpointed_iteration.txt"   # = megatron_moe.training.checkpointing.TRACKER


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("path", help="--save directory (with latest_checkpointed_iteration.txt) or an "
                                "iter_XXXXXXX directory")
    p.add_argument("--iteration", type=int, default=None,
                   help="With a --save directory: this iteration instead of the tracker's.")
    p.add_argument("--json", action="store_true", help="Print one JSON object.")
    p.add_argument("--no-tensors", action="store_true", help="Leave out the tensor list.")
    p.add_argument("--no-args", action="store_true", help="Leave out the stored args.")
    p.add_argument("--verify", action="store_true",
                   help="Read every file and compare it with the checksums the save wrote "
                        "(megatron_moe_checksums.json); without it only sizes are compared.")
    return p.parse_args(argv)


def resolve(path: str, iteration: int | None) -> tuple[str, int | None, list]:
    """(iteration directory, tracker iteration, problems)."""
    problems = []
    tracker_path = os.path.join(path, TRACKER)
    if os.path.isfile(tracker_path) or iteration is not None:
        tracked = None
        if os.path.isfile(tracker_path):
            text = open(tracker_path).read().strip()
            try:
                tracked = int(text)
            except ValueError:
                problems.append(f"{tracker_path}: not an iteration number: {text!r}")
        it = iteration if iteration is not None else tracked
        if it is None:
            return path, tracked, problems
        return os.path.join(path, f"iter_{it:07d}"), tracked, problems
    return path, None, problems


def inspect(ckpt: str, verify: bool = False) -> dict:
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    info = {"directory": os.path.abspath(ckpt), "problems": []}
    problems = info["problems"]
    if not os.path.isdir(ckpt):
        problems.append(f"{ckpt} does not exist")
        return info
    if ckpt.rstrip("/").endswith(".tmp"):
        problems.append("a .tmp directory: a save that never finished (never loaded)")
    from megatron_moe.compat.checkpoint import COMMON_PT, common_state_in_dcp, read_common_state
    from megatron_moe.training import fsdp_dtensor_checkpoint

    # Megatron-FSDP's fsdp_dtensor: one DCP save, its common state among the shards' objects
    fsdp_dtensor = fsdp_dtensor_checkpoint.is_fsdp_dtensor(ckpt)
    for name in (".metadata",) if fsdp_dtensor else ("metadata.json", ".metadata"):
        if not os.path.isfile(os.path.join(ckpt, name)):
            problems.append(f"{name} missing")
    if os.path.isfile(os.path.join(ckpt, "metadata.json")):
        info["format"] = json.load(open(os.path.join(ckpt, "metadata.json")))
    if fsdp_dtensor:
        info["format"] = {"sharded_backend": "fsdp_dtensor"}
    in_dcp = False
    if not fsdp_dtensor and os.path.isfile(os.path.join(ckpt, ".metadata")):
        try:
            in_dcp = common_state_in_dcp(FileSystemReader(ckpt).read_metadata())
        except Exception:
            pass  # reported below
    common = {}
    if not fsdp_dtensor and not in_dcp and not os.path.isfile(os.path.join(ckpt, COMMON_PT)):
        problems.append(f"{COMMON_PT} missing")
    else:
        try:
            common = (fsdp_dtensor_checkpoint.load_common(ckpt) if fsdp_dtensor
                      else read_common_state(ckpt))
        except BaseException as exc:  # a truncated file, a foreign pickle (DCP: BaseException)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            where = "common state in the shards" if in_dcp or fsdp_dtensor else COMMON_PT
            problems.append(f"{where} unreadable: {type(exc).__name__}: {str(exc)[:300]}")
    info["iteration"] = common.get("iteration")
    layout = common.get("parallel_layout")
    if layout:
        layout = dict(layout)
        layout["dp"] = layout["world"] // (layout["tp"] * layout["pp"] * layout.get("cp", 1))
    info["layout"] = layout
    stored = common.get("args")
    info["args"] = {k: v for k, v in sorted(vars(stored).items())} if stored is not None else None
    for key in ("consumed_train_samples", "consumed_valid_samples", "has_optimizer",
                "optimizer_count", "has_rng", "checkpoint_version"):
        info[key] = common.get(key)
    tensors, objects = [], 0
    if os.path.isfile(os.path.join(ckpt, ".metadata")):
        try:
            metadata = FileSystemReader(ckpt).read_metadata()
        except Exception as exc:
            problems.append(f".metadata unreadable: {type(exc).__name__}: {exc}")
            metadata = None
        if metadata is not None:
            for key, meta in metadata.state_dict_metadata.items():
                if isinstance(meta, TensorStorageMetadata):
                    tensors.append({"name": key, "shape": list(meta.size),
                                    "dtype": str(meta.properties.dtype).replace("torch.", ""),
                                    "shards": len(meta.chunks)})
                else:
                    objects += 1
            sizes = {}
            for index, storage in metadata.storage_data.items():
                name = storage.relative_path
                if name not in sizes:
                    full = os.path.join(ckpt, name)
                    sizes[name] = os.path.getsize(full) if os.path.isfile(full) else None
                if sizes[name] is None:
                    problems.append(f"shard file {name} missing")
                    sizes[name] = -1
                elif sizes[name] >= 0 and storage.offset + storage.length > sizes[name]:
                    problems.append(f"shard file {name} is truncated ({sizes[name]} bytes, "
                                    f"{index.fqn} needs {storage.offset + storage.length})")
                    sizes[name] = -2   # report each file once
            info["shard_files"] = len(sizes)
            info["bytes"] = sum(s for s in sizes.values() if s and s > 0)
    info["tensors"] = sorted(tensors, key=lambda t: t["name"])
    info["objects"] = objects
    info["checksums"] = _checksums(ckpt, problems, verify)
    info["complete"] = not problems
    return info


def _checksums(ckpt: str, problems: list, verify: bool) -> str:
    """The manifest a save writes (megatron_moe/training/checkpoint_manifest.py): with
    ``verify`` every file is read and checksummed, else sizes only."""
    from megatron_moe.training import checkpoint_manifest as manifest

    try:
        entries = manifest.read_manifest(ckpt)
    except manifest.ManifestError as exc:
        problems.append(str(exc))
        return "unreadable manifest"
    if entries is None:
        return f"not verified: no {manifest.MANIFEST} (saved before checkpoints carried checksums)"
    names = sorted(entries["files"])
    if verify:
        found = manifest.check_files(ckpt, entries, names)
    else:
        found = [f"{name}: {os.path.getsize(os.path.join(ckpt, name))} bytes, the save wrote "
                 f"{entries['files'][name]['bytes']}" for name in names
                 if os.path.isfile(os.path.join(ckpt, name))
                 and os.path.getsize(os.path.join(ckpt, name)) != entries["files"][name]["bytes"]]
    problems.extend(found)
    if found:
        return f"{len(found)} of {len(names)} files differ from the save"
    return (f"verified ({len(names)} files, {manifest.ALGORITHM})" if verify else
            f"sizes match the manifest ({len(names)} files; --verify reads them)")


def _print(info, tracked, show_tensors, show_args):
    layout = info.get("layout")
    print(f"checkpoint: {info['directory']}")
    if tracked is not None:
        print(f"tracker:    {TRACKER} -> {tracked}")
    print(f"iteration:  {info.get('iteration')}")
    if layout:
        print("layout:     " + " ".join(f"{k.upper()}={layout[k]}"
                                         for k in ("tp", "pp", "ep", "etp", "cp", "dp", "world")
                                         if k in layout))
    print(f"samples:    consumed train {info.get('consumed_train_samples')}, valid "
          f"{info.get('consumed_valid_samples')}")
    print(f"contents:   optimizer {info.get('has_optimizer')} "
          f"({info.get('optimizer_count')} chained), rng {info.get('has_rng')}, "
          f"{len(info.get('tensors', []))} tensors, {info.get('objects', 0)} objects, "
          f"{info.get('shard_files', 0)} shard files, {info.get('bytes', 0) / 2**20:.1f} MiB")
    print(f"checksums:  {info.get('checksums')}")
    print("complete:   " + ("yes" if info["complete"] else "NO: " + "; ".join(info["problems"])))
    if show_args and info.get("args"):
        print("args:")
        for k, v in info["args"].items():
            print(f"  {k} = {v!r}")
    if show_tensors and info.get("tensors"):
        width = max(len(t["name"]) for t in info["tensors"])
        print("tensors:")
        for t in info["tensors"]:
            print(f"  {t['name']:<{width}}  {str(tuple(t['shape'])):<20} {t['dtype']}")


def main(argv=None):
    opts = parse_args(argv)
    ckpt, tracked, problems = resolve(opts.path, opts.iteration)
    info = inspect(ckpt, verify=opts.verify)
    info["problems"][:0] = problems
    info["complete"] = not info["problems"]
    if tracked is not None:
        info["tracker"] = tracked
    if opts.no_tensors:
        info.pop("tensors", None)
    if opts.no_args:
        info.pop("args", None)
    if opts.json:
        print(json.dumps(info, default=repr, indent=1))
    else:
        _print(info, tracked, not opts.no_tensors, not opts.no_args)
    return 0 if info["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
