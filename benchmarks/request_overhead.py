"""What the front end's checks cost an ordinary request: 1-token requests over HTTP, this checkout
against an earlier commit, in one run.

Both servers run side by side (the earlier commit from a temporary `git worktree`); requests go one at
a time, alternating between the servers in rounds, so both see the same machine. The prompts repeat,
so the prefix cache leaves one token of prefill per request: what is measured is HTTP, JSON, checks,
tokenization, scheduling and one decode step, end to end. Kinds of request:
- a short completion, and a short chat;
- a chat of 40 messages (its body has more than 64 brackets, so the nesting check scans it);
- a 20,000-character completion prompt (tokenized inline; the size bound is checked first).

    python benchmarks/request_overhead.py --baseline b4966e5       # the commit before the hostile-input work
    python benchmarks/request_overhead.py --baseline HEAD~3 --rounds 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from pagoda.api_proc.bench.local_server import MODEL_NAME, PagodaServer

ROOT = Path(__file__).resolve().parents[1]

KINDS = {
    "completion, short": ("/v1/completions", {"prompt": "The capital of France is"}),
    "chat, short": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there"}]}),
    "chat, 40 messages": (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user" if i % 2 == 0 else "assistant", "content": f"message number {i}"} for i in range(40)
            ]
        },
    ),
    "completion, 20k chars": ("/v1/completions", {"prompt": "The quick brown fox. " * 950}),
}


def one_request(base_url: str, path: str, body: dict) -> float:
    data = json.dumps({"model": MODEL_NAME, "max_tokens": 1, "temperature": 0, **body}).encode()
    request = urllib.request.Request(base_url + path, data=data, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
        assert response.status == 200
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="HEAD~1", help="git revision to compare with (default HEAD~1)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=25, help="requests per kind per server per round")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="pagoda-overhead-") as tmp:
        worktree = Path(tmp) / "baseline-source"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.baseline],
            check=True,
            capture_output=True,
        )
        servers = {}
        try:
            for name, source in (("baseline", worktree), ("current", None)):
                (Path(tmp) / name).mkdir()
                servers[name] = PagodaServer(Path(tmp) / name, source_dir=source)
            times = {(name, kind): [] for name in servers for kind in KINDS}
            for server in servers.values():  # warm-up: fill the prefix cache, load lazy paths
                for path, body in KINDS.values():
                    one_request(server.base_url, path, body)
            for _ in range(args.rounds):
                for name, server in servers.items():
                    for kind, (path, body) in KINDS.items():
                        times[(name, kind)] += [one_request(server.base_url, path, body) for _ in range(args.per_round)]
        finally:
            for server in servers.values():
                server.stop()
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)

    print(
        f"1-token requests over HTTP, {args.rounds} x {args.per_round} per kind and server, alternating "
        f"(baseline: {args.baseline})\n"
    )
    print("| request | baseline median | current median | current / baseline | baseline p90 | current p90 |")
    print("|---|---|---|---|---|---|")
    for kind in KINDS:
        base, cur = times[("baseline", kind)], times[("current", kind)]
        b50, c50 = statistics.median(base) * 1e3, statistics.median(cur) * 1e3
        b90, c90 = (statistics.quantiles(x, n=10)[-1] * 1e3 for x in (base, cur))
        print(f"| {kind} | {b50:.2f} ms | {c50:.2f} ms | {c50 / b50:.3f}x | {b90:.2f} ms | {c90:.2f} ms |")


if __name__ == "__main__":
    main()
