"""Host block allocator (free list + reference counts) and the block-first host KV pool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from superinfer_sgl.duplexkv.host_pool import BlockAllocator, HostKVPool, HostPinError, HostPoolFull


def snapshot(a: BlockAllocator) -> tuple[int, list[int]]:
    return a.num_free, [a.refcount(b) for b in range(a.num_blocks)]


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/incref/decref sequences against a plain dict model of the reference counts."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(12)
        self.model: dict[int, int] = {}

    @rule(n=st.integers(0, 14))
    def alloc_blocks(self, n: int) -> None:
        if n > 12 - len(self.model):
            before = snapshot(self.alloc)
            with pytest.raises(HostPoolFull):
                self.alloc.alloc(n)
            assert snapshot(self.alloc) == before
            return
        ids = self.alloc.alloc(n)
        assert len(set(ids)) == n and not set(ids) & set(self.model)
        self.model.update({b: 1 for b in ids})

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def incref(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4))
        self.alloc.incref(ids)
        for b in ids:
            self.model[b] += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def decref(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(sorted(self.model)))
        self.alloc.decref([b])
        self.model[b] -= 1
        if self.model[b] == 0:
            del self.model[b]

    @rule(b=st.integers(0, 11))
    def free_of_unused_block_raises(self, b: int) -> None:
        if b in self.model:
            return
        before = snapshot(self.alloc)
        with pytest.raises(ValueError):
            self.alloc.decref([b])
        assert snapshot(self.alloc) == before

    @invariant()
    def matches_model(self) -> None:
        self.alloc.check_invariants()
        assert self.alloc.num_used == len(self.model)
        assert self.alloc.num_free == 12 - len(self.model)
        for b in range(12):
            assert self.alloc.refcount(b) == self.model.get(b, 0)


TestAllocatorStateful = AllocatorMachine.TestCase
TestAllocatorStateful.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_alloc_returns_lowest_ids_first_so_runs_are_contiguous():
    a = BlockAllocator(8)
    assert a.alloc(3) == [0, 1, 2]
    a.free([1])
    assert a.alloc(2) == [1, 3]


def test_full_pool_allocates_nothing():
    a = BlockAllocator(4)
    a.alloc(3)
    with pytest.raises(HostPoolFull):
        a.alloc(2)
    assert a.num_free == 1 and a.num_used == 3
    a.check_invariants()


def test_block_returns_to_free_list_only_at_refcount_zero():
    a = BlockAllocator(2)
    (b,) = a.alloc(1)
    a.incref([b])
    a.decref([b])
    assert a.num_free == 1 and a.refcount(b) == 1
    a.decref([b])
    assert a.num_free == 2 and a.refcount(b) == 0


def test_double_free_raises_and_changes_nothing():
    a = BlockAllocator(3)
    ids = a.alloc(2)
    a.free(ids)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(ids[:1])
    x, y = a.alloc(2)
    with pytest.raises(ValueError, match="double free"):
        a.free([x, y, y])  # y has one reference, freed twice in one call
    assert a.refcount(x) == 1 and a.refcount(y) == 1
    a.check_invariants()


def test_bad_ids_raise():
    a = BlockAllocator(2)
    with pytest.raises(ValueError):
        a.incref([5])
    with pytest.raises(ValueError):
        a.incref([0])  # not allocated
    with pytest.raises(ValueError):
        a.alloc(-1)


def test_host_pool_layout_and_sizes():
    pool = HostKVPool(num_blocks=5, layers=3, kv_heads=2, head_dim=8, block_tokens=4, dtype=torch.bfloat16, pin=False)
    assert pool.data.shape == (5, 3, 2, 4, 2, 8) and pool.data.is_contiguous()
    assert pool.bytes_per_token == 3 * 2 * 2 * 8 * 2
    assert pool.bytes_per_block == 4 * pool.bytes_per_token
    assert [pool.blocks_for_tokens(n) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert pool.allocator.num_free == 5 and not pool.pinned


def test_default_num_blocks():
    shape = dict(layers=30, kv_heads=3, head_dim=64, block_tokens=16, dtype=torch.bfloat16)
    block_bytes = 30 * 2 * 16 * 3 * 64 * 2
    assert HostKVPool.default_num_blocks(**shape, gb=1) == 2**30 // block_bytes
    assert HostKVPool.default_num_blocks(**shape, free_ram_fraction=0.01) >= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_pinning_without_cuda_is_a_clear_error():
    with pytest.raises(HostPinError, match="CUDA is not available"):
        HostKVPool(2, 1, 1, 8, 4, torch.float16, pin=True)
    assert not HostKVPool(2, 1, 1, 8, 4, torch.float16).pinned  # auto: no CUDA, no pinning


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_pins_with_cuda():
    pool = HostKVPool(2, 1, 1, 8, 4, torch.float16)
    assert pool.pinned and pool.data.is_pinned()
