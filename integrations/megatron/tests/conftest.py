"""Fixtures: megatron-core checkpoints made once per session."""

import json
import pathlib

import pytest

from mcore_helpers import MODEL_JSON, MODELS, run_worker


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    """``get(model, tp, pp)``: a directory with ``legacy/``, ``dist/`` and ``ref.pt`` made by megatron-core."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("mcore")

    def get(model: str, tp: int, pp: int) -> pathlib.Path:
        key = (model, tp, pp)
        if key not in cache:
            d = root / f"{model}-tp{tp}-pp{pp}"
            run_worker(tp, pp, MODELS[model], "--save", "both", "--save-dir", str(d),
                       "--logits-out", str(d / "ref.pt"))
            cache[key] = d
        return cache[key]
    return get


@pytest.fixture(scope="session")
def model_config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "gqa.json"
    path.write_text(json.dumps(MODEL_JSON["gqa"]))
    return path
