#!/usr/bin/env python3
"""What a router could reach at all on a real-vLLM run whose caches evict: the hit rate of the
best fixed assignment of prompt groups to servers, found with hindsight, under vLLM's own
eviction order.

bench/real_vllm_bound.py's bound assumes an unbounded cache: each group's shared blocks miss
once. With BLOCKS=64 the two servers evict, and vLLM evicts by its own rule (below), not by
future use, so no router reaches that bound once the run's blocks outgrow the caches. This
script replays the run's prompts, tokenized by vLLM itself (POST /tokenize, as
real_vllm_bound.py does), through a model of each server's prefix cache, for every way of
splitting the prompt groups (prompts sharing their first 128-token block) between two servers,
and reports the best split overall and the best whose busiest server takes at most BUSIEST of
the prompt tokens. It also tries, from the best balanced split, sending one group to both
servers in turn (a replicated hot prefix).

The cache model, from vLLM 0.32's v1 block pool (vllm/v1/core/block_pool.py,
kv_cache_manager.py):
- a server keeps BLOCKS - 2 blocks cached: one is vLLM's null block, and one holds the running
  request's last, partial block;
- a prompt hits its leading full blocks that are cached, never its last token;
- a finished request's full blocks stay cached and join the eviction queue tail first (vLLM
  frees a request's blocks in reverse), so its leading blocks are evicted last; a block hit again
  moves to the back of the queue;
- requests run one at a time (the runs here keep < 1 request in flight on average), so blocks
  held by other running requests and blocks completed by generated tokens are not modelled:
  the model is an estimate, not a bound. Checked against one real vLLM 0.32 server (BLOCKS=64,
  the runs' prompts sent one at a time, cache reset first; vLLM's own hit counters): vLLM 0.6445,
  0.6265 and 0.6258 against the model's 0.6470, 0.6372 and 0.6258 (bench/results/
  lru-oracle-2026-12-07.md): the model errs up by at most 0.011, so the best split it finds is,
  if anything, above what the servers would give.

When the dump records each answer's backend (`backend`, loadgen's backend header), the run's
own assignment is replayed through the same model too: the model's figure for what the router
did, beside vLLM's measured one.

A fixed split is what prefix-affinity routing converges to; a router that moves a group
between servers or replicates several groups is not covered, except for the one-group
replication tried here.

Usage: lru_oracle.py VLLM_URL BLOCKS_PER_SERVER REQUESTS.jsonl [REQUESTS.jsonl ...]
(REQUESTS.jsonl: loadgen --dump-requests, as bench/real_vllm.sh keeps them in its OUT dir).
Env: BUSIEST (default 0.55).

       lru_oracle.py --replay VLLM_URL BLOCKS_PER_SERVER REQUESTS.jsonl [REQUESTS.jsonl ...]
replays only each dump's own assignment (loadgen recorded each answer's backend);

       lru_oracle.py --rules VLLM_URL BLOCKS_PER_SERVER REQUESTS.jsonl [REQUESTS.jsonl ...]
replays a few simple online placement rules through the model (hit / bound, busiest share);

       lru_oracle.py --check VLLM_URL BLOCKS_PER_SERVER REQUESTS.jsonl
checks the model: it resets the server's prefix cache (serve.sh with DEV=1, started with
BLOCKS=BLOCKS_PER_SERVER), sends the prompts to it one at a time (8 output tokens each), and
prints vLLM's own hit rate over them beside the model's replay of the same prompts on one
server.
"""
import json
import os
import sys
import urllib.request
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_vllm_bound import BLOCK, block_chains, reachable, tokenize  # noqa: E402

MAX_GROUPS = 18  # 2^17 splits at most


def replay_each(prompts, server_of, capacity, servers=2):
    """For each prompt in turn, (server, leading blocks it finds cached) when prompt i goes to
    server_of(i). A prompt is any sequence of (chains, hittable blocks, tokens): its blocks'
    keys in order, how many of them can hit, and its length."""
    caches = [OrderedDict() for _ in range(servers)]
    for i, (chains, cap, _) in enumerate(prompts):
        s = server_of(i)
        cache = caches[s]
        k = 0
        while k < min(cap, len(chains)) and chains[k] in cache:
            k += 1
        yield s, k
        for c in reversed(chains):
            cache[c] = True
            cache.move_to_end(c)
        while len(cache) > capacity:
            cache.popitem(last=False)


def replay(prompts, server_of, capacity):
    """Cached tokens and each server's prompt tokens when prompt i goes to server_of(i)."""
    hits = 0
    work = [0, 0]
    for (_, _, n), (s, k) in zip(prompts, replay_each(prompts, server_of, capacity)):
        hits += k * BLOCK
        work[s] += n
    return hits, work


def model_of(url):
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def load(url, model, path):
    """A dump's lines, their prompts tokenized by vLLM, each prompt as `replay` takes it
    (chains, hittable blocks, tokens), and the tokens the no-eviction bound serves."""
    lines = [json.loads(line) for line in open(path)]
    ids = [tokenize(url, model, line["messages"]) for line in lines]
    prompts = [(block_chains(t), (len(t) - 1) // BLOCK, len(t)) for t in ids]
    return lines, ids, prompts, reachable(ids)


def recorded(lines):
    """The dump's own assignment as `replay` takes it (prompt i → server 0 or 1), or None when
    some request has no recorded backend or there are more than two."""
    names = sorted({line.get("backend") or "" for line in lines})
    if "" in names or len(names) > 2:
        return None
    return lambda i: names.index(lines[i]["backend"])


def oracle(url, model, path, blocks, busiest_limit):
    lines, ids, prompts, free = load(url, model, path)
    total = sum(map(len, ids))
    keys = {}
    group = [keys.setdefault(tuple(t[:BLOCK]) if len(t) >= BLOCK else ("short", i), len(keys)) for i, t in enumerate(ids)]
    g = len(keys)
    if g > MAX_GROUPS:
        sys.exit(f"lru_oracle.py: {g} groups, more than {MAX_GROUPS}: too many splits to try")
    capacity = blocks - 2
    best = best_balanced = None
    # The last group stays on server 0: a split and its mirror image are the same.
    for mask in range(1 << (g - 1)):
        hits, work = replay(prompts, lambda i: (mask >> group[i]) & 1, capacity)
        busiest = max(work) / sum(work)
        if best is None or hits > best[0]:
            best = (hits, busiest, mask)
        if busiest <= busiest_limit and (best_balanced is None or hits > best_balanced[0]):
            best_balanced = (hits, busiest, mask)
    # The run's own assignment, when loadgen recorded each answer's backend header.
    own = None
    server_of = recorded(lines)
    if server_of is not None:
        hits, work = replay(prompts, server_of, capacity)
        own = (hits, max(work) / sum(work))
    replicated = None
    if best_balanced is not None:
        mask = best_balanced[2]
        for r in range(g):
            turn = {}

            def server_of(i, r=r, turn=turn):
                if group[i] != r:
                    return (mask >> group[i]) & 1
                turn[r] = turn.get(r, -1) + 1
                return turn[r] % 2

            hits, work = replay(prompts, server_of, capacity)
            busiest = max(work) / sum(work)
            if busiest <= busiest_limit and (replicated is None or hits > replicated[0]):
                replicated = (hits, busiest, r)
    return total, free, g, best, best_balanced, replicated, own


def metric(url, name):
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in "{ ")


def check(url, blocks, path):
    model = model_of(url)
    urllib.request.urlopen(urllib.request.Request(url + "/reset_prefix_cache", b"", method="POST"), timeout=30).read()
    lines, _, prompts, _ = load(url, model, path)
    hits0, queries0 = metric(url, "vllm:prefix_cache_hits_total"), metric(url, "vllm:prefix_cache_queries_total")
    for line in lines:
        body = json.dumps({"model": model, "messages": line["messages"], "max_tokens": 8}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json"})
        urllib.request.urlopen(req, timeout=120).read()
    hits = metric(url, "vllm:prefix_cache_hits_total") - hits0
    queries = metric(url, "vllm:prefix_cache_queries_total") - queries0
    row = [f"vLLM {hits / queries:.4f}"]
    for kept in (blocks - 2, blocks - 1, blocks):
        h, work = replay(prompts, lambda i: 0, kept)
        row.append(f"model with {kept} blocks kept {h / sum(work):.4f}")
    print(f"{path}: one server, {len(lines)} prompts one at a time: " + ", ".join(row))


def rules(url, blocks, paths):
    """Simple online placement rules replayed through the model: each new group (first
    128-token block) gets a home server when it first appears and keeps it."""
    model = model_of(url)

    def fewer_groups_capped(limit):
        def choose(work, groups):
            s = 0 if (groups[0], work[0]) <= (groups[1], work[1]) else 1
            if sum(work) and work[s] / sum(work) > limit:
                s = 1 - s
            return s
        return choose

    table = [
        ("the server with less prompt work so far", lambda work, groups: 0 if work[0] <= work[1] else 1),
        ("the server with fewer groups", fewer_groups_capped(1.0)),
        ("fewer groups, unless that server has done > 52 % of the work", fewer_groups_capped(0.52)),
    ]
    print("| new group goes to | " + " | ".join(paths) + " |")
    print("| --- |" + " --- |" * len(paths))
    rows = {name: [] for name, _ in table}
    for path in paths:
        _, ids, prompts, free = load(url, model, path)
        group = [tuple(t[:BLOCK]) for t in ids]
        for name, choose in table:
            home = {}
            work = [0, 0]
            groups = [0, 0]

            def server_of(i, choose=choose, home=home, work=work, groups=groups):
                if group[i] not in home:
                    home[group[i]] = choose(work, groups)
                    groups[home[group[i]]] += 1
                s = home[group[i]]
                work[s] += prompts[i][2]
                return s

            hits, w = replay(prompts, server_of, blocks - 2)
            rows[name].append(f"{hits / free:.3f}, {max(w) / sum(w) * 100:.0f} %")
    for name, cells in rows.items():
        print(f"| {name} | " + " | ".join(cells) + " |")


def replay_recorded(url, blocks, paths):
    """Each dump's own assignment (its recorded backends) replayed through the model."""
    model = model_of(url)
    for path in paths:
        lines = [json.loads(line) for line in open(path)]
        server_of = recorded(lines)
        if server_of is None:
            print(f"{path}: no recorded backend on some requests, or more than two backends")
            continue
        _, _, prompts, free = load(url, model, path)
        hits, work = replay(prompts, server_of, blocks - 2)
        total = sum(work)
        print(f"{path}: the model reads {hits / total:.4f} = {hits / free:.3f} of the bound, busiest {max(work) / total * 100:.0f} %")


def main():
    if len(sys.argv) >= 4 and sys.argv[1] == "--replay":
        replay_recorded(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
        return
    if len(sys.argv) >= 4 and sys.argv[1] == "--rules":
        rules(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
        return
    if len(sys.argv) == 5 and sys.argv[1] == "--check":
        check(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    url, blocks, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    limit = float(os.environ.get("BUSIEST", "0.55"))
    model = model_of(url)
    print(f"# two servers of {blocks} blocks ({blocks - 2} kept cached) of {BLOCK} tokens; busiest limit {limit:.2f}")
    print()
    print("| requests | prompts | groups | no-eviction bound | best split | best split, busiest ≤ limit | + one group on both | the run's own assignment |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in paths:
        total, free, g, best, balanced, replicated, own = oracle(url, model, path, blocks, limit)
        bound = free / total

        def cell(x):
            if x is None:
                return "none"
            return f"{x[0] / total:.4f} = **{x[0] / free:.3f}** of the bound, busiest {x[1] * 100:.0f} %"

        print(f"| {path} | {sum(1 for _ in open(path))} | {g} | {bound:.4f} | {cell(best)} | {cell(balanced)} | {cell(replicated)} | {cell(own) if own else 'not recorded'} |")


if __name__ == "__main__":
    main()
