"""Memory and time of per-(layer, microbatch) graphs under an interleaved 1F1B pipeline
order, with and without ``reuse_graph_input_output_buffers`` (issue "pipeline"), beside
Transformer Engine's ``make_graphed_callables`` with ``_order`` and
``_reuse_graph_input_output_buffers`` where TE is importable.

Run from the repository root on a CUDA machine::

    python benchmarks/bench_pipeline_memory.py
    python benchmarks/bench_pipeline_memory.py --microbatches 8 --pipeline-size 4 --out /tmp/pp.json

What it does, on one GPU, as pipeline rank ``--rank`` of ``--pipeline-size`` would see it:

1. Builds ``--chunks`` x ``--layers-per-chunk`` ``GPTBlock``s (default 2 x 4; h 1024, s 512,
   b 2, bf16, dropout 0 so graphed and eager training must agree bitwise) and an interleaved
   1F1B order for them (:func:`interleaved_1f1b_order`: warmup forwards, steady one-forward-
   one-backward, cooldown backwards, microbatches taken in groups of ``--pipeline-size``
   per chunk as Megatron does), checked for causality on one device.
2. Per variant (``eager`` reference, ``te_graph`` without reuse, ``te_graph`` with
   ``reuse_graph_input_output_buffers=True``, and TE's graphs without and with reuse,
   called with the same arguments under TE's private names), from a fresh allocator state:
   builds the blocks, makes one sample input per (chunk, microbatch, layer), calls
   ``te_graph.make_graphed_callables(blocks, sample_args, order=..., num_layers_per_chunk=...,
   reuse_graph_input_output_buffers=..., pool=pool)``, drops its own references to the
   sample args (with reuse, the library may hand their memory on) and reports

   * static buffers: ``memory_allocated`` after capture minus before the sample args were
     made (sample inputs + outputs + grad buffers + parameter grad buffers), and the same
     without the parameter grad buffers;
   * the graph pool's reserved and allocated bytes (``torch.cuda.memory_snapshot`` segments
     whose ``segment_pool_id`` is the pool handle passed in), when the snapshot has them;
   * peak allocated and peak reserved memory of build + capture;
   * one training iteration run through the order, after ``gc.collect(); empty_cache();
     reset_peak_memory_stats()``: its peak allocated memory and its footprint, the peak
     *reserved* memory (``max_memory_allocated`` does not count graph-pool memory that
     capture freed but replay still writes, so it flatters graphs); then the median wall
     time of ``--iters`` more iterations.
3. The iteration feeds chunk ``c+1`` a copy of chunk ``c``'s output (the p2p receive) and
   chunk ``c`` the input grad of chunk ``c+1`` (the p2p send of the backward); the last chunk
   backprops ``out.float().square().mean()``. Parameter grads of the graphed variants are
   compared with the eager ones (``torch.equal``, and the largest difference).

A variant that raises (e.g. reuse not implemented) prints its error and the run goes on.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
from _measure import MIB, FirstOutput, environment, free_memory  # noqa: E402
from _report import record_failure  # noqa: E402

import rng  # noqa: E402
import te_graph  # noqa: E402
from examples.gpt import GPTBlock  # noqa: E402
from te_graph.schedule import plan_schedule  # noqa: E402

SEED = 1234


# --------------------------------------------------------------------------- the order


def interleaved_1f1b_order(num_chunks: int, num_microbatches: int, pipeline_size: int,
                           rank: int = 0) -> list[int]:
    """Megatron's interleaved 1F1B schedule as seen by one pipeline rank, in TE's ``_order``
    form: ``+c`` = forward of chunk ``c`` (1-based) for its next microbatch, ``-c`` = backward.

    Forwards visit chunks in groups of ``pipeline_size`` microbatches (chunk 1 mb 0..P-1,
    chunk 2 mb 0..P-1, ..., chunk 1 mb P..2P-1, ...); backwards the same, chunks last to
    first. Warmup = ``(P - rank - 1) * 2 + (C - 1) * P`` forwards (all of them if fewer),
    then one forward and one backward at a time, then the remaining backwards.
    """
    if num_chunks < 1 or num_microbatches < 1 or pipeline_size < 1:
        raise ValueError("chunks, microbatches and pipeline size must be >= 1")
    if not 0 <= rank < pipeline_size:
        raise ValueError(f"rank {rank} is not in 0..{pipeline_size - 1}")
    if num_chunks > 1 and num_microbatches % pipeline_size:
        raise ValueError(
            f"an interleaved schedule needs microbatches ({num_microbatches}) divisible by "
            f"the pipeline size ({pipeline_size})")
    total = num_chunks * num_microbatches

    def chunk_id(k: int, forward: bool) -> int:
        group = (k // pipeline_size) % num_chunks
        return group + 1 if forward else -(num_chunks - group)

    if num_chunks == 1:
        warmup = min(pipeline_size - rank - 1, total)
    else:
        warmup = min((pipeline_size - rank - 1) * 2 + (num_chunks - 1) * pipeline_size, total)
    order = [chunk_id(k, True) for k in range(warmup)]
    forwards, backwards = warmup, 0
    while forwards < total:
        order.append(chunk_id(forwards, True))
        forwards += 1
        order.append(chunk_id(backwards, False))
        backwards += 1
    order.extend(chunk_id(k, False) for k in range(backwards, total))
    check_runnable_on_one_device(order, num_chunks)
    return order


def check_runnable_on_one_device(order: list[int], num_chunks: int) -> None:
    """Each chunk's forward of microbatch m needs chunk c-1's forward of m; each backward
    needs its own forward and chunk c+1's backward of m (the data that crosses ranks)."""
    fwd_done = [0] * (num_chunks + 2)
    bwd_done = [0] * (num_chunks + 2)
    bwd_done[num_chunks + 1] = 1 << 30  # nothing after the last chunk
    fwd_done[0] = 1 << 30  # nothing before the first chunk
    for position, c in enumerate(order):
        chunk = abs(c)
        if c > 0:
            mb = fwd_done[chunk]
            if fwd_done[chunk - 1] <= mb:
                raise ValueError(f"order[{position}]: forward of chunk {chunk} mb {mb} before "
                                 f"chunk {chunk - 1}'s forward of it")
            fwd_done[chunk] += 1
        else:
            mb = bwd_done[chunk]
            if fwd_done[chunk] <= mb or bwd_done[chunk + 1] <= mb:
                raise ValueError(f"order[{position}]: backward of chunk {chunk} mb {mb} before "
                                 f"its forward or chunk {chunk + 1}'s backward of it")
            bwd_done[chunk] += 1


# --------------------------------------------------------------------------- running


def build_blocks(args):
    rng.model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)
    return [
        GPTBlock(args.hidden, args.hidden // 64, 0.0, device="cuda", dtype=torch.bfloat16)
        for _ in range(args.chunks * args.layers_per_chunk)
    ]


def make_inputs(args):
    gen = torch.Generator(device="cuda").manual_seed(SEED + 1)
    return [
        torch.randn(args.seq, args.batch, args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(args.microbatches)
    ]


def run_iteration(layer_fn, order, inputs, num_chunks, num_microbatches, layers_per_chunk):
    """One training iteration through ``order``; ``layer_fn(chunk, mb, layer)`` -> callable.

    Returns the last chunk's losses per microbatch."""
    next_fwd = [0] * num_chunks
    next_bwd = [0] * num_chunks
    chunk_inputs, chunk_outputs, input_grads, losses = {}, {}, {}, {}
    for c in order:
        chunk = abs(c) - 1
        if c > 0:
            mb = next_fwd[chunk]
            next_fwd[chunk] += 1
            if chunk == 0:
                x = inputs[mb].detach().requires_grad_(True)
            else:  # the p2p receive: a new buffer holding the previous chunk's output
                x = chunk_outputs[chunk - 1, mb].detach().clone().requires_grad_(True)
            h = x
            for layer in range(layers_per_chunk):
                h, _ = layer_fn(chunk, mb, layer)(h)
            chunk_inputs[chunk, mb] = x
            chunk_outputs[chunk, mb] = h
        else:
            mb = next_bwd[chunk]
            next_bwd[chunk] += 1
            out = chunk_outputs.pop((chunk, mb))
            x = chunk_inputs.pop((chunk, mb))
            if chunk == num_chunks - 1:
                loss = out.float().square().mean()
                losses[mb] = loss.detach()
                loss.backward()
            else:
                torch.autograd.backward(out, input_grads.pop((chunk + 1, mb)))
            if chunk > 0:
                input_grads[chunk, mb] = x.grad
    assert not chunk_outputs and not input_grads, "order left work undone"
    return [losses[mb].item() for mb in sorted(losses)]


def pool_bytes(pool):
    """(reserved, allocated) bytes of the segments of graph pool ``pool``, or (None, None)."""
    try:
        segments = torch.cuda.memory_snapshot()
    except Exception:  # noqa: BLE001
        return None, None
    if not segments or "segment_pool_id" not in segments[0]:
        return None, None
    want = tuple(pool)
    mine = [s for s in segments if tuple(s["segment_pool_id"]) == want]
    return sum(s["total_size"] for s in mine), sum(s["allocated_size"] for s in mine)


def prime_capture_stream():
    """Graph a tiny linear once, so the process-wide capture stream's cuBLAS workspaces
    (tens of MiB, paid once per process) exist before any row is measured and no row is
    charged for them."""
    lin = torch.nn.Linear(64, 64, device="cuda", dtype=torch.bfloat16)
    sample = (torch.randn(8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True),)
    te_graph.make_graphed_callables(lin, sample)(sample[0]).sum().backward()
    del lin, sample
    _free()


def _free():
    # Keep the cuBLAS workspaces: prime_capture_stream made them so that no row pays them.
    free_memory(clear_cublas_workspaces=False)


def _te_make_graphed(blocks, sample_args, order, layers_per_chunk, reuse, pool):
    """Transformer Engine's make_graphed_callables with its private pipeline arguments, on
    the same blocks (tensor-only outputs), called as the GPTBlocks are: ``(h, None)``."""
    from transformer_engine.pytorch import make_graphed_callables as te_make_graphed_callables

    graphed = te_make_graphed_callables(
        tuple(FirstOutput(b) for b in blocks), sample_args, _order=order,
        _num_layers_per_chunk=layers_per_chunk, _reuse_graph_input_output_buffers=reuse, pool=pool)
    return [lambda h, g=g: (g(h), None) for g in graphed]


def run_variant(name, reuse, args, order, inputs):
    C, M, L = args.chunks, args.microbatches, args.layers_per_chunk
    result = {"variant": name}
    _free()
    torch.cuda.reset_peak_memory_stats()
    try:
        blocks = build_blocks(args)
        params = [p for b in blocks for p in b.parameters()]
        if name == "eager":
            def layer_fn(chunk, mb, layer):
                return blocks[chunk * L + layer]
        else:
            before = torch.cuda.memory_allocated()
            sample_args = [
                (torch.randn(args.seq, args.batch, args.hidden, device="cuda",
                             dtype=torch.bfloat16, requires_grad=True),)
                for _ in range(C * M * L)
            ]
            sample_bytes = sum(a[0].numel() * a[0].element_size() for a in sample_args)
            pool = te_graph.graph_pool_handle()
            if name.startswith("TE"):
                graphed = _te_make_graphed(blocks, tuple(sample_args), order, L, reuse, pool)
            else:
                graphed = te_graph.make_graphed_callables(
                    tuple(blocks), tuple(sample_args), order=order, num_layers_per_chunk=L,
                    reuse_graph_input_output_buffers=reuse, pool=pool)
            del sample_args  # with reuse the library may hand their memory to other graphs
            gc.collect()
            torch.cuda.synchronize()
            delta = torch.cuda.memory_allocated() - before
            param_grad_bytes = sum(p.numel() * p.element_size() for p in params)
            reserved, allocated = pool_bytes(pool)
            result.update(
                graphs=len(graphed),
                sample_args_mib=sample_bytes / MIB,
                static_mib=delta / MIB,
                static_without_param_grads_mib=(delta - param_grad_bytes) / MIB,
                param_grad_mib=param_grad_bytes / MIB,
                pool_reserved_mib=None if reserved is None else reserved / MIB,
                pool_allocated_mib=None if allocated is None else allocated / MIB,
                capture_peak_mib=torch.cuda.max_memory_allocated() / MIB,
                capture_peak_reserved_mib=torch.cuda.max_memory_reserved() / MIB,
            )

            def layer_fn(chunk, mb, layer):
                return graphed[chunk * M * L + mb * L + layer]

        _free()
        torch.cuda.reset_peak_memory_stats()
        losses = run_iteration(layer_fn, order, inputs, C, M, L)
        torch.cuda.synchronize()
        result["losses"] = losses
        result["peak_mib"] = torch.cuda.max_memory_allocated() / MIB
        result["footprint_mib"] = torch.cuda.max_memory_reserved() / MIB
        grads = [p.grad for p in params]
        if any(g is None for g in grads):
            result["error"] = "some parameter has no grad after the iteration"
        result["grads"] = [None if g is None else g.detach().cpu() for g in grads]
        result["iteration_ms"] = _median_iteration_ms(
            lambda: run_iteration(layer_fn, order, inputs, C, M, L), args.iters)
        del grads, layer_fn, blocks, params
    except Exception as error:  # noqa: BLE001 - report and go on
        record_failure(result, error, args.traceback)
    with contextlib.suppress(NameError):
        del graphed
    _free()
    return result


def _median_iteration_ms(iteration, iters):
    """Median wall time of ``iters`` more iterations (grads keep accumulating; only the
    first iteration's are compared). Each is synchronised: a sync point per iteration."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        iteration()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times) if times else None


def compare(reference, result):
    if reference.get("grads") is None or result.get("grads") is None:
        return "n/a"
    pairs = list(zip(reference["grads"], result["grads"]))
    if any(a is None or b is None for a, b in pairs):
        return "n/a (missing grads)"
    equal = all(torch.equal(a, b) for a, b in pairs)
    worst = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
    losses = "losses equal" if reference.get("losses") == result.get("losses") else "losses DIFFER"
    return f"{'bitwise equal' if equal else 'DIFFER'} (max |diff| {worst:.3g}), {losses}"


def _fmt(value, spec="10.1f"):
    return f"{'-':>{spec.split('.')[0]}}" if value is None else format(value, spec)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Static-buffer and peak memory of te_graph per-(layer, microbatch) graphs "
                    "under an interleaved 1F1B order, with and without "
                    "reuse_graph_input_output_buffers; runs one training iteration each.")
    parser.add_argument("--chunks", type=int, default=2, help="model chunks (default 2)")
    parser.add_argument("--layers-per-chunk", type=int, default=4, help="layers per chunk (default 4)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches (default 8)")
    parser.add_argument("--pipeline-size", type=int, default=4,
                        help="pipeline ranks the schedule is made for (default 4; must divide "
                             "--microbatches when --chunks > 1)")
    parser.add_argument("--rank", type=int, default=0, help="pipeline rank whose order is used (default 0)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20,
                        help="timed iterations after the measured one (median ms; default 20)")
    parser.add_argument("--no-te", action="store_true",
                        help="leave out Transformer Engine's make_graphed_callables rows")
    parser.add_argument("--out", default=None, help="optional JSON path for the raw numbers")
    parser.add_argument("--traceback", action="store_true", help="print full tracebacks of failing variants")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        order = interleaved_1f1b_order(args.chunks, args.microbatches, args.pipeline_size, args.rank)
        schedule = plan_schedule(args.chunks * args.layers_per_chunk,
                                 args.chunks * args.microbatches * args.layers_per_chunk,
                                 order, args.layers_per_chunk)
    except ValueError as error:
        sys.exit(f"bench_pipeline_memory.py: {error}")
    print(f"order ({len(order)} entries, {schedule.num_graphs} graphs): {order}")
    if not torch.cuda.is_available():
        sys.exit("bench_pipeline_memory.py: CUDA is not available; this benchmark needs a CUDA GPU.")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {args.chunks} chunks x "
          f"{args.layers_per_chunk} layers x {args.microbatches} microbatches of GPTBlock "
          f"(h {args.hidden}, s {args.seq}, b {args.batch}, bf16, dropout 0), pipeline size "
          f"{args.pipeline_size}, rank {args.rank}")
    inputs = make_inputs(args)
    variants = [("eager", False), ("te_graph", False), ("te_graph+reuse", True)]
    if not args.no_te and importlib.util.find_spec("transformer_engine") is not None:
        variants += [("TE graphs", False), ("TE graphs+reuse", True)]
    prime_capture_stream()
    results = {name: run_variant(name, reuse, args, order, inputs) for name, reuse in variants}

    header = (f"{'variant':<16} {'static MiB':>10} {'w/o pgrad':>10} {'pool res':>10} "
              f"{'pool alloc':>10} {'capt peak':>10} {'capt res':>10} {'iter peak':>10} "
              f"{'footprint':>10} {'iter ms':>8}  vs eager grads")
    print()
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        if "error" in r and "peak_mib" not in r:
            print(f"{name:<16} ERROR: {r['error'].replace(chr(10), ' ')[:200]}")
            continue
        check = "reference" if name == "eager" else compare(results["eager"], r)
        print(f"{name:<16} {_fmt(r.get('static_mib'))} {_fmt(r.get('static_without_param_grads_mib'))} "
              f"{_fmt(r.get('pool_reserved_mib'))} {_fmt(r.get('pool_allocated_mib'))} "
              f"{_fmt(r.get('capture_peak_mib'))} {_fmt(r.get('capture_peak_reserved_mib'))} "
              f"{_fmt(r.get('peak_mib'))} {_fmt(r.get('footprint_mib'))} "
              f"{_fmt(r.get('iteration_ms'), '8.2f')}  {check}")
        if "error" in r:
            print(f"{'':<16} ERROR: {r['error']}")
    print("static = memory_allocated after capture (sample args dropped) - before the sample "
          "args; w/o pgrad = minus parameter grad buffers; pool = graph pool segments; capt "
          "peak/res = peak allocated/reserved of build + capture; iter peak = peak allocated "
          "of the iteration; footprint = its peak reserved (after empty_cache); iter ms = "
          "median wall time of --iters more iterations.")
    plain, reused = results["te_graph"], results["te_graph+reuse"]
    if plain.get("static_mib") is not None and reused.get("static_mib") is not None:
        saved = plain["static_mib"] - reused["static_mib"]
        print(f"reuse saves {saved:.1f} MiB of static buffers "
              f"({reused['static_mib']:.1f} vs {plain['static_mib']:.1f} MiB), peak "
              f"{reused.get('peak_mib', float('nan')):.1f} vs {plain.get('peak_mib', float('nan')):.1f} MiB")
        if abs(saved) < 1.0:
            print("NOTE: reuse_graph_input_output_buffers=True changed nothing measurable: the "
                  "option looks accepted but not implemented.")
    if args.out:
        payload = {
            **environment(), "args": vars(args), "order": order,
            "variants": {n: {k: v for k, v in r.items() if k != "grads"} for n, r in results.items()},
        }
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"raw numbers written to {args.out}")


if __name__ == "__main__":
    main()
