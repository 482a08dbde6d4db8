#!/bin/bash
# The checks that need a GPU (docs/benchmarks.md, "On a GPU"), in one run from the repository root.
# Needs tenplex, tenplex_megatron and megatron-core installed (the README's test command) and one CUDA device.
# 1. GPU-resident shards saved and loaded bit for bit; 2. their save/load speed; 3. a megatron-core GPT trained
# and saved on the GPU (legacy and torch_dist, distributed optimizer), verified and resharded by tenplex, then
# loaded by megatron-core on CPU at tp2 pp2 (4 gloo processes): the logits must match the GPU's.
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
