"""Where a Breakout PPO iteration's learner time goes on the CPU: the Nature CNN (``msrl.rl.NatureCNN``) forward and
backward for one iteration's 16 minibatches of 256 frames (8 envs x 128 steps, 4 epochs x 4 minibatches; PPO's loss
terms left out, the network is the cost), as one jitted loop, timed and traced with ``jax.profiler``.

    python benchmarks/nature_cnn_profile.py [--conv slices|space_to_depth|native] [--top 12]

``--conv`` swaps msrl's convolution (a matrix product of the concatenated image patches, ``msrl.rl.conv_valid``)
to compare: ``space_to_depth`` first folds each stride's s x s pixel blocks into channels, so the patches are
(k/s)^2 slices (4 instead of 64 for the first layer); ``native`` is XLA's own (``lax.conv_general_dilated``).
Prints JSON: the loop's median seconds, its GFLOP/s (~49.4 MFLOP per frame and update: forward and backward, no
input gradient for the first layer), the traced seconds of its matrix products and of everything else (slicing,
concatenating, padding, elementwise), the XLA operations that took most of it, and the load average.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import tempfile
import time

# per-operation events in the trace (read when JAX starts its CPU backend)
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_enable_xprof_traceme=true".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import msrl.rl as rl  # noqa: E402

FLOP_PER_FRAME = 49.4e6  # conv1 2 x 6.55M (no input gradient), conv2/conv3/dense 3 x (5.3M + 3.6M + 3.2M)
SLICES = rl.conv_valid


def space_to_depth_conv(x, kernel, stride):
    """``conv_valid`` with each s x s block of pixels as channels: a stride-1 convolution of kernel k/s."""
    n, h, w, c = x.shape
    k, out, s = kernel.shape[0], kernel.shape[-1], stride
    x = x[:, :h // s * s, :w // s * s].reshape(n, h // s, s, w // s, s, c).transpose(0, 1, 3, 2, 4, 5)
    x = x.reshape(n, h // s, w // s, s * s * c)
    kernel = kernel.reshape(k // s, s, k // s, s, c, out).transpose(0, 2, 1, 3, 4, 5).reshape(k // s, k // s, -1, out)
    return SLICES(x, kernel, 1)


def main() -> None:
    from msrl.bench import count

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conv", choices=["slices", "space_to_depth", "native"], default="slices")
    ap.add_argument("--repeats", type=count, default=3)
    ap.add_argument("--top", type=count, default=12)
    args = ap.parse_args()
    if args.conv == "space_to_depth":
        rl.conv_valid = space_to_depth_conv
    if args.conv == "native":
        rl.conv_valid = lambda x, kernel, stride: jax.lax.conv_general_dilated(
            x, kernel, (stride, stride), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    load_before = os.getloadavg()[0]
    net = rl.NatureCNN(action_dim=4, discrete=True)
    frames = jnp.asarray(np.random.RandomState(0).randint(0, 256, (1024, 4, 84, 84)), jnp.uint8)
    params = net.init(jax.random.PRNGKey(0), frames[:1])

    def loss(p, obs):
        logits, value = net.apply(p, obs)
        return (jax.nn.log_softmax(logits)[:, 0] + value ** 2).mean()

    @jax.jit
    def iteration(p, frames):
        def update(i, p):
            grads = jax.grad(loss)(p, jax.lax.dynamic_slice_in_dim(frames, (i % 4) * 256, 256))
            return jax.tree.map(lambda w, g: w - 1e-4 * g, p, grads)
        return jax.lax.fori_loop(0, 16, update, p)

    iteration = iteration.lower(params, frames).compile()  # once: timed, traced, and its HLO read
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(iteration(params, frames))
        seconds.append(time.perf_counter() - start)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(iteration(params, frames))
        xspace = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
        ops = collections.Counter()
        for plane in jax.profiler.ProfileData.from_file(xspace).planes:
            for line in plane.lines:
                for event in line.events:
                    if not event.name.startswith(("ThunkExecutor", "while", "$", "Slinky", "end: ")):
                        ops[event.name] += event.duration_ns / 1e9
    hlo = iteration.as_text()

    def shape(op: str) -> str:
        for line in hlo.splitlines():
            if line.strip().startswith(f"%{op} = "):
                return line.split("=", 1)[1].split("(", 1)[0].strip()
        return ""

    median = statistics.median(seconds)
    products = sum(s for op, s in ops.items() if op.startswith(("ynn_fusion", "xnn_fusion", "dot", "onednn")))
    print(json.dumps({
        "benchmark": "nature_cnn_profile", "conv": args.conv, "minibatches": 16, "batch": 256,
        "seconds_per_iteration": round(median, 3), "gflops": round(16 * 256 * FLOP_PER_FRAME / median / 1e9, 1),
        "traced_matrix_products_s": round(products, 3), "traced_other_s": round(sum(ops.values()) - products, 3),
        "top_ops_seconds": [f"{s:.3f} {op}: {shape(op)}" for op, s in ops.most_common(args.top)],
        "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2),
    }, indent=2))


if __name__ == "__main__":
    main()
