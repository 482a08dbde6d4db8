"""GPU-resident shards: tenplex.save from the device against a floor, and load then copy to the device.

About 1 GB of bf16 GPT weights (8 layers, hidden 2048, vocab 32000) at ``dp=1,tp=2,pp=1``, every
shard on ``cuda``, saved to tmpfs (``/dev/shm``) three times; the fastest of each counts:

* ``tenplex_save``: :func:`tenplex.save` (shards reach the file through a 64 MiB staging buffer,
  :mod:`tenplex.store.host`), fsynced and committed;
* ``floor_save``: each tensor copied to the host whole (``.cpu()``) and written to one file, fsynced;
* ``tenplex_load_to_gpu``: :func:`tenplex.load` of each rank, then ``.cuda()`` of every tensor.

Needs a CUDA device. Last line: JSON with the times (s), ``save_over_floor`` and GB/s.

Usage: python bench/gpu_save.py
"""
import json
import os
import shutil
import time

import torch
from tenplex.api import load, save
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize

spec = GPTSpec(num_layers=8, hidden=2048, heads=16, query_groups=8, ffn=5632, vocab=32000, swiglu=True,
               tied=False, dtype="bfloat16", optimizer=None, make_vocab_size_divisible_by=128)
cfg = P(dp=1, tp=2, pp=1)
tree = gpt_tree(spec)
st = random_state(tree, cfg, 1)
shards = {r: {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in materialize(tree, st, cfg, r).items()}
          for r in range(cfg.world_size)}
del st
nbytes = sum(v.numel() * v.element_size() for s in shards.values() for v in s.values() if isinstance(v, torch.Tensor))
root = "/dev/shm/gsave"
best = {}
for i in range(3):
    shutil.rmtree(root, ignore_errors=True)
    torch.cuda.synchronize(); t = time.perf_counter()
    save(root, tree, cfg, shards)
    best["tenplex_save"] = min(best.get("tenplex_save", 9e9), time.perf_counter() - t)
    os.makedirs("/dev/shm/floor", exist_ok=True)
    t = time.perf_counter()
    with open("/dev/shm/floor/x", "wb") as f:
        for s in shards.values():
            for v in s.values():
                if isinstance(v, torch.Tensor):
                    f.write(v.contiguous().view(-1).view(torch.uint8).cpu().numpy())
        f.flush(); os.fsync(f.fileno())
    best["floor_save"] = min(best.get("floor_save", 9e9), time.perf_counter() - t)
    t = time.perf_counter()
    for r in range(cfg.world_size):
        got = {k: v.cuda() for k, v in load(root, cfg, r).items() if isinstance(v, torch.Tensor)}
    torch.cuda.synchronize()
    best["tenplex_load_to_gpu"] = min(best.get("tenplex_load_to_gpu", 9e9), time.perf_counter() - t)
print(f"{nbytes / 1e9:.2f} GB of bf16 shards on {torch.cuda.get_device_name()}")
print(json.dumps({**{k: round(v, 3) for k, v in best.items()},
                  "save_over_floor": round(best["tenplex_save"] / best["floor_save"], 2),
                  "save_GBps": round(nbytes / best["tenplex_save"] / 1e9, 2),
                  "load_to_gpu_GBps": round(nbytes / best["tenplex_load_to_gpu"] / 1e9, 2)}))
