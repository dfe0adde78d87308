#!/usr/bin/env python3
"""Where the measured binaries come from, as Markdown list lines for a results header.

usage: bench/provenance.py [--require-fresh] [--note TEXT]... BINARY...

Prints the source commit and its uncommitted changes, each binary's build time and whether
it was built after the newest change to the sources it is built from (tracked files, their
uncommitted edits included: inferlb from src/, loadgen from crates/loadgen and
crates/vllm-sim, vllm-sim from crates/vllm-sim, each with Cargo.toml and Cargo.lock; any
other binary from all of them), and the load average at the
start (2 cores shared with other work make absolute numbers indicative). With
--require-fresh it exits 1 when a binary is stale, so a script can refuse to measure it.
The same facts as `loadgen compare` writes (crates/loadgen/src/machine.rs).
"""
import datetime
import os
import subprocess
import sys

SOURCES = ["src", "crates", "benches", "Cargo.toml", "Cargo.lock"]
# What each binary is built from (cargo relinks it only when one of these changes).
BUILT_FROM = {
    "inferlb": ["src", "Cargo.toml", "Cargo.lock"],
    "loadgen": ["crates/loadgen", "crates/vllm-sim", "Cargo.toml", "Cargo.lock"],
    "vllm-sim": ["crates/vllm-sim", "Cargo.toml", "Cargo.lock"],
    # benches/cost_curves.rs, copied out of target/release/deps by bench/cost_curves.py
    "cost_curves": ["src", "benches", "Cargo.toml", "Cargo.lock"],
}


def git(*args):
    try:
        r = subprocess.run(["git", *args], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return r.stdout.rstrip("\n")


def utc(ts):
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def facts(binaries, notes=()):
    """(markdown lines, stale binaries)."""
    top = git("rev-parse", "--show-toplevel")
    commit = git("rev-parse", "HEAD") or "unknown (not a git checkout)"
    status = git("status", "--porcelain", "--untracked-files=no") or ""
    dirty = [l[3:] for l in status.splitlines() if len(l) > 3]
    def newest_of(paths):
        if not top:
            return None
        files = (git("-C", top, "ls-files", "--", *paths) or "").splitlines()
        times = [os.path.getmtime(os.path.join(top, f)) for f in files if os.path.exists(os.path.join(top, f))]
        return max(times) if times else None

    state = "clean" if not dirty else f"dirty: {len(dirty)} changed file(s): {', '.join(dirty)}"
    lines = [f"- source: commit {commit} ({state})"]
    stale = []
    for b in binaries:
        if not os.path.exists(b):
            lines.append(f"- binary: `{b}` missing")
            stale.append(b)
            continue
        built = os.path.getmtime(b)
        newest = newest_of(BUILT_FROM.get(os.path.basename(b), SOURCES))
        if newest is None:
            fresh = "freshness unknown"
        elif built >= newest:
            fresh = "built after the last source change"
        else:
            fresh = "STALE: older than the sources, does not measure this commit"
            stale.append(b)
        lines.append(f"- binary: `{b}` built {utc(built)} ({fresh})")
    try:
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
        lines.append(
            f"- load average at start: {load} on {os.cpu_count()} cores "
            "(anything above 0 is other work sharing the machine)"
        )
    except OSError:
        pass
    lines += [f"- {n}" for n in notes]
    return lines, stale


def main():
    args = sys.argv[1:]
    require_fresh = False
    notes, binaries = [], []
    while args:
        a = args.pop(0)
        if a == "--require-fresh":
            require_fresh = True
        elif a == "--note" and args:
            notes.append(args.pop(0))
        elif a in ("-h", "--help"):
            sys.exit(__doc__)
        else:
            binaries.append(a)
    lines, stale = facts(binaries, notes)
    print("\n".join(lines))
    if require_fresh and stale:
        print(f"provenance.py: stale or missing: {', '.join(stale)}; rebuild them first", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
