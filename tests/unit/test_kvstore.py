"""The KV cache in layers: the block pool alone, both stores behind one interface, and an engine that never
asks which store it has (``modelserver/local/kvstore.py``, ``blockpool.py``)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from modelserver.local import engine as engine_module
from modelserver.local.blockpool import BlockPool, OutOfBlocks
from modelserver.local.engine import EngineStatistics, LocalEngine
from modelserver.local.kvstore import KVStore, PagedStore, SlotStore, build_store
from modelserver.local.protocol import BadRequest, SamplingParams
from modelserver.llm import build_char_tokenizer, build_tiny_model, tiny_config

# What names a store's kind, or reaches below the store's interface: the engine must use none of them.
STORE_INTERNALS = {"PagedRunner", "SlotRunner", "BlockPool", "BlockTables", "BlockRadix", "PagedStore", "SlotStore",
                   "radix", "tree", "pool", "tables", "kind", "max_blocks", "block_size", "window"}


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    return build_tiny_model(tiny_config(len(build_char_tokenizer())), seed=0)


def _pool(max_tokens: int = 32, block_size: int = 4, initial_tokens: int = 4) -> BlockPool:
    return BlockPool(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32, max_tokens=max_tokens,
                     block_size=block_size, initial_tokens=initial_tokens)


# ------------------------------------------------------------------------ the pool alone


def test_the_pool_grows_by_doubling_hands_out_the_lowest_free_block_and_keeps_its_contents() -> None:
    pool = _pool()
    assert pool.max_blocks == 8 and pool.free_blocks == 8 and pool.cache_bytes() == 2 * 2 * 4 * 1 * 4 * 4
    first = pool.alloc()
    pool.k[0][first * 4:(first + 1) * 4] = 7.0
    blocks = [first] + [pool.alloc() for _ in range(4)]  # grows 1 -> 2 -> 4 -> 8 blocks
    assert blocks == [0, 1, 2, 3, 4] and pool.k[0].shape[0] == 8 * 4
    assert bool((pool.k[0][:4] == 7.0).all())  # growing copied what was there
    pool.decref(2)
    pool.decref(1)
    assert pool.alloc() == 1 and pool.used_blocks == 4


def test_a_block_is_free_once_its_last_holder_lets_go_and_the_bound_holds() -> None:
    pool = _pool(max_tokens=8)
    a = pool.alloc()
    pool.incref(a)
    assert pool.refcount(a) == 2
    pool.decref(a)
    assert pool.refcount(a) == 1 and pool.free_blocks == 1
    pool.decref(a)
    assert pool.free_blocks == 2
    pool.alloc(), pool.alloc()
    with pytest.raises(OutOfBlocks, match="all 2 KV blocks"):
        pool.alloc()


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 0}, "block_size must be at least 1"),
    ({"max_tokens": 3, "block_size": 4}, "at least one block"),
])
def test_a_pool_that_cannot_hold_a_block_is_refused(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _pool(**kwargs)


# ------------------------------------------------------------------------ both stores, one interface


def _store(model, kind: str, **kwargs) -> KVStore:  # type: ignore[no-untyped-def]
    settings = dict(max_seqs=4, kv_tokens=64, block_size=4, attention_window=None, attention_sinks=0,
                    retained_tokens=256, int8_tokens=0, disk_tokens=0, disk_dir=None, chunk_size=16)
    settings.update(kwargs)
    return build_store(model, kind, **settings)  # type: ignore[arg-type]


def test_build_store_gives_the_kind_asked_and_refuses_others(model) -> None:  # type: ignore[no-untyped-def]
    assert isinstance(_store(model, "paged"), PagedStore) and isinstance(_store(model, "slot"), SlotStore)
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        _store(model, "blocks")


@pytest.mark.parametrize("kind", ["paged", "slot"])
def test_every_statistic_a_store_reports_is_an_engine_statistic(model, kind: str) -> None:  # type: ignore[no-untyped-def]
    fields = {f.name for f in dataclasses.fields(EngineStatistics)}
    reported = _store(model, kind).statistics()
    assert set(reported) <= fields and reported["kv_cache"] == kind
    assert reported["kv_bytes_per_token"] > 0 and reported["kv_slot_bytes"] > 0


@dataclasses.dataclass
class _Holder:
    prompt_ids: list[int]
    params: SamplingParams
    kv_id: int | None = None
    cached: int = 0
    cached_tokens: int = 0


@pytest.mark.parametrize("kind", ["paged", "slot"])
def test_a_retained_prefix_is_shared_again_and_an_invalidation_forgets_it(model, kind: str) -> None:  # type: ignore[no-untyped-def]
    store = _store(model, kind)
    prompt = list(range(5, 17))  # 12 tokens
    first = _Holder(prompt, SamplingParams(max_new_tokens=4))
    first.kv_id = store.runner.acquire()
    store.runner.prefill(first.kv_id, 0, prompt)
    store.retain(prompt, first.kv_id, len(prompt))
    store.runner.release(first.kv_id)

    again = _Holder(prompt + [3, 4], SamplingParams(max_new_tokens=4))
    again.kv_id = store.runner.acquire()
    store.share(again, 0, None)
    assert again.cached == again.cached_tokens == len(prompt)  # the whole retained prompt, not computed
    store.runner.release(again.kv_id)

    store.invalidate()
    third = _Holder(prompt + [3, 4], SamplingParams(max_new_tokens=4))
    third.kv_id = store.runner.acquire()
    store.share(third, 0, None)
    assert third.cached == 0 and store.epoch == 1


def test_only_the_paged_store_bounds_a_request_by_its_pool(model) -> None:  # type: ignore[no-untyped-def]
    paged, slot = _store(model, "paged"), _store(model, "slot")
    with pytest.raises(BadRequest, match="more than the server's KV pool holds"):
        paged.check_request(40, 40)  # 80 tokens > the 64-token pool
    slot.check_request(40, 40)
    paged.check_request(30, 30)


# ------------------------------------------------------------------------ the engine never asks


def store_questions(source: str) -> list[str]:
    """Where ``source`` asks which KV store it has or reaches below the store's interface: the names of
    ``STORE_INTERNALS`` it uses, and every ``isinstance`` on the runner or the store."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in STORE_INTERNALS:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute) and node.attr in STORE_INTERNALS:
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module in ("modelserver.local.radix", "modelserver.local.blockpool",
                                                                   "modelserver.local.blocktable"):
            found.append((node.lineno, f"imports {node.module}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
              and any(isinstance(a, ast.Attribute) and a.attr in ("runner", "kv") for a in node.args[:1])):
            found.append((node.lineno, f"isinstance on the {node.args[0].attr}"))  # type: ignore[attr-defined]
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_the_engine_never_asks_which_kv_store_it_has() -> None:
    source = Path(engine_module.__file__).read_text()
    assert store_questions(source) == []


def test_the_rule_sees_a_branch_on_the_store() -> None:
    bad = ("from modelserver.local.radix import BlockRadix\n"
           "def f(self):\n"
           "    if isinstance(self.runner, object):\n"
           "        return self.kv.tree\n")
    assert store_questions(bad) == ["line 1: imports modelserver.local.radix", "line 3: isinstance on the runner",
                                    "line 4: .tree"]


@pytest.mark.parametrize("kind", ["paged", "slot"])
def test_the_engine_reports_the_store_it_was_given(model, kind: str) -> None:  # type: ignore[no-untyped-def]
    engine = LocalEngine(model, build_char_tokenizer(), max_batch=4, kv_cache=kind, kv_cache_tokens=256, kv_block_size=4)
    stats = engine.statistics()
    assert stats.kv_cache == kind and (stats.kv_blocks_total == 64) == (kind == "paged")
    assert engine.runner is engine.kv.runner and engine.prefix_cache is engine.kv.cold
