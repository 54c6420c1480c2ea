"""What DCP's two exchanges share (``attncomm.dcp.exchange``): the registry, the geometry check,
the token buckets and the functional calls' object cache. No process group needed."""
from __future__ import annotations

import pytest
import torch

from attncomm.dcp import tracing
from attncomm.dcp.exchange import ObjectCache, Registry, geometry_error, token_bucket
from attncomm.dcp.lse_merge.backend import MERGE_REGISTRY
from attncomm.dcp.query_gather.backend import GATHER_REGISTRY


def test_each_exchange_registers_its_backends_and_names_the_rest():
    assert set(MERGE_REGISTRY.classes) == {"reference", "ag_rs", "a2a", "symm_a2a"}
    assert set(GATHER_REGISTRY.classes) == {"all_gather", "symm"}
    assert MERGE_REGISTRY.backend_class("a2a").name == "a2a"
    with pytest.raises(ValueError, match=r"^unknown DCP backend 'x'; expected one of "
                                         r"\['reference', 'ag_rs', 'a2a', 'symm_a2a'\]$"):
        MERGE_REGISTRY.backend_class("x")
    with pytest.raises(ValueError, match=r"^unknown gather backend 'auto'; expected one of "
                                         r"\['all_gather', 'symm'\]$"):
        GATHER_REGISTRY.backend_class("auto")
    assert MERGE_REGISTRY.name_error("auto") is None and MERGE_REGISTRY.code("auto") == 4
    assert GATHER_REGISTRY.name_error("nccl") == (
        "backend='nccl' is not one of ['all_gather', 'symm', 'auto']")
    assert GATHER_REGISTRY.code("nccl") == -1


def test_register_takes_only_declared_names():
    reg = Registry(("a", "b", "auto"), "test backend", "NAMES", preferred="a",
                   rule_of_thumb=("a", "b"), env_var="ATTNCOMM_DCP_BACKEND")

    class B:
        name = "b"

    class Auto:
        name = "auto"

    assert reg.register(B) is B and reg.backend_class("b") is B
    with pytest.raises(ValueError, match=r"^unknown test backend name 'auto'; declare it in "
                                         r"NAMES$"):
        reg.register(Auto)
    with pytest.raises(ValueError, match="expected one of \\['a', 'b'\\]"):
        reg.backend_class("a")  # declared, but no module registered it


@pytest.mark.parametrize("args,err", [
    ((8, 4, 16, torch.bfloat16, 2), None),
    ((0, 4, 16, torch.float16, 2), "max_tokens must be an int ≥ 1, got 0"),
    ((True, 4, 16, torch.float16, 2), "max_tokens must be an int ≥ 1, got True"),
    ((8, 4.0, 16, torch.float16, 2), "num_heads must be an int ≥ 1, got 4.0"),
    ((8, 4, None, torch.float16, 2), "head_dim must be an int ≥ 1, got None"),
    ((8, 4, 16, torch.int8, 2), "dtype must be fp16/bf16/fp32, got torch.int8"),
    ((8, 6, 16, torch.float32, 4), "num_heads=6 is not divisible by world size W=4"),
])
def test_geometry_error(args, err):
    assert geometry_error(*args) == err


def test_token_bucket():
    assert [token_bucket(t) for t in (1, 15, 16, 17, 64, 100)] == [16, 16, 16, 32, 64, 128]


class _Obj:
    def __init__(self, max_tokens):
        self.max_tokens, self._closed = max_tokens, False

    def close(self):
        self._closed = True


def test_object_cache_builds_once_per_bucket_finds_warm_shapes_and_releases():
    cache = ObjectCache(size=2)
    built = []

    agreed = []

    def build(max_tokens, skip):
        built.append(max_tokens)
        agreed.append(skip)
        return _Obj(max_tokens)

    def capture_error():
        return AssertionError("not capturing")

    a = cache.cached(None, 5, ("H", 8), build, capture_error, agreed=True)
    b = cache.cached(None, 16, ("H", 8), build, capture_error, agreed=True)
    c = cache.cached(None, 17, ("H", 8), build, capture_error)
    assert built == [16, 32] and a.get() is b.get() and c.get().max_tokens == 32
    assert cache.warm(None, 3, ("H", 8)) and cache.warm(None, 0, ("other",))
    assert cache.warm(None, tracing.ANY, (tracing.ANY, 8))
    assert not cache.warm(None, 33, ("H", 8)) and not cache.warm(None, 3, ("H", 4))
    first = a.get()
    c.get()  # bucket 32 used last: a third bucket evicts bucket 16, the least recently used
    cache.cached(None, 40, ("H", 8), build, capture_error)
    assert built == [16, 32, 64] and first._closed
    assert a.get() is not first and built == [16, 32, 64, 16]  # built again on first use
    # only a build at once, for a call whose check agreed just now, skips the agree
    assert agreed == [True, False, False, False]
    objs = list(cache.store["world"].values())
    cache.release("world")
    assert "world" not in cache.store and all(o._closed for o in objs)


def _construction_agrees(rank, world):
    """The ``agree`` calls of the objects the first functional call builds (its own check is
    ``validate_args``'), by validation mode: first sight (the call agreed: none) and off."""
    import attncomm
    from attncomm import dcp
    from attncomm.dcp import exchange

    gen = torch.Generator().manual_seed(7 + rank)
    out, lse = torch.randn(3, 2 * world, 8, generator=gen), torch.randn(3, 2 * world,
                                                                          generator=gen)
    q = torch.randn(3, 2, 8, generator=gen)
    calls: list = []
    real = exchange.agree

    def counted(group, op, *args, **kw):
        calls.append(op)
        return real(group, op, *args, **kw)

    exchange.agree = counted
    res = {}
    try:
        for name, call in (("merge", lambda v: dcp.merge(out, lse, validate=v)),
                           ("gather", lambda v: dcp.gather_heads(q, validate=v))):
            for validate in (None, False):
                attncomm.release()
                calls.clear()
                call(validate)
                res[(name, validate)] = list(calls)
    finally:
        exchange.agree = real
        attncomm.release()
    return res


def test_first_functional_call_agrees_its_arguments_once(pools):
    for res in pools.run(2, _construction_agrees):
        assert res[("merge", None)] == [] and res[("gather", None)] == []
        assert res[("merge", False)] == ["DcpMerger"]
        assert res[("gather", False)] == ["DcpQueryGather"]
