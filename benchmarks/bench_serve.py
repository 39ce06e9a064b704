"""Model service latency and throughput with RFC 9530 digest checks on vs off.

Four uvicorn server processes serve the same tiny model: "on" requires a
request Content-Digest (sha-256, checked before the application sees the
body) and adds one to every response; "off" and "off (A/A)" are two identical
servers that ignore digests and add none. The A/A pair shows the noise floor:
any difference between them is noise. "overlap" is "on" with the opt-in
overlap_digest=True (the body is hashed on the event loop while /predict's
worker thread parses it; the model runs only after the digest matched).

Every measurement is interleaved: a round runs one short block per
configuration, in an order that rotates from round to round, and each round
gives paired ratios (block median of "on" over the "off" block of the same
round). The report gives the median ratio over the rounds and the spread
(25th to 75th percentile), beside the A/A ratio measured the same way.

Views:
- service: the client sends a digest it already has (the same bytes and
  header go to every server; "off" ignores it) and, for "on", verifies the
  response digest. This is what digest verification adds to the service.
- end to end: the client also computes the sha-256 of each request body
  before sending it, as a client holding a ready-made body must.
- encoded per request: the client builds the JSON body from a tensor for
  every request, as torchverity.serve.Client does, then hashes it ("on").
- in process: the same three apps driven through ASGI in this process (no
  network, no client), which isolates the server's own critical path.

Target (issue 8): digest verification adds under 5% at 1 MiB (latency and
throughput, checks on vs off). It is judged on the service view, and called
met only when the 95% bootstrap interval of the median ratio, widened by the
A/A offset, lies entirely below 5%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import table, write_results
from torchverity.serve._digests import format_digest, verify_digest
from torchverity.serve._spec import encode_inputs

KiB, MiB = 1 << 10, 1 << 20
TARGET = 0.05
SERVERS = ("off", "off2", "on", "overlap")


class SumNet(torch.nn.Module):
    """Cheap on purpose: the benchmark measures the transport, not the model."""

    input_spec = ("x:float32:-1",)

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale).sum(0, keepdim=True)


def build_app(server: str) -> Any:
    """"off"/"off2": no digests; "on": the service as shipped (the app sees no body
    before its digest matched); "overlap": "on" with overlap_digest=True."""
    from torchverity.serve._app import create_app

    on = server in ("on", "overlap")
    return create_app(SumNet(), digest_policy="require" if on else "ignore",
                      response_digest="sha-256" if on else None, recheck_interval=None,
                      max_body=4 * MiB, overlap_digest=server == "overlap")


def child(server: str, port: int) -> None:
    import uvicorn

    uvicorn.run(build_app(server), host="127.0.0.1", port=port, log_level="error")


def body_of_size(target: int) -> bytes:
    """A /predict request of about ``target`` bytes (floats printed to 8 digits)."""
    count = max(1, (target - 80) // 11)
    data = ",".join(f"{(i % 997) / 997:.8f}" for i in range(count))
    return (f'{{"inputs":[{{"name":"x","datatype":"FP32","shape":[{count}],'
            f'"data":[{data}]}}]}}').encode()


# ------------------------------------------------ one request, as each configuration sends it


class Config:
    """How one configuration sends a request: which server, what the client does per request.

    ``encoded``: the client builds the body from a tensor for every request
    (as ``torchverity.serve.Client`` does) instead of sending ready-made bytes.
    """

    def __init__(self, label: str, server: str, client_hashes: bool,
                 encoded: bool = False) -> None:
        self.label = label
        self.server = server
        self.client_hashes = client_hashes
        self.encoded = encoded

    def send(self, client: httpx.Client, payload: Payload) -> float:
        start = time.perf_counter()
        body, field = payload.body, payload.field
        if self.encoded:
            body = json.dumps({"inputs": encode_inputs({"x": payload.tensor})},
                              separators=(",", ":"), allow_nan=False).encode()
        if self.client_hashes:
            field = format_digest("sha-256", body)
        r = client.post("/predict", content=body,
                        headers={"Content-Type": "application/json", "Content-Digest": field})
        if r.status_code != 200:
            raise SystemExit(f"benchmark request failed: {r.status_code} {r.text[:200]}")
        if self.server in ("on", "overlap"):
            verify_digest(r.headers["content-digest"], r.content)
        return time.perf_counter() - start


class Payload:
    """A ready-made body of about ``size`` bytes with its digest, and a tensor whose JSON
    encoding is about as large."""

    def __init__(self, size: int) -> None:
        self.body = body_of_size(size)
        self.field = format_digest("sha-256", self.body)
        count = max(1, (size - 80) // 19)  # float32 values print as up to ~19 characters
        self.tensor = torch.arange(count, dtype=torch.float32).remainder_(997).div_(997)


THROUGHPUT = (Config("off", "off", False), Config("off (A/A)", "off2", False),
              Config("on, service", "on", False), Config("on, end to end", "on", True),
              Config("on, overlapping check (opt-in)", "overlap", False))
LATENCY = (*THROUGHPUT, Config("off, encoded per request", "off", False, True),
           Config("on, encoded per request", "on", True, True))


def rotated(items: Sequence[Any], round_no: int) -> list[Any]:
    shift = round_no % len(items)
    return [*items[shift:], *items[:shift]]


# Each configuration is compared with the "off" configuration that sends the same way.
BASELINE = {"off (A/A)": "off", "on, service": "off", "on, end to end": "off",
            "on, encoded per request": "off, encoded per request",
            "on, overlapping check (opt-in)": "off"}


def paired(blocks: dict[str, list[float]], invert: bool = False) -> dict[str, list[float]]:
    """Per-round ratios of each configuration to its baseline in the same round (latency:
    time ratio; throughput, ``invert``: base rate / rate, so both read as 'how much slower')."""
    out = {}
    for label, values in blocks.items():
        if label in BASELINE:
            base = blocks[BASELINE[label]]
            out[label] = [(b / v if invert else v / b) for v, b in zip(values, base, strict=True)]
    return out


def latency_rounds(urls: dict[str, str], payload: Payload, rounds: int,
                   per_block: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Sequential keep-alive requests: every request's time, and each block's median."""
    times: dict[str, list[float]] = {c.label: [] for c in LATENCY}
    blocks: dict[str, list[float]] = {c.label: [] for c in LATENCY}
    clients = {s: httpx.Client(base_url=urls[s], timeout=60) for s in SERVERS}
    try:
        for config in LATENCY:  # warm the connections and the servers
            config.send(clients[config.server], payload)
        for round_no in range(rounds):
            for config in rotated(LATENCY, round_no):
                block = [config.send(clients[config.server], payload)
                         for _ in range(per_block)]
                times[config.label] += block
                blocks[config.label].append(statistics.median(block))
    finally:
        for client in clients.values():
            client.close()
    return times, blocks


def throughput_rounds(urls: dict[str, str], payload: Payload, rounds: int, per_block: int,
                      concurrency: int = 4) -> dict[str, list[float]]:
    """Requests per second of ``concurrency`` client threads, one block per configuration."""
    clients = {(s, i): httpx.Client(base_url=urls[s], timeout=60)
               for s in SERVERS for i in range(concurrency)}
    rates: dict[str, list[float]] = {c.label: [] for c in THROUGHPUT}
    share = per_block // concurrency
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            for round_no in range(rounds):
                for config in rotated(THROUGHPUT, round_no):
                    def work(i: int, config: Config = config) -> None:
                        for _ in range(share):
                            config.send(clients[config.server, i], payload)

                    start = time.perf_counter()
                    list(pool.map(work, range(concurrency)))
                    rates[config.label].append(share * concurrency
                                               / (time.perf_counter() - start))
    finally:
        for client in clients.values():
            client.close()
    return rates


def in_process_rounds(body: bytes, rounds: int, per_block: int) -> dict[str, list[float]]:
    """The three apps through ASGI in this process: block medians of the server's own time."""
    labels = {"off": "off", "off2": "off (A/A)", "on": "on, service",
              "overlap": "on, overlapping check (opt-in)"}
    apps = {s: build_app(s) for s in labels}
    field = format_digest("sha-256", body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-digest", field),
               (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/predict", "raw_path": b"/predict",
             "root_path": "", "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    chunks = [body[i:i + 64 * KiB] for i in range(0, len(body), 64 * KiB)]

    async def once(app: Any) -> float:
        pending = list(chunks)
        statuses: list[int] = []

        async def receive() -> dict[str, Any]:
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        start = time.perf_counter()
        await app(dict(scope), receive, send)
        elapsed = time.perf_counter() - start
        if statuses != [200]:
            raise SystemExit(f"in-process request failed: {statuses}")
        return elapsed

    async def run() -> dict[str, list[float]]:
        blocks: dict[str, list[float]] = {labels[s]: [] for s in apps}
        for s in apps:
            await once(apps[s])
        for round_no in range(rounds):
            for s in rotated(list(apps), round_no):
                block = [await once(apps[s]) for _ in range(per_block)]
                blocks[labels[s]].append(statistics.median(block))
        return blocks

    return asyncio.run(run())


# ------------------------------------------------ servers and the load test


def start_servers() -> tuple[dict[str, str], list[subprocess.Popen[bytes]]]:
    urls, procs = {}, []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for server in SERVERS:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs.append(subprocess.Popen([sys.executable, __file__, "--child", server, str(port)],
                                      env=env))
        urls[server] = f"http://127.0.0.1:{port}"
    for url in urls.values():
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"server at {url} did not start")
            time.sleep(0.1)
    return urls, procs


def load_test(url: str, total: int, concurrency: int) -> tuple[list[float], int]:
    """``total`` small verified requests from ``concurrency`` threads: latencies and errors."""
    payload = Payload(KiB)
    on = Config("on", "on", True)

    def work(count: int) -> tuple[list[float], int]:
        times, errors = [], 0
        with httpx.Client(base_url=url, timeout=60) as client:
            for _ in range(count):
                try:
                    times.append(on.send(client, payload))
                except (SystemExit, httpx.HTTPError, ValueError):
                    errors += 1
        return times, errors

    with ThreadPoolExecutor(concurrency) as pool:
        parts = list(pool.map(work, [total // concurrency] * concurrency))
    return [t for times, _ in parts for t in times], sum(e for _, e in parts)


def hash_cost_ms(size: int) -> float:
    data = os.urandom(size)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        format_digest("sha-256", data)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


# ------------------------------------------------ report


def spread(ratios: list[float]) -> tuple[float, float, float]:
    """Median ratio - 1, and the 25th and 75th percentiles - 1."""
    q = statistics.quantiles(ratios, n=4)
    return statistics.median(ratios) - 1, q[0] - 1, q[2] - 1


def fmt(ratios: list[float]) -> str:
    mid, low, high = spread(ratios)
    return f"{mid:+.1%} [{low:+.1%}, {high:+.1%}]"


def median_ci(ratios: list[float], resamples: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median ratio - 1 (rounds resampled, fixed seed)."""
    rng = random.Random(8)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(resamples))
    return medians[int(resamples * 0.025)] - 1, medians[int(resamples * 0.975) - 1] - 1


def assess(effect: list[float], aa: list[float], judged: bool) -> str:
    """The cost with its 95% interval, widened by the A/A offset (two identical servers
    that differ by that much make any smaller difference meaningless); with ``judged``, the
    verdict against the target: met only when the whole widened interval is below it."""
    cost = statistics.median(effect) - 1
    low, high = median_ci(effect)
    offset = abs(statistics.median(aa) - 1)
    low, high = low - offset, high + offset
    text = (f"{cost:+.1%} (95% interval widened by the A/A offset of {offset:.1%}: "
            f"[{low:+.1%}, {high:+.1%}])")
    if not judged:
        return text
    if high < TARGET:
        return "met: " + text
    if low >= TARGET:
        return "NOT met: " + text
    return "undecided (the interval spans 5%): " + text


Measured = dict[str, dict[str, Any]]


def measure(urls: dict[str, str], size: int, plan: dict[str, tuple[int, int]]) -> Measured:
    payload = Payload(size)
    times, lat_blocks = latency_rounds(urls, payload, *plan["latency"])
    rates = throughput_rounds(urls, payload, *plan["throughput"])
    local = in_process_rounds(payload.body, *plan["in_process"])
    return {"times": times, "latency": paired(lat_blocks),
            "rates": rates, "throughput": paired(rates, invert=True),
            "local_ms": {k: statistics.median(v) * 1000 for k, v in local.items()},
            "in_process": paired(local)}


def report(results: dict[str, Measured]) -> tuple[str, dict[str, Any]]:
    rows: list[tuple[object, ...]] = []
    summary: dict[str, Any] = {}
    aa = "off (A/A)"
    for label, res in results.items():
        for name in [c.label for c in LATENCY]:
            times, rates = res["times"].get(name), res["rates"].get(name)
            local = res["local_ms"].get(name)
            q = statistics.quantiles(times, n=100) if times else None
            rows.append((
                label, name,
                f"{statistics.median(times) * 1000:.2f}" if times else "",
                f"{q[98] * 1000:.2f}" if q else "",
                fmt(res["latency"][name]) if name in res["latency"] else "",
                f"{statistics.median(rates):.0f}" if rates else "",
                fmt(res["throughput"][name]) if name in res["throughput"] else "",
                f"{local:.2f}" if local is not None else "",
                fmt(res["in_process"][name]) if name in res["in_process"] else "",
            ))
        judged = label == "1 MiB"
        summary[label] = {
            view: {
                "latency": assess(res["latency"][name], res["latency"][aa], judged),
                "throughput": assess(res["throughput"][name], res["throughput"][aa], judged),
            }
            for view, name in (("service", "on, service"), ("end to end", "on, end to end"))
        }
        overlap = "on, overlapping check (opt-in)"
        summary[label]["overlap"] = {
            "latency": assess(res["latency"][overlap], res["latency"][aa], False),
            "throughput": assess(res["throughput"][overlap], res["throughput"][aa], False),
        }
        summary[label]["encoded per request"] = {"latency": assess(
            res["latency"]["on, encoded per request"], res["latency"][aa], judged)}
        summary[label]["in process"] = assess(res["in_process"]["on, service"],
                                              res["in_process"][aa], judged)
    text = table(("body", "configuration", "p50 ms", "p99 ms", "latency vs off",
                  "requests/s", "slowdown vs off", "server ms (in process)",
                  "in process vs off"), rows)
    return text, summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--child", nargs=2, metavar=("SERVER", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    torch.set_num_threads(1)
    # (rounds, requests per block) for each measurement
    plans: dict[int, dict[str, tuple[int, int]]] = {
        KiB: {"latency": (30, 10) if args.quick else (60, 20),
              "throughput": (8, 80) if args.quick else (20, 160),
              "in_process": (20, 10) if args.quick else (60, 20)},
        MiB: {"latency": (16, 3) if args.quick else (60, 4),
              "throughput": (6, 12) if args.quick else (20, 16),
              "in_process": (16, 3) if args.quick else (60, 4)},
    }
    urls, procs = start_servers()
    try:
        results = {"1 KiB" if size == KiB else "1 MiB": measure(urls, size, plan)
                   for size, plan in plans.items()}
        total = 500 if args.quick else 2000
        load, errors = load_test(urls["on"], total, 8)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    text, summary = report(results)
    body = (
        "Same tiny model behind four servers: \"on\" (the service as shipped) requires a "
        "sha-256 `Content-Digest`, checked before the application sees the body, and adds "
        "one to every response, which the client verifies; \"off\" and \"off (A/A)\" are "
        "identical servers without digests, so their difference is the noise floor; "
        "\"on, overlapping check (opt-in)\" is `overlap_digest=True` (the body is hashed "
        "on the event loop while /predict's worker thread parses it; the model runs only "
        "after it matched), for comparison. "
        "\"service\": the client sends a digest it already has; \"end to end\": the client "
        "hashes every request body before sending it; \"encoded per request\": the client "
        "builds the JSON from a tensor for every request (as `torchverity.serve.Client` "
        "does), compared with the same client without digests. Each round runs one block "
        "per configuration in rotating order; ratios are per round against the same "
        "round's \"off\" block, as median [25th, 75th percentile] over the rounds. "
        "Latency: one client, sequential keep-alive requests. Throughput: 4 client threads "
        "(slowdown = off rate / rate - 1). In process: the same apps "
        "driven through ASGI without network or client.\n\n")
    body += text + "\n"
    body += (f"For scale: one sha-256 over 1 MiB takes {hash_cost_ms(MiB):.2f} ms here; the "
             "server hashes each request once and each response once (tiny here), and the "
             "end-to-end client hashes each request once more before it can send it (the "
             "digest goes in a header, ahead of the body).\n\n")
    body += ("Target: digest verification adds under 5% at 1 MiB, judged on the service "
             "view; met only when the 95% bootstrap interval of the median per-round ratio, "
             "widened by the A/A offset, lies below 5%.\n\n")
    for label, s in summary.items():
        for view in ("service", "end to end"):
            body += (f"- {label}, {view}: latency {s[view]['latency']}; throughput "
                     f"{s[view]['throughput']}.\n")
        body += (f"- {label}, service with the opt-in overlapping check instead (for "
                 f"comparison, not judged): latency {s['overlap']['latency']}; throughput "
                 f"{s['overlap']['throughput']}.\n")
        body += (f"- {label}, body encoded per request: latency "
                 f"{s['encoded per request']['latency']}.\n")
        body += f"- {label}, server in process: {s['in process']}.\n"
    q = statistics.quantiles(load, n=100)
    body += (f"\n## Load: {total} requests of 1 KiB at concurrency 8, digests on\n\n"
             f"{len(load)} answers verified (request and response digests), {errors} errors; "
             f"latency p50 {q[49] * 1000:.1f} ms, p99 {q[98] * 1000:.1f} ms (one inference "
             "thread in the server, so requests queue for the model).\n")
    cmd = "python benchmarks/bench_serve.py" + (" --quick" if args.quick else "")
    print(write_results("serve", "Serving: digest checks on vs off", cmd, body).read_text())
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
