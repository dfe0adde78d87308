#!/usr/bin/env python3
"""What placement alone could do on a recorded workload: every assignment of its prefix groups
to two servers (each group on one server, no copies), each server's prefix cache an LRU of
BLOCKS blocks of 128 tokens, requests served one after another in the order sent. For each
share of the prompt tokens on the busiest server, the best hit rate any assignment reaches,
as a fraction of the workload's block-granular bound (bench/real_vllm_bound.py's, an unbounded
cache). Outside CI; it asks a running vLLM server to tokenize the prompts (POST /tokenize).

usage: bench/placement_frontier.py REQUESTS_JSONL [VLLM_URL=http://127.0.0.1:18100] [BLOCKS=64]
REQUESTS_JSONL: `loadgen run --dump-requests` output; a group is the prompts sharing a first
(system) message. The LRU ignores blocks pinned by requests running at the same time (at a few
requests a second on two servers, almost none overlap)."""
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_vllm_bound import BLOCK, block_chains, cached_tokens, tokenize  # noqa: E402


def main():
    path = sys.argv[1]
    url = sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:18100"
    cap = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    groups, items, names = {}, [], {}
    for line in open(path):
        messages = json.loads(line)["messages"]
        ids = tokenize(url, "tiny-llama", messages)
        g = groups.setdefault(messages[0]["content"], len(groups))
        # each chain named by a small int, so the caches below hash ints, not token tuples
        chain = [names.setdefault(c, len(names)) for c in block_chains(ids)]
        items.append((g, len(ids), chain))
    total = sum(n for _, n, _ in items)

    seen, bound = set(), 0
    for _, n, chain in items:
        bound += cached_tokens(n, chain, seen)
        seen.update(chain)

    def run(assign):
        caches = [collections.OrderedDict(), collections.OrderedDict()]
        tokens, hit = [0, 0], 0
        for g, n, chain in items:
            s = assign[g]
            cache = caches[s]
            tokens[s] += n
            hit += cached_tokens(n, chain, cache)
            for h in chain:
                cache[h] = None
                cache.move_to_end(h)
            while len(cache) > cap:
                cache.popitem(last=False)
        return hit / bound, max(tokens) / total

    best = {}
    n = len(groups)
    for bits in range(1 << (n - 1)):  # the last group's side fixed: mirror images are equal
        h, share = run([(bits >> i) & 1 for i in range(n)])
        k = round(share * 100)
        best[k] = max(best.get(k, 0.0), h)
    print(f"{n} groups, {len(items)} requests, {total} prompt tokens, bound {bound / total:.3f}, "
          f"{cap} blocks of {BLOCK} tokens per server")
    print("| busiest server's share of prompt tokens | best hit / bound |")
    print("| --- | --- |")
    for k in sorted(best):
        print(f"| {k} % | {best[k]:.3f} |")


if __name__ == "__main__":
    main()
