#!/usr/bin/env python3
"""The table of bench/real_vllm.sh, with the workload's block-granular hit-rate bound computed
from vLLM's own tokenization.

Usage: real_vllm_bound.py OUT_DIR VLLM_URL ZIPF SEED GROUPS RATE POLICY...
Env: ORACLE=1 adds the best fixed split of the prompt groups found with hindsight on caches of
BLOCKS (64) blocks per server (bench/lru_oracle.py; a few minutes for 14 groups), busiest server
at most 55 %, and each policy's hit rate as a share of it.

OUT_DIR holds, per policy, loadgen's summary (POLICY.json), the requests it sent
(POLICY.requests.jsonl, from `loadgen run --dump-requests`) and each server's /metrics page before
and after the run (POLICY.before.*, POLICY.after.*).

The bound: every request's prompt is tokenized by the server (POST /tokenize with the chat
messages, add_generation_prompt as vLLM's chat API does) and cut into 128-token blocks. A request
can be served from cache for at most the leading full blocks some earlier request of the run
already had (each group's shared blocks miss once; an unbounded cache), and never for its last
token (vLLM always computes at least one). max = sum of those tokens / sum of prompt tokens.
"""
import datetime
import glob
import json
import os
import statistics
import subprocess
import sys
import urllib.request

BLOCK = 128


def metric_sum(path, name):
    total = 0.0
    with open(path) as f:
        for line in f:
            if line.startswith(name) and (line[len(name)] in "{ "):
                total += float(line.rsplit(" ", 1)[1])
    return total


def tokenize(url, model, messages):
    body = json.dumps({"model": model, "messages": messages, "add_generation_prompt": True}).encode()
    req = urllib.request.Request(url + "/tokenize", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)["tokens"]


def block_chains(ids):
    """The prompt's full blocks, each named by every token up to its end (a chain)."""
    return [tuple(ids[: (i + 1) * BLOCK]) for i in range(len(ids) // BLOCK)]


def cached_tokens(n, chains, cached):
    """Tokens of an `n`-token prompt served from a cache holding `cached`: its leading full
    blocks found there, never its last token."""
    cap = (n - 1) // BLOCK
    k = 0
    while k < min(cap, len(chains)) and chains[k] in cached:
        k += 1
    return k * BLOCK


def reachable(prompts):
    """Tokens of `prompts` (token-id lists, in order) an unbounded cache serves: the bound."""
    seen = set()
    hit = 0
    for ids in prompts:
        chains = block_chains(ids)
        hit += cached_tokens(len(ids), chains, seen)
        seen.update(chains)
    return hit


def bound(url, requests_path):
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        model = json.load(r)["data"][0]["id"]
    prompts = [tokenize(url, model, json.loads(line)["messages"]) for line in open(requests_path)]
    total = sum(map(len, prompts))
    return reachable(prompts) / total if total else 0.0, total


# vLLM's own view of a request's first token, as means over both servers (histogram sums over
# counts): the frontend's time to first token (from its arrival stamp), the engine core's
# queue (waiting) and prefill (scheduled to first token) times. What the first leaves over the
# other two is time outside the engine's step: input processing and the hand-offs between the
# frontend and engine processes, which on this 2-core machine wait for a core.
SPLIT = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds")


def run_figures(out, run):
    """One run's figures: vLLM's hit rate over both servers, the busiest server's share of
    prompt tokens, and loadgen's summary (with vLLM's means of SPLIT under `_vllm_split`)."""
    s = json.load(open(os.path.join(out, run + ".json")))
    hits = queries = 0.0
    prompt = []
    sums = [0.0] * len(SPLIT)
    counts = [0.0] * len(SPLIT)
    for before in sorted(glob.glob(os.path.join(out, run + ".before.*"))):
        after = before.replace(".before.", ".after.")
        delta = lambda name: metric_sum(after, name) - metric_sum(before, name)
        hits += delta("vllm:prefix_cache_hits_total")
        queries += delta("vllm:prefix_cache_queries_total")
        prompt.append(delta("vllm:prompt_tokens_total"))
        for i, name in enumerate(SPLIT):
            sums[i] += delta(name + "_sum")
            counts[i] += delta(name + "_count")
    rate = hits / queries if queries else 0.0
    busiest = max(prompt) / sum(prompt) if sum(prompt) else 0.0
    s["_vllm_split"] = [sm / c if c else 0.0 for sm, c in zip(sums, counts)]
    return s, rate, busiest


def spread(values, fmt):
    """The median, and [min–max] when there is more than one value."""
    values = sorted(values)
    med = statistics.median(values)
    if len(values) == 1:
        return fmt(med)
    return f"{fmt(med)} [{fmt(values[0])}–{fmt(values[-1])}]"


def describe_workload(zipf, seed, groups, rate):
    env = os.environ
    if env.get("WORKLOAD", "shared-prefix") == "multi-turn":
        return (f"multi-turn, {env.get('CONVERSATIONS', '8')} conversations × {env.get('TURNS', '6')} turns, "
                f"system {env.get('SYSTEM', '300')} / user {env.get('QUESTION', '30')} / output {env.get('OUTPUT', '8')} "
                f"loadgen tokens, Poisson {rate} req/s, seed {seed}")
    return (f"shared-prefix, {groups} groups × {env.get('PROMPTS', '4')} prompts, system {env.get('SYSTEM', '300')} / "
            f"question {env.get('QUESTION', '30')} / output {env.get('OUTPUT', '8')} loadgen tokens, Zipf {zipf}, "
            f"Poisson {rate} req/s, seed {seed}")


def main():
    out, url, zipf, seed, groups, rate = sys.argv[1:7]
    policies = sys.argv[7:]
    repeat = int(os.environ.get("REPEAT", "1"))
    runs = {p: ([p] if repeat == 1 else [f"{p}.r{r}" for r in range(1, repeat + 1)]) for p in policies}
    first = os.path.join(out, runs[policies[0]][0] + ".requests.jsonl")
    max_rate, tokens = bound(url, first)
    best_split = None
    if os.environ.get("ORACLE"):
        import lru_oracle
        blocks = int(os.environ.get("BLOCKS", "64"))
        total, _, _, _, balanced, _, _ = lru_oracle.oracle(url, lru_oracle.model_of(url), first, blocks, 0.55)
        best_split = balanced[0] / total if balanced else None
    cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True, text=True).stdout.strip()
    multi = os.environ.get("WORKLOAD", "shared-prefix") == "multi-turn"
    shape = "multi-turn" if multi else ("uniform" if float(zipf) == 0 else f"Zipf {zipf}")
    env_words = " ".join(
        f"{k}={os.environ[k]}" for k in ("WORKLOAD", "PROMPTS", "CONVERSATIONS", "TURNS", "SYSTEM", "QUESTION", "OUTPUT", "GROUPS_N", "RATE", "REPEAT")
        if k in os.environ and k != "WORKLOAD" or (k == "WORKLOAD" and multi)
    )
    lines = [
        f"# Routing policies on two real vLLM 0.32 servers (CPU build, tiny random-weight model): {shape}",
        "",
        f"- command: `{env_words + ' ' if env_words else ''}ZIPF={zipf} SEED={seed} bench/real_vllm.sh \"{' '.join(policies)}\"` (BLOCKS=64: 64 KV blocks of 128 tokens per server; KV events on; both caches reset (POST /reset_prefix_cache) before each run)",
        f"- machine: nproc {os.cpu_count()}, CPU {cpu}; load average at the end {os.getloadavg()[0]:.1f}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        open(os.path.join(out, "provenance.md")).read().rstrip("\n"),
        f"- workload: {describe_workload(zipf, seed, groups, rate)}",
        f"- runs: {repeat} per policy, the policies interleaved; figures are medians [min–max] over the runs" if repeat > 1 else "- runs: 1 per policy",
        f"- hit rate: Δvllm:prefix_cache_hits_total ÷ Δvllm:prefix_cache_queries_total over both servers (vLLM's own counters)",
        f"- max: {max_rate:.3f}, the block-granular bound from vLLM's own tokenization ({tokens} prompt tokens of the first run; bench/real_vllm_bound.py)"
        + (" — prompts only: vLLM may also hit blocks of earlier answers, so hit / max can pass 1" if multi else ""),
        "- busiest: the larger server's share of Δvllm:prompt_tokens_total",
        "- vLLM TTFT / queue / prefill: means over both servers of vLLM's own histograms "
        "(vllm:time_to_first_token_seconds from the frontend's arrival stamp; "
        "vllm:request_queue_time_seconds and vllm:request_prefill_time_seconds in the engine core)",
    ]
    split_col = best_split is not None
    if split_col:
        lines.append(
            f"- best split: {best_split:.3f}, the hit rate of the best fixed split of the prompt groups between the servers, "
            f"found with hindsight, busiest ≤ 55 %, caches of {os.environ.get('BLOCKS', '64')} blocks (bench/lru_oracle.py on the first run's requests)"
        )
    lines += [
        "",
        "| policy | requests ok | TTFT p50 | TTFT p90 | E2E p90 | vLLM hit rate | hit / max | "
        + ("hit / best split | " if split_col else "") + "busiest server (prompt tokens) | vLLM TTFT / queue / prefill | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | " + ("--- | " if split_col else "") + "--- | --- | --- |",
    ]
    for p in policies:
        figures = [run_figures(out, r) for r in runs[p]]
        ok = sum(s["ok"] for s, _, _ in figures)
        sent = sum(s["requests"] for s, _, _ in figures)
        errors = {}
        for s, _, _ in figures:
            for k, v in s["errors"].items():
                errors[k] = errors.get(k, 0) + v
        ms = lambda v: f"{v * 1000:.0f} ms"
        lines.append(
            f"| {p} | {ok}/{sent} | {spread([s['ttft']['p50'] for s, _, _ in figures], ms)} | "
            f"{spread([s['ttft']['p90'] for s, _, _ in figures], ms)} | {spread([s['e2e']['p90'] for s, _, _ in figures], ms)} | "
            f"{spread([r for _, r, _ in figures], lambda v: f'{v:.3f}')} | "
            f"{spread([r / max_rate if max_rate else 0 for _, r, _ in figures], lambda v: f'{v:.3f}')} | "
            + (f"{spread([r / best_split for _, r, _ in figures], lambda v: f'{v:.3f}')} | " if split_col else "")
            + f"{spread([b * 100 for _, _, b in figures], lambda v: f'{v:.0f} %')} | "
            + " / ".join(spread([s['_vllm_split'][i] for s, _, _ in figures], ms) for i in range(len(SPLIT)))
            + f" | {json.dumps(errors)} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    # RESULT_SUFFIX names the file of a run beside others of the same day and workload.
    suffix = ("-multi-turn" if multi else ("" if float(zipf) == 0 else "-zipf")) + os.environ.get("RESULT_SUFFIX", "")
    path = f"bench/results/real-vllm-{datetime.date.today().isoformat()}{suffix}.md"
    open(path, "w").write(text)
    print("wrote", path)


if __name__ == "__main__":
    main()
