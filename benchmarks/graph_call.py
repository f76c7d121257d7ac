"""MindSpore's own time in a graph call, warm and right after an operator has read a large buffer.

A batch-1 decode step spends ~0.42 ms of its ~2.8 ms in MindSpore's graph call around the
plugin's kernels (docs/benchmarks.md). This script shows where that comes from: a graph shaped like
the decode graph (an embedding Gather, one operator taking the layers' 6 + 112 inputs, the final
add, a norm and an LM head, the operators `ops.Custom` AOT functions of a small C++ library built
here), called as the runner calls it (`StaticGraphs`). The layers' operator does nothing, spins the
CPU, or reads a buffer of N MB (as the layers read their weights); the script prints a call's time
(with `asnumpy`) minus the operators' own, i.e. MindSpore's and the Python call's time.

    python benchmarks/graph_call.py [--calls 1000] [--repeats 3] [--read-mb 1 4 16 64]
"""

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SOURCE = r"""
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {
int mode = 0;         // 0: nothing, 1: spin `amount` us, 2: read `amount` bytes
int64_t amount = 0;
double own_us = 0;    // the operators' own time in the last call
float *buffer = nullptr;
volatile float sink = 0;
double now_us() {
  return std::chrono::duration<double, std::micro>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

extern "C" {
void Configure(int new_mode, int64_t new_amount) {
  mode = new_mode;
  amount = new_amount;
  std::free(buffer);
  buffer = nullptr;
  if (mode == 2) {
    buffer = static_cast<float *>(std::aligned_alloc(64, static_cast<size_t>(amount)));
    std::memset(buffer, 1, static_cast<size_t>(amount));
  }
}
double OwnMicros() { return own_us; }
int Nothing(int, void **, int *, int64_t **, const char **, void *, void *) { return 0; }
int Layers(int, void **, int *, int64_t **, const char **, void *, void *) {
  const double start = now_us();
  own_us = 0;
  if (mode == 1) {
    while (now_us() - start < amount) sink = sink + 1.0f;
  } else if (mode == 2) {
    float sum = 0;
    for (int64_t i = 0; i < amount / 4; i += 16) sum += buffer[i];  // a line at a time
    sink = sum;
  }
  own_us = now_us() - start;
  return 0;
}
}
"""


def build_library(directory: str) -> str:
    source, library = os.path.join(directory, "ops.cc"), os.path.join(directory, "libops.so")
    with open(source, "w") as f:
        f.write(SOURCE)
    subprocess.run([os.environ.get("CXX", "g++"), "-O2", "-shared", "-fPIC", "-o", library,
                    source], check=True)
    return library


def decode_like_graph(library: str, num_params: int):
    """(ids [1], five int32 step inputs) -> logits [1, 8000], as the decode graph's operators."""
    import mindspore as ms
    from mindspore import nn, ops

    def custom(function, out_shape, out_dtype=lambda x, *_: x):
        return ops.Custom(f"{library}:{function}", out_shape=out_shape, out_dtype=out_dtype,
                          func_type="aot")

    class DecodeLike(nn.Cell):
        def __init__(self):
            super().__init__()
            zeros = lambda *shape: ms.Tensor(np.zeros(shape, np.float32))  # noqa: E731
            self.weights = ms.ParameterTuple([ms.Parameter(zeros(64, 512), name=f"w{i}")
                                              for i in range(num_params)])
            self.embedding = ms.Parameter(zeros(8000, 512), name="embedding")
            self.norm_weight = ms.Parameter(zeros(512), name="norm")
            self.head_weight = ms.Parameter(zeros(8000, 512), name="head")
            self.layers = custom("Layers", lambda x, *_: (x, x), lambda x, *_: (x, x))
            self.norm = custom("Nothing", lambda x, *_: x)
            self.head = custom("Nothing", lambda x, *_: (x[0], 8000))

        def construct(self, ids, slots, block_tables, seq_lens, q_lens, positions):
            hidden = ops.gather(self.embedding, ids, 0)
            hidden, residual = self.layers(hidden, slots, block_tables, seq_lens, q_lens,
                                           positions, *self.weights)
            return self.head(self.norm(hidden + residual, self.norm_weight), self.head_weight)

    return DecodeLike()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--read-mb", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--params", type=int, default=112,
                        help="weights the layers' operator takes (8 layers x 14 in the decoder)")
    args = parser.parse_args()

    import mindspore as ms

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from model_backends.native.backend import StaticGraphs

    ms.set_context(mode=ms.GRAPH_MODE)
    with tempfile.TemporaryDirectory() as directory:
        library_path = build_library(directory)
        library = ctypes.CDLL(library_path)
        library.Configure.argtypes = [ctypes.c_int, ctypes.c_int64]
        library.OwnMicros.restype = ctypes.c_double
        graph = StaticGraphs(decode_like_graph(library_path, args.params))
        step = (np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros((1, 64), np.int32),
                np.ones(1, np.int32), np.ones(1, np.int32), np.zeros(1, np.int32))
        inputs = tuple(ms.Tensor(a) for a in step)
        graph.compile(*inputs)
        settings = [("nothing", 0, 0), ("spins 400 us", 1, 400)] + [
            (f"reads {mb} MB", 2, mb << 20) for mb in args.read_mb]
        print(f"A decode-like graph ({args.params} weights into the layers' operator), "
              f"{args.calls} calls a repeat; us a call outside the operators (median of each "
              "repeat):")
        for name, mode, amount in settings:
            library.Configure(mode, amount)
            medians = []
            for _ in range(args.repeats):
                outside = []
                for _ in range(args.calls):
                    start = time.perf_counter()
                    graph(*inputs).asnumpy()
                    outside.append((time.perf_counter() - start) * 1e6 - library.OwnMicros())
                medians.append(statistics.median(outside))
            print(f"  the layers' operator {name:>14}: "
                  + " ".join(f"{m:6.0f}" for m in medians), flush=True)
        library.Configure(0, 0)


if __name__ == "__main__":
    main()
