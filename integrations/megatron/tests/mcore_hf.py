"""The worker's ``--hf-save``: the alternative the HF export is measured against (bench/hf_export.py)."""

from __future__ import annotations

import time


def save_pretrained(w, out: str) -> None:
    """The in-memory conversion: the loaded model's state dict renamed and split into transformers'
    tensors (the same transforms as the hf format), a transformers model built on the meta device,
    ``load_state_dict(strict=True, assign=True)``, ``save_pretrained``."""
    import torch
    import transformers

    from tenplex_megatron.formats.hf.catalog import choose
    from tenplex_megatron.formats.hf.export import _config_json
    from tenplex_megatron.formats.hf.family import Model, TRANSFORMS, Transform, generic_key
    from tenplex_megatron.formats.hf.fields import ModelFields
    from tenplex_megatron.formats.hf.mapping import Job, apply, geometry
    from tenplex_megatron.model.config import MegatronConfig

    t = time.time()
    args = w.megatron_args()
    cfg, fields = MegatronConfig.from_args(args), ModelFields.from_args(args)
    family, geo = choose(cfg, fields), geometry(cfg, fields)
    tensors = {}
    for key, value in w.model.state_dict().items():
        if key.endswith("_extra_state"):
            continue
        generic, layer, expert = generic_key(key.replace(".", "/"))
        names = tuple(n.format(i=layer, e=expert) for n in family.names[generic])
        tensors.update(apply(Job(key, names, TRANSFORMS.get(generic, Transform.COPY), 0), value, geo, value.dtype))
    config = transformers.AutoConfig.for_model(**_config_json(Model(cfg, fields), family, cfg.params_dtype))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.save_pretrained(out)
    print(f"TIME hf_convert_only {time.time() - t:.2f}", flush=True)
