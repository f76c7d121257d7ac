"""`frozen_heap`: MindSpore's full `gc.collect()` before each graph compile skips the objects that
were alive before the block, and still frees the garbage made inside it."""

import gc
import weakref

import mindspore as ms
import numpy as np

from vllm_mindspore.heap import frozen_heap


class Cycle:
    """An object only the garbage collector frees (it refers to itself)."""

    def __init__(self):
        self.me = self


class Double(ms.nn.Cell):
    def construct(self, x):
        return x * 2


def full_collections_during(block) -> list[int]:
    """The freeze count at the start of each full collection while block() runs."""
    counts = []

    def record(phase, info):
        if phase == "start" and info["generation"] == 2:
            counts.append(gc.get_freeze_count())

    gc.callbacks.append(record)
    try:
        block()
    finally:
        gc.callbacks.remove(record)
    return counts


def unfrozen(test):
    """Runs test on an unfrozen heap, as a worker's is before vLLM freezes it."""

    def run():
        frozen = gc.get_freeze_count() > 0
        gc.unfreeze()
        try:
            test()
        finally:
            gc.unfreeze()
            if frozen:
                gc.freeze()

    return run


@unfrozen
def test_a_compile_inside_scans_only_new_objects():
    alive = [[i] for i in range(100_000)]
    dead = []

    def compile_inside():
        with frozen_heap():
            garbage = Cycle()
            dead.append(weakref.ref(garbage))
            del garbage
            Double().compile(ms.Tensor(np.ones(3, np.float32)))
            assert dead[0]() is None, "the compile's collection left the block's garbage"

    counts = full_collections_during(compile_inside)
    # The first is frozen_heap's own collection before it freezes; MindSpore's follow.
    assert len(counts) >= 2 and counts[0] == 0, counts
    assert min(counts[1:]) >= len(alive), counts
    assert gc.get_freeze_count() == 0


@unfrozen
def test_a_compile_outside_scans_every_object():
    alive = [[i] for i in range(1000)]
    counts = full_collections_during(lambda: Double().compile(ms.Tensor(np.ones(3, np.float32))))
    assert counts and max(counts) == 0 and alive, counts


@unfrozen
def test_a_heap_frozen_before_stays_frozen():
    gc.freeze()
    assert gc.get_freeze_count() > 0
    with frozen_heap():
        Double().compile(ms.Tensor(np.ones(3, np.float32)))
    assert gc.get_freeze_count() > 0, "frozen_heap unfroze a heap it had not frozen"
