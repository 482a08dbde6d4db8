"""Megatron-LM's per-rank ``iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` checkpoints: read, write, verify."""
