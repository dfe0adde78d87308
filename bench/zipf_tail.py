#!/usr/bin/env python3
"""What a shared-prefix run's TTFT tail is made of, and how much placement could change it.

usage: bench/zipf_tail.py [--blocks N] [--block-size B] [--search ITERS] TRACE.jsonl[.gz]…

Reads the per-request traces of `loadgen compare --trace-dir` (or `bench/compare_repeat.py
--traces`), one line per request with its group, backend, TTFT and prompt/cached tokens, and
prints for each:

* TTFT p50/p90 and the requests in the p90 tail by kind: a *full miss* (more than half the
  prompt computed: the group's shared prefix was not cached where the request went), a
  *partial* hit (prefix cached, more than a block of the rest computed), a *hit*;
* the full misses split into the group's first request anywhere (no placement avoids those),
  a group coming back to a backend that had held it (its prefix evicted there), and a group
  sent to a backend new to it;
* per backend: requests, groups held and evictions;
* `--search ITERS`: a replay of the run's requests through an LRU model of each backend's
  cache (`--blocks` per backend, `--block-size` tokens; each request touches its group's
  prefix and its own blocks, a prefix's tail evicted before its head as vLLM frees them),
  first with the run's own placement, then with the best fixed group-to-backend assignment a
  random local search finds in ITERS steps with hindsight, under the run's own busiest share
  of requests. The model counts full misses; the gap between the two is what any placement
  that keeps that balance could gain on this run, and the TTFT p90 the run would have had
  with that many fewer evictions (every k-th eviction given the median partial hit's TTFT)
  says what that gain is worth.
"""
import collections
import gzip
import json
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lru_oracle import replay_each  # noqa: E402  (bench/lru_oracle.py: the cache model)


def load(path):
    """The successful requests with a TTFT and both token counts, in send order, and how many
    lines were left out (errors, or no `usage` to classify them by)."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        lines = [json.loads(line) for line in f]
    rows = [
        r for r in lines
        if r.get("error") is None and r.get("ttft") is not None
        and r.get("prompt_tokens") is not None and r.get("cached_tokens") is not None
    ]
    rows.sort(key=lambda r: r["sent_at"])
    return rows, len(lines) - len(rows)


def kind(r):
    computed = r["prompt_tokens"] - r["cached_tokens"]
    if computed * 2 > r["prompt_tokens"]:
        return "full"
    return "partial" if computed > 16 else "hit"


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def replay(rows, place, backends, capacity, prefix_blocks, block_size):
    """Full misses when request i goes to backend place(i, row), through lru_oracle's model of
    vLLM's cache: each request's blocks are its group's prefix and then its own."""
    prompts = []
    for i, r in enumerate(rows):
        own = max(1, math.ceil((r["prompt_tokens"] - prefix_blocks * block_size) / block_size))
        chains = [(r["group"], k) for k in range(prefix_blocks)] + [("own", i, k) for k in range(own)]
        prompts.append((chains, len(chains), r["prompt_tokens"]))
    leading = replay_each(prompts, lambda i: place(i, rows[i]), capacity, backends)
    return sum(k * 2 < prefix_blocks for _, k in leading)


def p90_with_fewer(rows, evicted, k):
    """TTFT p90 had `k` of the `evicted` requests (indices into rows) been partial hits."""
    partial = [r["ttft"] for r in rows if kind(r) == "partial"]
    if k <= 0 or not evicted or not partial:
        return pct([r["ttft"] for r in rows], 0.9)
    instead = pct(partial, 0.5)
    step = len(evicted) / min(k, len(evicted))
    spared = {evicted[int(j * step)] for j in range(min(k, len(evicted)))}
    return pct([instead if i in spared else r["ttft"] for i, r in enumerate(rows)], 0.9)


def search(rows, names, capacity, block_size, iters, evicted):
    index = {n: i for i, n in enumerate(names)}
    nb = len(names)
    # The shared prefix: the most common cached length of partial hits, in whole blocks.
    partial = [r["cached_tokens"] for r in rows if kind(r) == "partial" and r["cached_tokens"]]
    prefix_tokens = collections.Counter(partial).most_common(1)[0][0] if partial else 0
    prefix_blocks = max(1, prefix_tokens // block_size)
    run = replay(rows, lambda i, r: index[r["backend"]], nb, capacity, prefix_blocks, block_size)
    per_group = collections.Counter(r["group"] for r in rows)
    groups = sorted(per_group, key=lambda g: -per_group[g])
    busiest = max(collections.Counter(r["backend"] for r in rows).values())

    def loads(a):
        out = [0] * nb
        for g in groups:
            out[a[g]] += per_group[g]
        return out

    def cost(a):
        if max(loads(a)) > busiest:
            return math.inf
        return replay(rows, lambda i, r: a[r["group"]], nb, capacity, prefix_blocks, block_size)

    # Start from the most balanced assignment (greedy by popularity).
    fill, best = [0] * nb, {}
    for g in groups:
        b = min(range(nb), key=lambda b: fill[b])
        best[g] = b
        fill[b] += per_group[g]
    start = best_cost = cost(best)
    rng = random.Random(1)
    for _ in range(iters):
        a = dict(best)
        g = rng.choice(groups)
        a[g] = rng.randrange(nb)
        if rng.random() < 0.5:
            h = rng.choice(groups)
            a[g], a[h] = a[h], a[g]
        c = cost(a)
        if c < best_cost:
            best, best_cost = a, c
    final = loads(best)
    print(f"  LRU model ({capacity} blocks of {block_size} per backend, prefix {prefix_blocks} "
          f"blocks): full misses with the run's placement {run}; fixed assignment, most "
          f"balanced {start}, best of {iters} search steps {best_cost} at requests per backend "
          f"{sorted(final, reverse=True)} (the run's busiest: {busiest})")
    gain = run - best_cost
    print(f"  TTFT p90 with {gain} fewer evictions: {p90_with_fewer(rows, evicted, gain):.3f} s")
    for b in sorted(range(nb), key=lambda b: -final[b]):
        mine = [per_group[g] for g in groups if best[g] == b]
        print(f"    best: backend {b}, {len(mine)} groups, requests each {mine}")


def main():
    argv = sys.argv[1:]
    capacity, block_size, iters = 1308, 16, 0
    while argv and argv[0].startswith("--"):
        if len(argv) < 2:
            sys.exit(__doc__)
        flag, value = argv[0], argv[1]
        argv = argv[2:]
        if flag == "--blocks":
            capacity = int(value)
        elif flag == "--block-size":
            block_size = int(value)
        elif flag == "--search":
            iters = int(value)
        else:
            sys.exit(__doc__)
    if not argv:
        sys.exit(__doc__)
    for path in argv:
        rows, dropped = load(path)
        if not rows:
            print(f"{path}: no successful request with a TTFT and cached tokens "
                  f"({dropped} lines; vLLM reports cached tokens with "
                  "--enable-prompt-tokens-details)")
            continue
        if dropped:
            print(f"{path}: {dropped} lines left out (failed, or no usage)")
        ttft = [r["ttft"] for r in rows]
        p90 = pct(ttft, 0.9)
        tail = [r for r in rows if r["ttft"] >= p90]
        print(f"{path}: {len(rows)} requests, TTFT p50 {pct(ttft, 0.5):.3f} s, p90 {p90:.3f} s")
        for name, subset in (("all", rows), ("p90 tail", tail)):
            c = collections.Counter(kind(r) for r in subset)
            print(f"  {name}: full misses {c['full']}, partial {c['partial']}, hits {c['hit']}")
        for k in ("full", "partial", "hit"):
            xs = [r["ttft"] for r in rows if kind(r) == k]
            if xs:
                print(f"  {k}: TTFT median {pct(xs, 0.5):.3f} s, p90 {pct(xs, 0.9):.3f} s")
        seen, held, why, evicted = set(), set(), collections.Counter(), []
        per_backend = collections.defaultdict(collections.Counter)
        for i, r in enumerate(rows):
            g, b = r["group"], r["backend"]
            per_backend[b]["requests"] += 1
            if kind(r) == "full":
                if g not in seen:
                    why["first request of its group"] += 1
                elif (g, b) in held:
                    why["evicted where it was held"] += 1
                    evicted.append(i)
                    per_backend[b]["evictions"] += 1
                else:
                    why["sent to a backend new to it"] += 1
            seen.add(g)
            held.add((g, b))
        print("  full misses: " + ", ".join(f"{k} {v}" for k, v in why.most_common()))
        groups = collections.Counter(b for _, b in held)
        for b in sorted(per_backend):
            c = per_backend[b]
            print(f"  {b}: {c['requests']} requests, {groups[b]} groups held, "
                  f"{c['evictions']} evictions")
        if iters:
            search(rows, sorted(per_backend), capacity, block_size, iters, evicted)


if __name__ == "__main__":
    main()
