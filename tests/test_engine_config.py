"""The engine's settings (``EngineConfig``): validation with errors that name the setting, resolution
for the models, the mapping of ``engine_options``, and the config as part of every captured graph's
key (CPU, tiny random Llama; about a second)."""

from __future__ import annotations

import pytest
import torch

from smcdecode import SMCDecodeError
from smcdecode.backends.engine import Engine, EngineConfig, KVPool, Llama, LlamaConfig
from smcdecode.backends.engine.config import check_options
from smcdecode.backends.engine.graphs import GraphCache


def tiny(seed: int = 0, layers: int = 1) -> Llama:
    return Llama.random(LlamaConfig(32, 32, layers, 4, 2, 64, rope_theta=10000.0), dtype=torch.float32, device="cpu",
                        seed=seed)


@pytest.mark.parametrize("fields, match", [
    (dict(num_pages=64, page_size=0), r"page_size must be a positive integer .* got 0"),
    (dict(num_pages=1), r"num_pages must be an integer >= 2 .* got 1"),
    (dict(num_pages=64.0), r"num_pages must be an integer >= 2 .* got 64.0"),
    (dict(num_pages=64, max_context=-5), r"max_context must be a positive integer .* got -5"),
    (dict(num_pages=64, use_graphs="yes"), r"use_graphs must be True, False or None, got 'yes'"),
    (dict(num_pages=64, triton=1), r"triton must be True, False or None, got 1"),
    (dict(num_pages=64, dtype="int8"), r"dtype must be a floating-point torch dtype or its name .* got 'int8'"),
    (dict(num_pages=64, device="gpu0"), r"device must name a torch device .* got 'gpu0'"),
])
def test_bad_settings_are_refused_by_name(fields, match):
    with pytest.raises(SMCDecodeError, match=match):
        EngineConfig(**fields)


def test_resolved_config_states_what_the_engine_runs():
    """On the CPU: no graphs, no Triton by default; explicit choices are kept; a dtype other than the
    models' is an error; the config is frozen and hashable (a key)."""
    cfg = EngineConfig(num_pages=64, page_size=4, dtype="float32").resolved(torch.float32, torch.device("cpu"))
    assert (cfg.use_graphs, cfg.triton, cfg.dtype, cfg.device) == (False, False, torch.float32, torch.device("cpu"))
    forced = EngineConfig(num_pages=64, triton=True, use_graphs=True).resolved(torch.float32, torch.device("cpu"))
    assert forced.triton and forced.use_graphs
    assert cfg != forced and len({cfg: 1, forced: 2}) == 2
    with pytest.raises(AttributeError):
        cfg.page_size = 8
    with pytest.raises(SMCDecodeError, match=r"engine dtype torch.bfloat16 differs from the models' \(torch.float32\)"):
        EngineConfig(num_pages=64, dtype=torch.bfloat16).resolved(torch.float32, torch.device("cpu"))
    assert not KVPool(1, 1, 8, 4, 4, torch.float32, "cpu").triton  # the pools' default: CUDA only
    assert KVPool(1, 1, 8, 4, 4, torch.float32, "cpu", triton=True).triton


def test_engine_builds_one_config_and_keys_every_graph_with_it(monkeypatch):
    monkeypatch.setattr(GraphCache, "capture", lambda self, fn, use_graphs: fn)  # "graph" = the eager step
    target, draft = tiny(0, 2), tiny(1)
    engine = Engine(target, draft, num_pages=128, page_size=4, max_context=32)
    assert engine.config == Engine(target, draft, EngineConfig(num_pages=128, page_size=4, max_context=32)).config
    assert (engine.page_size, engine.num_pages, engine.max_context) == (4, 128, 32)
    assert not engine.kv_t.triton and not engine.kv_d.triton
    engine.smc_sd([[1, 2, 3]], particles=2, block_size=2, max_new_tokens=3, use_graphs=True)
    engine.autoregressive([[1, 2, 3]], max_new_tokens=2, use_graphs=True)
    keys = list(engine.graphs.keys())
    assert [k[0][0] for k in keys] == ["smc", "ar"] and all(c is engine.config for _, c in keys)
    with pytest.raises(SMCDecodeError, match="num_pages"):
        Engine(target, draft)
    with pytest.raises(SMCDecodeError, match="not both"):
        Engine(target, draft, EngineConfig(num_pages=64), num_pages=64)


def test_engine_options_map_onto_the_config():
    """``engine_options`` are checked by name and value, and become the config of the engine a
    strategy runs on: the context rounded up to a power of two, enough pages for every row unless
    given."""
    assert check_options({"page_size": 8, "use_graphs": False, "dtype": "float32"}) == {
        "page_size": 8, "use_graphs": False, "dtype": "float32"}
    with pytest.raises(SMCDecodeError, match=r"unknown engine option\(s\) \['pages'\]: backend='engine' takes"):
        check_options({"pages": 3})
    for bad, match in (({"page_size": -1}, "page_size must be a positive integer"),
                       ({"num_pages": "many"}, "num_pages must be an integer >= 2"),
                       ({"use_graphs": 1}, "use_graphs must be True, False or None"),
                       ({"dtype": "int32"}, "dtype must be a floating-point torch dtype")):
        with pytest.raises(SMCDecodeError, match=match):
            check_options(bad)
    cfg = EngineConfig.from_options({"page_size": 8}, rows=3, context=100)
    assert (cfg.max_context, cfg.page_size, cfg.num_pages) == (128, 8, 3 * (128 // 8 + 2) + 16)
    cfg = EngineConfig.from_options({"num_pages": 40, "use_graphs": False, "dtype": "float32"}, rows=3, context=10)
    assert (cfg.max_context, cfg.num_pages, cfg.use_graphs, cfg.dtype) == (64, 40, False, torch.float32)
