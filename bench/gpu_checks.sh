#!/bin/bash
# The checks that need a GPU (docs/benchmarks.md, "On a GPU"), in one run from the repository root.
# Needs tenplex, tenplex_megatron and megatron-core installed (the README's test command) and one CUDA device.
# Installed, not on PYTHONPATH: the Megatron and HF formats are found through tenplex-megatron's entry points.
# Offline (the lent GPU machine): pip install --no-index --no-deps --no-build-isolation --target /tmp/site
# . integrations/megatron (and a carried megatron-core wheel), then PYTHONPATH=/tmp/site.
# 1. GPU-resident shards saved and loaded bit for bit; 2. their save/load speed; 3. a megatron-core GPT trained
# and saved on the GPU (legacy and torch_dist, distributed optimizer), verified and resharded by tenplex, then
# loaded by megatron-core on CPU at tp2 pp2 (4 gloo processes): the logits must match the GPU's; 4. a bf16 GPT
# trained on the GPU with a non-distributed Adam, saved legacy, resharded to tp2 pp2 and back: every model
# and optimizer tensor must come back bit for bit, and megatron-core must load the tp2 pp2 files; 5. fp16 (loss
# scaler) and bf16 with a non-distributed Adam saved in both formats: through the other format and back, every
# torch_dist tensor and the optimizer entry come back bit for bit.
R=$PWD; export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi -L
python3 -c "import torch, megatron.core, xxhash, fsspec, scipy, safetensors, tqdm; print('torch', torch.__version__, 'mcore', megatron.core.__version__)"
echo "== 1. GPU-resident shards saved and loaded"
python3 -m pytest -q tests/store/test_gpu_shards.py -p no:cacheprovider 2>&1 | tail -3
echo "== 2. their speed"
python3 bench/gpu_save.py
echo "== 3. a megatron-core GPT trained and saved on the GPU"
G=${G:-/tmp/tenplex-gpu-check}; rm -rf $G; M="--layers 4 --hidden 64 --heads 8 --query-groups 2 --ffn 96 --swiglu --position rope --untie --vocab 100 --make-vocab-size-divisible-by 16 --seq 8"
cd integrations/megatron/tests
timeout 240 torchrun --standalone --nproc_per_node=1 mcore_worker.py --device cuda $M --dist-opt --train-steps 2 --save both --save-dir $G --dist-layout megatron --logits-out $G/gpu_logits.pt 2>&1 | grep -v Warning | tail -8
python3 -c "
import torch; s=torch.load('$G/legacy/iter_0000010/mp_rank_00/model_optim_rng.pt',map_location='meta',weights_only=False)
print('legacy locations: cuda_rng_state', s['rng_state'][0]['cuda_rng_state'].shape)" 2>&1 | tail -1
python3 - <<P 2>&1 | tail -2
import zipfile; z=zipfile.ZipFile('$G/legacy/iter_0000010/mp_rank_00/model_optim_rng.pt'); d=[n for n in z.namelist() if n.endswith('data.pkl')][0]; print('pickle mentions cuda:', b'cuda' in z.read(d))
P
echo "-- verify, reshard with this tree"
for s in legacy dist; do python3 -m tenplex verify $G/$s 2>&1 | tail -1; done
python3 -m tenplex reshard $G/legacy $G/l2d --to dp=1,tp=2,pp=2 --format megatron-dist 2>&1 | tail -2
python3 -m tenplex reshard $G/dist $G/d2l --to dp=1,tp=2,pp=2 --format megatron-legacy 2>&1 | tail -2
python3 -m tenplex reshard $G/legacy $G/hf --format hf 2>&1 | tail -2
echo "== 3b. loaded on CPU by megatron-core at tp2 pp2 (4 gloo processes)"
for x in "dist l2d" "legacy d2l"; do set -- $x
timeout 240 torchrun --standalone --nproc_per_node=4 mcore_worker.py --tp 2 --pp 2 $M --dist-opt --optimizer --load $1 --load-dir $G/$2 --loaded-logits-out $G/$2_logits.pt 2>&1 | grep -i "error\|LOGITS" | tail -6
done
python3 - <<P
import torch
g = torch.load('$G/gpu_logits.pt')['logits']
for n in ('l2d', 'd2l'):
    try:
        c = torch.load(f'$G/{n}_logits.pt')['logits']
        print(n, 'max |cpu(tp2,pp2) - gpu(tp1)| =', (c - g).abs().max().item(), 'of max', g.abs().max().item())
    except Exception as e:
        print(n, 'ERROR', e)
P
echo "== 4. bf16 trained on the GPU with a non-distributed Adam, saved legacy (Megatron-LM's most common --save)"
# its fp32 main params are cuda tensors with Python attributes: torch pickles them through
# torch._tensor._rebuild_from_type_v2 (docs/megatron.md, the allow-list)
timeout 240 torchrun --standalone --nproc_per_node=1 mcore_worker.py --device cuda $M --bf16 --train-steps 2 --save legacy --save-dir $G/bf16 --logits-out $G/bf16_gpu_logits.pt 2>&1 | grep -v Warning | tail -3
python3 - <<P 2>&1 | tail -1
import glob, zipfile; f=glob.glob('$G/bf16/iter_*/mp_rank_00/model_optim_rng.pt')[0]; z=zipfile.ZipFile(f); d=z.read([n for n in z.namelist() if n.endswith('data.pkl')][0])
print('bf16 file: _rebuild_from_type_v2 in pickle:', b'_rebuild_from_type_v2' in d, '; cuda:0 storages:', b'cuda:0' in d)
P
python3 -m tenplex verify $G/bf16 2>&1 | tail -1
python3 -m tenplex reshard $G/bf16 $G/bf16_2x2 --to dp=1,tp=2,pp=2 --format megatron-legacy 2>&1 | tail -1
python3 -m tenplex reshard $G/bf16_2x2 $G/bf16_back --to dp=1,tp=1,pp=1 --format megatron-legacy 2>&1 | tail -1
python3 - <<P 2>&1 | tail -3
# the round trip tp1 -> tp2 pp2 -> tp1 gives back every model and optimizer tensor bit for bit
import glob, torch
def load(root):
    return torch.load(glob.glob(root + '/iter_*/mp_rank_00/model_optim_rng.pt')[0], map_location='cpu', weights_only=False)
def flat(x, p=''):
    if isinstance(x, torch.Tensor): yield p, x
    elif isinstance(x, dict):
        for k, v in x.items(): yield from flat(v, f'{p}/{k}')
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x): yield from flat(v, f'{p}/{i}')
a, b = load('$G/bf16'), load('$G/bf16_back')
ta = {k: v for part in ('model', 'optimizer') for k, v in flat(a[part], part) if not k.endswith('_extra_state')}
tb = {k: v for part in ('model', 'optimizer') for k, v in flat(b[part], part) if not k.endswith('_extra_state')}
bad = [k for k in ta if k not in tb or ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
print('bf16 round trip:', len(ta), 'tensors,', sum(t.numel() * t.element_size() for t in ta.values()), 'bytes;',
      'missing or different:', bad[:5] or 'none', '; extra:', sorted(set(tb) - set(ta))[:5] or 'none')
P
timeout 240 torchrun --standalone --nproc_per_node=4 mcore_worker.py --tp 2 --pp 2 $M --bf16 --optimizer --load legacy --load-dir $G/bf16_2x2 --loaded-logits-out $G/bf16_2x2_logits.pt 2>&1 | grep -i "error" | tail -4
python3 -c "
import torch; g = torch.load('$G/bf16_gpu_logits.pt')['logits'].float(); c = torch.load('$G/bf16_2x2_logits.pt')['logits'].float()
print('bf16 tp2 pp2 on CPU: max |cpu - gpu| logits', (c - g).abs().max().item(), 'of max', g.abs().max().item(), '(bf16 arithmetic differs between devices)')"
echo "== 5. fp16 (loss scaler) and bf16 with a non-distributed Adam, trained on the GPU, saved in both formats"
for K in fp16 bf16; do
timeout 240 torchrun --standalone --nproc_per_node=1 mcore_worker.py --device cuda $M --$K --train-steps 2 --save both --save-dir $G/$K 2>&1 | grep -v Warning | tail -1
for s in legacy dist; do python3 -m tenplex verify $G/$K/$s 2>&1 | tail -1; done
python3 -m tenplex reshard $G/$K/dist $G/${K}_l --to dp=1,tp=2,pp=2 --format megatron-legacy 2>&1 | tail -1
python3 -m tenplex reshard $G/${K}_l $G/${K}_ld --to dp=1,tp=1,pp=1 --format megatron-dist 2>&1 | tail -1
python3 -m tenplex reshard $G/$K/legacy $G/${K}_d --to dp=1,tp=2,pp=2 --format megatron-dist 2>&1 | tail -1
python3 -m tenplex reshard $G/${K}_d $G/${K}_dd --to dp=1,tp=1,pp=1 --format megatron-dist 2>&1 | tail -1
python3 - <<P 2>&1 | grep -v Warn | tail -2
# torch_dist -> legacy tp2 pp2 -> torch_dist tp1 (and legacy -> dist tp2 pp2 -> dist tp1) give back every tensor
import argparse, glob, torch
from torch.distributed.checkpoint import FileSystemReader, load
def read(d):
    d = (glob.glob(d + '/iter_*/') or [d])[0]
    md = FileSystemReader(d).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items() if hasattr(v, 'size')}
    load(sd, checkpoint_id=d, no_dist=True)
    with torch.serialization.safe_globals([argparse.Namespace]):
        return sd, torch.load(d + '/common.pt', map_location='cpu', weights_only=False)['optimizer']
a, ca = read('$G/$K/dist')
for b in ('ld', 'dd'):
    t, c = read('$G/${K}_' + b)
    bad = sorted(set(a) ^ set(t)) + [k for k in a if k in t and not torch.equal(a[k], t[k])]
    print('$K', b, len(a), 'tensors,', sum(v.numel() * v.element_size() for v in a.values()), 'bytes; fp32_param keys:',
          sum(k.startswith('optimizer.state.fp32_param.') for k in a), '; different:', bad[:3] or 'none',
          '; grad scaler', ca.get('grad_scaler'), 'same' if str(c) == str(ca) else f'DIFFERS {c}')
P
done
